"""DreamDDP planner: which layers each iteration of the period syncs, and when, to hide the WAN.

Paper: "DreamDDP: Accelerating Data Parallel Distributed LLM Training with Layer-wise Scheduled Partial
Synchronization" (arXiv 2502.11058). Partial local SGD averages a disjoint set of layers in each of the ``H``
iterations of a period, so every layer is averaged once per period, while the averaging overlaps the backward
pass. This module decides the sets and predicts the timing; it is pure (no I/O, no torch, no clocks).

Timing model of one iteration (times relative to the start of its backward pass):

* Layers come in FORWARD order; backward runs in reverse. Layer ``x`` is ready, i.e. its gradient exists and
  backward no longer needs its weights, at ``ready(x) = sum(bwd_s of layers x .. L-1)``; ``B = ready(0)``.
* The layers an iteration syncs are cut into buckets of consecutive layers. One bucket is one ring all-reduce
  (one ``GroupSync``) launched when its last layer is ready; one link serves the buckets one after another in
  plan order: ``start = max(ready, previous finish)``, ``finish = start + ring_comm_time(bucket bytes)``.
  Merging layers saves the ``2(N-1)`` latency hops of an all-reduce but waits for the later layer; on a WAN
  link with 80 ms RTT the hops dominate small layers, so per-layer all-reduces (the authors' code) would be
  far too slow. For every segment the bucketing that finishes first is found by a dynamic program over the
  start of the last bucket, O(1) amortized per added layer (see ``_Bucketing`` in `schedule.search`).
* Base DreamDDP (delay 0): averaged weights are needed by the optimizer step, so an iteration's exposed wait
  is ``max(0, finish of its last bucket - B)``. Every iteration runs the same backward; only which layers sync
  differs, so iterations do not interact (the link is idle again when the next backward begins).

Search (the paper's depth-first search with pruning): the backward-order layers are cut into contiguous
segments, one per iteration, walking layer by layer:

1. optimal hiding: if the layer still finishes inside this iteration's backward, it joins this iteration
   without branching (moving it later can never help: the current wait stays 0, and dropping the first layer
   of a later segment never lengthens that segment);
2. at-least-one: an iteration that is opened takes the layer that opens it, so empty iterations only come at
   the end (an empty iteration in the middle is equivalent to one at the end: iterations are identical);
3. delayed assignment: otherwise branch into "take the layer and accept the wait" or "close the iteration and
   move this and all later layers on"; the last iteration takes everything left.

The best completion from (first layer of a segment, iteration) does not depend on how earlier iterations were
cut, so the search is memoised on those states and evaluated bottom-up (no deep recursion); within a state a
branch is cut off as soon as its wait reaches the best found. This makes the search exact for the model above,
up to float rounding (``tests/unit/planner_oracle.py`` checks it), in O(min(H, L) * L^2) steps. Ties keep the
first branch found, i.e. close iterations as early as possible (spreads traffic over more iterations).

WAN extension (``max_delay > 0``; see docs/PLANNING.md): a group launched in
iteration ``h`` with delay ``d`` must land before the optimizer step of iteration ``h + d``, i.e. within
``d * compute_s + B`` of its launch iteration's backward start; the runtime keeps training meanwhile and merges
the averaged delta. The link is one FIFO queue shared by all iterations, cyclically over the period: a sync
that spills into the next iteration delays that iteration's syncs. Exposed wait of iteration ``k`` is how far
the last sync due at ``k`` finishes past ``k``'s backward end, and a wait stretches the iteration, which moves
every later iteration. This is simulated period after period from an idle link until the state at a period
boundary repeats (steady state; a max-plus system becomes periodic after a finite transient; with a cycle of
several periods the per-iteration waits are averaged over it). Delays are at most ``H - 1`` so that a group
lands before the same layers are launched again one period later. Delays are chosen per group by coordinate
descent from all zero, taking a change only if it lowers the total exposed wait (ties: smaller delay). It
starts from several groupings: first the delay-0 optimum (so ``max_delay > 0`` is never worse than
``max_delay = 0``), then k byte-balanced contiguous groups, one all-reduce each, launched at evenly spread
iterations (k = 1, 2, 3, 4, 6, 8, 12, ... up to min(H, L)): once syncs may overlap later iterations, few large
all-reduces (few latency chains) spread over the period usually beat layers packed to hide in one backward.
The best total wins (the exposed wait plus the rounds' cost, below; ties: the least staleness, i.e. the
byte-weighted mean delay, so k staggered groups with short delays beat one group with a long one; then the
earlier starting point). Limits: a heuristic, not an
exhaustive search over groupings and delays; descent finds a local optimum; the delay-0 search properties
(at-least-one in particular) need not hold for a delayed plan.

Round cost (``round_cost_s``): a sync round also costs the trainer time the link model does not see:
launching it (snapshot, pseudo-gradient), landing it (merge, outer step) and the comm path's CPU and GIL
on the cores the trainer runs on. Measured on `bench lm` (a 0.28 s step on a 2-core host, syncs hidden
either way), a plan with a round in every iteration ran 0.1 s per step slower than one with 2 rounds per
period. So the candidates are compared by total exposed wait plus ``round_cost_s`` per round of the
period; plans within one round's cost of the fastest count as alike (the cost is measured, not exact
to a round), and the least stale of them wins. So with a cost, a few large staggered groups beat one
group per iteration wherever both hide; one all-layer group wins only where staggering exposes more than
a round's worth of wait. Bubble filling is off while rounds cost (each repeat is a
round bought for freshness, which the model cannot price in seconds).

Staleness: a sync that lands late merges a pseudo-gradient measured that many steps before, and near a whole
period late that costs the model more than any step time it saves. On `bench lm` at 2 Mbit/s (2-bit
pseudo-gradients, period 20) one group of every layer landing 18-19 steps late (the cheapest plan by a round's
0.08 s) gave held-out 2.577 per replica, worse than one region alone (2.482); two staggered groups landing
10 steps late gave 2.457. So where the plan picked above lands later than `FRESH_SHARE` (0.6) of a period
(byte-weighted), the cheapest candidate that lands within it is taken instead, if it costs at most `STALE_PRICE`
(10%) of the period's compute more than the fastest. The planner predicted the two groups 0.275 s dearer per
5.26 s period (its link times carry `plan_margin`); they waited 0.13 s per period in the run. Links that
carry the syncs easily plan as before: their fastest plans land within a few steps.

Bubble filling: after the plan is fixed, idle stretches of the link inside an iteration's backward window (in
the steady state) get ``repeat=True`` single-layer syncs of layers that fit there entirely, most stale first
(iterations since the layer's base sync landed; ties: earliest-ready layer). A repeat never starts before its
layer is ready and ends before the next sync starts and before the backward ends, so no other sync moves and
no wait changes; a layer is never repeated while its own base sync is in flight. The result is re-simulated
and all repeats are dropped if any wait would grow (a guard for periodic steady states).

The timing model (profiles, jobs, the cyclic link) is in `schedule.timing`, shared with the simulator
(`schedule.simulate`, which replays a plan on a given link; `simulate` and its timeline types are
re-exported here).

Determinism: plain float arithmetic in a fixed order, no iteration over dicts or sets, no randomness, and
every tie broken by a fixed rule, so peers computing from agreed inputs get identical plans.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from dreamp2p.schedule.cost import LayerCost, LinkModel, ring_comm_time, ring_wire_bytes
from dreamp2p.schedule.plan import GroupSync, Plan, is_int
from dreamp2p.schedule.search import Segments, search
from dreamp2p.schedule.simulate import CommBlock, ComputeBlock, IterationTimeline, Timeline, simulate
from dreamp2p.schedule.timing import (
    Cycle,
    Job,
    Profile,
    check_H,
    check_round_cost,
    check_version,
    layers_of,
    profile_of,
    steady_state,
)

__all__ = [
    "PLANNED_SCHEDULES",
    "CommBlock",
    "ComputeBlock",
    "IterationTimeline",
    "Timeline",
    "even_plan",
    "plan_dreamddp",
    "predict",
    "simulate",
    "warmup_plan",
]

# The schedules `predict` models (the planner's what-if comparison), not sync strategies: plsgd is no strategy of
# dreamp2p.sync, and diloco/streaming/co2 have no model here. The strategies are `dreamp2p.config.sync.STRATEGIES`.
PLANNED_SCHEDULES = ("dreamddp", "plsgd", "localsgd", "ssgd")
_MAX_DESCENT_PASSES = 16
# what a plan may cost (exposed wait plus rounds, as a share of the period's compute) to land its syncs
# within FRESH_SHARE of a period rather than later; see "Staleness" in the module docstring
STALE_PRICE = 0.1
# how late (byte-weighted, as a share of the period) a plan's syncs may land before freshness is bought:
# two staggered groups land half a period late and a step or two more
FRESH_SHARE = 0.6


# -------------------------------------------------------------------------------- delays and bubble filling


def _choose_delays(jobs: list[Job], H: int, B: float, F: float, max_delay: int) -> tuple[list[Job], float]:
    """Coordinate descent on per-group delays; only strict improvements (or equal totals, smaller d) are taken.

    Returns the jobs with their delays and the steady-state total exposed wait of one period.
    """
    current = list(jobs)
    total = math.fsum(steady_state(current, H, B, F).exposed)
    dmax = min(max_delay, H - 1)
    if dmax == 0 or not jobs:
        return current, total
    for _ in range(_MAX_DESCENT_PASSES):
        changed = False
        for g in range(len(current)):
            best_d, best_total = current[g].delay, total
            for d in range(dmax + 1):
                if best_total <= 0 and d >= best_d:
                    break  # nothing is exposed below zero, and ties go to the smaller delay: no later d can win
                if d == current[g].delay:
                    continue
                trial = list(current)
                trial[g] = replace(current[g], delay=d)
                t = math.fsum(steady_state(trial, H, B, F).exposed)
                if t < best_total or (t == best_total and d < best_d):
                    best_d, best_total = d, t
            if best_d != current[g].delay:
                current[g] = replace(current[g], delay=best_d)
                total = best_total
                changed = True
        if not changed:
            break
    return current, total


def weighted_delay(delays: Sequence[tuple[int, float]]) -> float | None:
    """The mean of ``(delay, link time)`` pairs' delays weighted by their link time; None when none has any."""
    weight = math.fsum(w for _, w in delays)
    return math.fsum(d * w for d, w in delays) / weight if weight > 0 else None


def _staleness(jobs: Sequence[Job]) -> float:
    """Steps a parameter's average lands late, weighted by bytes (each group's link time): the tie-breaker
    between plans that hide alike. k staggered groups of delay D/k beat one group of delay D; both hide."""
    late = weighted_delay([(job.delay, job.comm) for job in jobs])
    return float(sum(job.delay for job in jobs)) if late is None else late


def _pick(scored: Sequence[tuple[float, float, list[Job]]], round_cost_s: float, H: int, period_s: float) -> list[Job]:
    """Of the candidates' (cost, staleness, jobs): the freshest of those within one round's cost of the fastest
    (the cost is a measured figure, not exact to a round; ties: the earlier candidate). Where that one lands
    later than `FRESH_SHARE` of a period, the cheapest that lands within it, if it costs at most `STALE_PRICE`
    of the period's compute more than the fastest (see the module docstring)."""
    fastest = min(cost for cost, _, _ in scored)
    best = min((c for c in scored if c[0] <= fastest + round_cost_s), key=lambda c: c[1])
    late = FRESH_SHARE * H
    if best[1] <= late:
        return best[2]
    fresh = [c for c in scored if c[1] <= late and c[0] <= fastest + max(round_cost_s, STALE_PRICE * period_s)]
    return min(fresh, key=lambda c: c[0])[2] if fresh else best[2]


def _spread_candidates(prof: Profile, seg: Segments, H: int) -> list[list[Job]]:
    """Delay-friendly starting points: k byte-balanced contiguous groups, one all-reduce each, spread evenly.

    The delay-0 optimum packs layers to hide inside one backward pass; once syncs may overlap later iterations,
    fewer and larger all-reduces (fewer latency chains) spread over the period usually do better. k runs over
    1, 2, 3, 4, 6, 8, 12, ... up to min(H, L) to keep the search small.
    """
    L = prof.L
    kmax = min(H, L)
    ks: list[int] = []
    k = 1
    while k <= kmax:
        ks.extend(x for x in (k, k + k // 2) if x <= kmax and x not in ks)
        k *= 2
    if kmax not in ks:
        ks.append(kmax)
    total = seg.prefix[L]
    out = []
    for k in ks:
        bounds = [0]
        for i in range(1, k):
            p = bounds[-1] + 1
            while p < L - (k - i) and seg.prefix[p] * k < i * total:
                p += 1
            bounds.append(p)
        bounds.append(L)
        jobs = []
        for g, (i, j) in enumerate(itertools.pairwise(bounds)):
            layers = layers_of(L, i, j)
            jobs.append(Job(g * H // k, layers, 0, False, prof.ready[layers[0]], seg.comm(i, j)))
        out.append(jobs)
    return out


def _bubble_fill(jobs: list[Job], prof: Profile, link: LinkModel, H: int) -> list[tuple[Job, float]]:
    """Repeat syncs that fit in idle link time of each backward window; returned with their planned start."""
    L, B = prof.L, prof.B
    cyc = steady_state(jobs, H, B, prof.F)
    base_at = [(0, 0)] * L  # forward layer -> (launch iteration, delay) of its base sync
    for job in jobs:
        for x in job.layers:
            base_at[x] = (job.iteration, job.delay)
    repeats: list[tuple[Job, float]] = []
    for h in range(H):
        gaps: list[tuple[float, float]] = []
        cur = cyc.carry[h]
        for j, job in enumerate(jobs):
            if job.iteration != h:
                continue
            if cyc.starts[j] > cur:
                gaps.append((cur, min(cyc.starts[j], B)))
            cur = max(cur, cyc.finishes[j])
        if cur < B:
            gaps.append((cur, B))
        gaps = [(a, b) for a, b in gaps if a < b]
        candidates = []
        for x in range(L):
            hb, d = base_at[x]
            since_launch = (h - hb) % H
            if since_launch <= d:  # the layer's base sync is launched now or still in flight
                continue
            staleness = since_launch - d
            candidates.append((-staleness, L - 1 - x, x))
        candidates.sort()
        for _, _, x in candidates:
            c = ring_comm_time(prof.nbytes[x], link)
            if c <= 0.0:
                continue  # nothing to send: a repeat would only add an empty round
            r = prof.ready[x]
            for g, (a, b) in enumerate(gaps):
                start = max(a, r)
                if start + c <= b:
                    pieces = [(a, start), (start + c, b)]
                    gaps[g : g + 1] = [(p, q) for p, q in pieces if p < q]
                    repeats.append((Job(h, (x,), 0, True, r, c), start))
                    break
    return repeats


def _link_order(jobs: Sequence[Job], starts: Sequence[float]) -> list[Job]:
    order = sorted(range(len(jobs)), key=lambda j: (jobs[j].iteration, starts[j], j))
    return [jobs[j] for j in order]


def _plan_from_jobs(jobs: list[Job], prof: Profile, H: int, version: int, effective_step: int) -> tuple[Plan, Cycle]:
    cyc = steady_state(jobs, H, prof.B, prof.F)
    syncs = tuple(
        GroupSync(job.iteration, job.layers, job.delay, cyc.starts[j], job.comm, job.repeat)
        for j, job in enumerate(jobs)
    )
    plan = Plan(version, effective_step, H, prof.names, syncs, cyc.exposed, prof.compute_s)
    return plan, cyc


# ------------------------------------------------------------------------------------------------- public API


def even_plan(costs: Sequence[LayerCost], H: int, version: int = 0, effective_step: int = 0, delay: int = 0) -> Plan:
    """PLSGD baseline: ceil(L/H) contiguous backward-order layers per iteration, no timing.

    Each iteration's layers form one sync with ``start_s = comm_s = 0`` and no predicted wait; iterations
    beyond the layers (``H > L``) sync nothing. ``delay`` (capped at ``H - 1``) lets every sync land that
    many iterations later: before the link is measured, a WAN run should not block on it.
    """
    prof = profile_of(costs)
    check_H(H)
    check_version(version, effective_step)
    if not is_int(delay) or delay < 0:
        raise ValueError(f"delay must be an int >= 0, got {delay!r}")
    delay = min(delay, H - 1)
    L = prof.L
    per = -(-L // H)
    syncs = []
    for h in range(H):
        i, j = h * per, min(L, (h + 1) * per)
        if i < j:
            syncs.append(GroupSync(h, layers_of(L, i, j), delay, 0.0, 0.0))
    return Plan(version, effective_step, H, prof.names, tuple(syncs), (0.0,) * H, prof.compute_s)


def warmup_plan(costs: Sequence[LayerCost], H: int, groups: int = 2, delay: int = 0) -> Plan:
    """DreamDDP's plan before the first measured one: ``groups`` syncs of about equal bytes, spread evenly.

    Backward-order contiguous layers, group k launched at iteration ``k * H // groups``. Few large rounds
    rather than the even split's ceil(L/H) layers per iteration: every round costs the comm path a fixed
    amount of CPU besides its bytes, and before the link is measured nothing favours small ones. Large
    rounds also measure the link end to end, which the first measured plan is made from.
    """
    prof = profile_of(costs)
    check_H(H)
    if not is_int(groups) or groups < 1:
        raise ValueError(f"groups must be an int >= 1, got {groups!r}")
    if not is_int(delay) or delay < 0:
        raise ValueError(f"delay must be an int >= 0, got {delay!r}")
    L = prof.L
    g = min(groups, L, H)
    sizes = [prof.nbytes[L - 1 - b] for b in range(L)]  # backward order
    total = sum(sizes)
    cuts = [0]
    acc = 0
    for b, size in enumerate(sizes):
        acc += size
        k = len(cuts)
        # close group k-1 once it holds its share, leaving at least one layer for each later group
        if k < g and acc * g >= k * total and L - (b + 1) >= g - k:
            cuts.append(b + 1)
    while len(cuts) < g:  # zero-byte tails: give each remaining group one layer
        cuts.append(cuts[-1] + 1)
    cuts.append(L)
    delay = min(delay, H - 1)
    syncs = tuple(GroupSync(k * H // g, layers_of(L, cuts[k], cuts[k + 1]), delay, 0.0, 0.0) for k in range(g))
    return Plan(0, 0, H, prof.names, syncs, (0.0,) * H, prof.compute_s)


def plan_dreamddp(
    costs: Sequence[LayerCost],
    link: LinkModel,
    H: int,
    *,
    version: int = 0,
    effective_step: int = 0,
    max_delay: int = 0,
    bubble_fill: bool = True,
    round_cost_s: float = 0.0,
) -> Plan:
    """DreamDDP schedule for ``costs`` (forward order) on ``link`` with period ``H`` (see module docstring).

    ``round_cost_s``: trainer seconds one sync round costs besides its link time (see "Round cost" in the
    module docstring); 0 prices rounds by the link alone.
    """
    prof = profile_of(costs)
    if not isinstance(link, LinkModel):
        raise ValueError(f"link must be a LinkModel, got {type(link).__name__}")
    check_H(H)
    check_version(version, effective_step)
    if not is_int(max_delay) or max_delay < 0:
        raise ValueError(f"max_delay must be an int >= 0, got {max_delay!r}")
    if not isinstance(bubble_fill, bool):
        raise ValueError(f"bubble_fill must be a bool, got {bubble_fill!r}")
    check_round_cost(round_cost_s)
    L = prof.L
    seg = Segments(prof, link)
    jobs: list[Job] = []
    for h, (s, e) in enumerate(search(seg, prof.B, H)):
        for i, j in seg.buckets(s, e):
            layers = layers_of(L, i, j)
            jobs.append(Job(h, layers, 0, False, prof.ready[layers[0]], seg.comm(i, j)))
    if max_delay > 0 and H > 1:
        # the delay-0 optimum goes first so that ties keep it: max_delay > 0 is never worse than 0
        scored = []
        for cand in [jobs, *_spread_candidates(prof, seg, H)]:
            chosen, total = _choose_delays(cand, H, prof.B, prof.F, max_delay)
            rounds = sum(1 for job in chosen if job.comm > 0)  # a group of no bytes starts no round
            scored.append((math.fsum((total, rounds * round_cost_s)), _staleness(chosen), chosen))
        jobs = _pick(scored, round_cost_s, H, H * (prof.F + prof.B))
    plan, cyc = _plan_from_jobs(jobs, prof, H, version, effective_step)
    if not bubble_fill or round_cost_s > 0:
        return plan  # a repeat is one more round of trainer time, bought for freshness the model cannot price
    repeats = _bubble_fill(jobs, prof, link, H)
    if not repeats:
        return plan
    all_jobs = jobs + [job for job, _ in repeats]
    all_starts = list(cyc.starts) + [start for _, start in repeats]
    filled, _ = _plan_from_jobs(_link_order(all_jobs, all_starts), prof, H, version, effective_step)
    if any(new > old for new, old in zip(filled.exposed_s, plan.exposed_s, strict=True)):
        return plan  # guard: repeats must never cost wait (only reachable with multi-period steady states)
    return filled


def predict(
    costs: Sequence[LayerCost],
    link: LinkModel,
    H: int,
    strategy: str,
    *,
    max_delay: int = 0,
    bubble_fill: bool = True,
    round_cost_s: float = 0.0,
) -> dict[str, Any]:
    """Predicted step time, compute utilization and wire bytes per step (per peer) of one strategy.

    ``dreamddp``: the planned schedule. ``plsgd``: ``even_plan``, each iteration's layers as one all-reduce
    launched when all of them are ready. ``localsgd``: the full model every H steps, blocking. ``ssgd``: the
    full model's gradients every step, bucketed and overlapped with backward (ASC-WFBP), i.e. the DreamDDP
    timing model with H = 1. Every strategy's step also pays ``round_cost_s`` per sync round (its rounds
    per period over the period; ``rounds_per_step`` in the result): trainer time besides the link's.
    """
    prof = profile_of(costs)
    check_H(H)
    check_round_cost(round_cost_s)
    if strategy not in PLANNED_SCHEDULES:
        raise ValueError(f"unknown strategy {strategy!r}; expected one of {list(PLANNED_SCHEDULES)}")
    total_bytes = sum(prof.nbytes)
    if strategy == "localsgd":
        exposed = ring_comm_time(total_bytes, link) / H
        wire = ring_wire_bytes(total_bytes, link) / H
        period = H
        rounds = 1.0 / H if link.world > 1 else 0.0
    else:
        if strategy == "dreamddp":
            plan = plan_dreamddp(
                costs, link, H, max_delay=max_delay, bubble_fill=bubble_fill, round_cost_s=round_cost_s
            )
        elif strategy == "ssgd":
            plan = plan_dreamddp(costs, link, 1, bubble_fill=False)
        else:
            plan = even_plan(costs, H)
        timeline = simulate(plan, costs, link)
        period = plan.period
        exposed = math.fsum(it.exposed_s for it in timeline) / period
        wire = math.fsum(ring_wire_bytes(sum(prof.nbytes[x] for x in s.layers), link) for s in plan.syncs) / period
        rounds = rounds_per_step(plan) if link.world > 1 else 0.0
    step = prof.compute_s + exposed + rounds * round_cost_s
    return {
        "strategy": strategy,
        "period": period,
        "compute_s": prof.compute_s,
        "exposed_s": exposed,
        "step_time_s": step,
        "compute_utilization": prof.compute_s / step if step > 0 else 1.0,
        "bytes_per_step": wire,
        "rounds_per_step": rounds,
    }


def rounds_per_step(plan: Plan) -> float:
    """Sync rounds the plan starts per step (repeats included): what ``round_cost_s`` is paid on."""
    return len(plan.syncs) / plan.period
