"""DreamDDP planner and simulator: which layers each iteration of the period syncs, and when, to hide the WAN.

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
  start of the last bucket, O(1) amortized per added layer (see ``_Bucketing``).
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
The best total wins (ties: the least staleness, i.e. the byte-weighted mean delay, so k staggered groups
with short delays beat one group with a long one; then the earlier starting point). Limits: a heuristic, not an
exhaustive search over groupings and delays; descent finds a local optimum; the delay-0 search properties
(at-least-one in particular) need not hold for a delayed plan.

Bubble filling: after the plan is fixed, idle stretches of the link inside an iteration's backward window (in
the steady state) get ``repeat=True`` single-layer syncs of layers that fit there entirely, most stale first
(iterations since the layer's base sync landed; ties: earliest-ready layer). A repeat never starts before its
layer is ready and ends before the next sync starts and before the backward ends, so no other sync moves and
no wait changes; a layer is never repeated while its own base sync is in flight. The result is re-simulated
and all repeats are dropped if any wait would grow (a guard for periodic steady states).

Determinism: plain float arithmetic in a fixed order, no iteration over dicts or sets, no randomness, and
every tie broken by a fixed rule, so peers computing from agreed inputs get identical plans.
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from dreamp2p.schedule.cost import LayerCost, LinkModel, ring_comm_time, ring_wire_bytes
from dreamp2p.schedule.plan import GroupSync, Plan, is_int

STRATEGIES = ("dreamddp", "plsgd", "localsgd", "ssgd")
# A steady state is normally reached in a few periods; the cap only bounds pathological float behaviour.
_MAX_PERIODS = 64
_MAX_DESCENT_PASSES = 16


# ------------------------------------------------------------------------------------------------ timing model


@dataclass(frozen=True)
class _Profile:
    names: tuple[str, ...]
    fwd: tuple[float, ...]  # forward order
    nbytes: tuple[int, ...]  # forward order
    ready: tuple[float, ...]  # forward order: when layer x's gradient is ready in backward
    F: float  # total forward time
    B: float  # total backward time

    @property
    def L(self) -> int:
        return len(self.names)

    @property
    def compute_s(self) -> float:
        return self.F + self.B


def _profile(costs: Sequence[LayerCost]) -> _Profile:
    if isinstance(costs, str | bytes) or not isinstance(costs, Sequence):
        raise ValueError("costs must be a sequence of LayerCost")
    if not costs:
        raise ValueError("costs must hold at least one layer")
    for i, c in enumerate(costs):
        if not isinstance(c, LayerCost):
            raise ValueError(f"costs[{i}] must be a LayerCost, got {type(c).__name__}")
    names = tuple(c.name for c in costs)
    if len(set(names)) != len(names):
        raise ValueError("layer names must be unique")
    L = len(costs)
    ready = [0.0] * L
    acc = 0.0
    for x in range(L - 1, -1, -1):  # backward order: output layer first
        acc += costs[x].bwd_s
        ready[x] = acc
    fwd = tuple(float(c.fwd_s) for c in costs)
    F = 0.0
    for t in fwd:
        F += t
    return _Profile(names, fwd, tuple(c.nbytes for c in costs), tuple(ready), F, acc)


def _check_H(H: int) -> None:
    if not is_int(H) or H < 1:
        raise ValueError(f"H (the period) must be an int >= 1, got {H!r}")


def _check_version(version: int, effective_step: int) -> None:
    if not is_int(version) or version < 0:
        raise ValueError(f"version must be an int >= 0, got {version!r}")
    if not is_int(effective_step) or effective_step < 0:
        raise ValueError(f"effective_step must be an int >= 0, got {effective_step!r}")


def _layers_of(L: int, i: int, j: int) -> tuple[int, ...]:
    """Forward indices of backward positions [i, j), ascending."""
    return tuple(range(L - j, L - i))


class _Bucketing:
    """Best bucketing of backward positions [s, j) for growing j: one start s, extended lazily.

    ``f[j - s]`` is the earliest finish of positions [s, j) with the link idle at backward start, ``cut[j - s]``
    the first position of the last bucket achieving it; ``f`` is non-decreasing in j. With ``r`` the ready
    time of position j-1 (when the last bucket launches), a last bucket [i, j) finishes at
    ``max(r, f[i]) + comm(i, j)``. The candidates i fall into three runs, each with a known best, so a step
    costs O(1) amortized instead of O(j - s):

    * ``f[i] <= r`` (a prefix, as f is non-decreasing): the link is idle at launch, fewer bytes win, so the
      largest such i;
    * ``f[i] > r`` with a non-empty bucket: ``f[i] + lat + k * (P[j] - P[i])``, the least ``f[i] - k * P[i]``
      over a window whose both ends only move right: a monotone deque;
    * ``f[i] > r`` with only zero-byte layers in the bucket (no all-reduce at all): the least i.

    Finishes are then computed with ``ring_comm_time`` exactly as the simulator does, so the linear key only
    selects (it may pick a candidate a few ulps from the true optimum, never more). Ties between the runs go to
    the smaller i, i.e. the larger last bucket.
    """

    def __init__(self, s: int, ready_b: Sequence[float], prefix: Sequence[int], link: LinkModel) -> None:
        self.s = s
        self.ready_b = ready_b
        self.prefix = prefix
        self.link = link
        self.f = [0.0]  # the link is idle when backward starts: nothing of an earlier iteration is pending
        self.cut = [s]
        self.idle_end = s + 1  # positions [s, idle_end) have f <= r (f[s] = 0 <= every ready time)
        self.nonzero_end = s  # positions [s, nonzero_end) leave bytes in the bucket [i, j)
        self.pushed = s
        self.window: deque[tuple[float, int]] = deque()  # (f[i] - k * P[i], i), keys ascending
        world = link.world
        self.k = link.codec_ratio * (2.0 * (world - 1) / world) / link.bandwidth_Bps if world > 1 else 0.0

    def _value(self, i: int, j: int, r: float) -> float:
        return max(r, self.f[i - self.s]) + ring_comm_time(self.prefix[j] - self.prefix[i], self.link)

    def finish(self, e: int) -> float:
        s, f, prefix = self.s, self.f, self.prefix
        for j in range(s + len(f), e + 1):
            r = self.ready_b[j - 1]
            while self.idle_end < j and f[self.idle_end - s] <= r:
                self.idle_end += 1
            while self.nonzero_end < j and prefix[self.nonzero_end] < prefix[j]:
                self.nonzero_end += 1
            while self.pushed < self.nonzero_end:
                i = self.pushed
                key = f[i - s] - self.k * prefix[i]
                while self.window and self.window[-1][0] > key:
                    self.window.pop()
                self.window.append((key, i))
                self.pushed += 1
            while self.window and self.window[0][1] < self.idle_end:
                self.window.popleft()
            best_i = self.idle_end - 1
            best = self._value(best_i, j, r)
            if self.window:
                i = self.window[0][1]
                v = self._value(i, j, r)
                if v < best:
                    best, best_i = v, i
            i = max(self.idle_end, self.nonzero_end)
            if i < j:
                v = self._value(i, j, r)
                if v < best:
                    best, best_i = v, i
            f.append(best)
            self.cut.append(best_i)
        return f[e - s]


class _Segments:
    """Earliest finish and bucketing of any segment [s, e) of backward positions (position k = layer L-1-k)."""

    def __init__(self, prof: _Profile, link: LinkModel) -> None:
        L = prof.L
        self.L = L
        self.link = link
        self.ready_b = [prof.ready[L - 1 - k] for k in range(L)]
        self.prefix = [0] * (L + 1)
        for k in range(L):
            self.prefix[k + 1] = self.prefix[k] + prof.nbytes[L - 1 - k]
        self._by_start: list[_Bucketing | None] = [None] * L

    def comm(self, i: int, j: int) -> float:
        return ring_comm_time(self.prefix[j] - self.prefix[i], self.link)

    def _start(self, s: int) -> _Bucketing:
        b = self._by_start[s]
        if b is None:
            b = _Bucketing(s, self.ready_b, self.prefix, self.link)
            self._by_start[s] = b
        return b

    def finish(self, s: int, e: int) -> float:
        return self._start(s).finish(e)

    def buckets(self, s: int, e: int) -> list[tuple[int, int]]:
        b = self._start(s)
        b.finish(e)
        out = []
        j = e
        while j > s:
            i = b.cut[j - s]
            out.append((i, j))
            j = i
        out.reverse()
        return out


def _search(seg: _Segments, B: float, H: int) -> list[tuple[int, int]]:
    """Optimal contiguous segments (backward positions [s, e)) of the non-empty iterations, in order."""
    L = seg.L
    He = min(H, L)  # at-least-one: with L layers at most L iterations are non-empty
    cost = [[0.0] * (L + 1) for _ in range(He + 1)]
    end = [[L] * (L + 1) for _ in range(He + 1)]
    for h in range(He - 1, -1, -1):
        for s in range(h, L):  # at-least-one: iteration h is opened by layer s >= h
            if h == He - 1:
                cost[h][s] = max(0.0, seg.finish(s, L) - B)
                continue
            best, best_e = math.inf, L
            e = s + 1
            while True:
                cur = max(0.0, seg.finish(s, e) - B)
                if cur >= best:
                    break  # prune: taking more layers never lowers this iteration's wait
                if e == L:
                    best, best_e = cur, L
                    break
                if seg.finish(s, e + 1) <= B:  # optimal hiding: the next layer hides here too
                    e += 1
                    continue
                total = cur + cost[h + 1][e]  # delayed assignment: close here, the rest starts iteration h+1
                if total < best:
                    best, best_e = total, e
                e += 1
            cost[h][s], end[h][s] = best, best_e
    out = []
    s, h = 0, 0
    while s < L:
        e = end[h][s]
        out.append((s, e))
        s, h = e, h + 1
    return out


# ---------------------------------------------------------------------------------------- cyclic link simulator


@dataclass(frozen=True)
class _Job:
    iteration: int
    layers: tuple[int, ...]
    delay: int
    repeat: bool
    release: float  # ready time of the group's last-ready layer, relative to its iteration's backward start
    comm: float


@dataclass(frozen=True)
class _Cycle:
    exposed: tuple[float, ...]  # per iteration, steady state
    starts: tuple[float, ...]  # per job, relative to its launch iteration's backward start
    finishes: tuple[float, ...]
    carry: tuple[float, ...]  # per iteration: link busy until (relative to its backward start) before its syncs


def _cycle(jobs: Sequence[_Job], H: int, B: float, F: float) -> _Cycle:
    """Steady-state timing of a period whose syncs share one FIFO link (jobs are given in link order)."""
    per_iter: list[list[int]] = [[] for _ in range(H)]
    for j, job in enumerate(jobs):
        per_iter[job.iteration].append(j)
    n = len(jobs)
    starts, finishes = [0.0] * n, [0.0] * n
    link_free = 0.0
    pending: list[tuple[int, int, float]] = []  # (iterations until due, job, finish rel. to current backward)
    history: list[tuple[float, tuple[tuple[int, int, float], ...]]] = [(link_free, ())]
    exposures: list[list[float]] = []
    carry = [0.0] * H
    cycle_len = 1
    for _ in range(_MAX_PERIODS):
        exposed = [0.0] * H
        for h in range(H):
            carry[h] = link_free
            for j in per_iter[h]:
                start = max(jobs[j].release, link_free)
                finish = start + jobs[j].comm
                link_free = finish
                starts[j], finishes[j] = start, finish
                pending.append((jobs[j].delay, j, finish))
            wait = 0.0
            kept = []
            for left, j, finish in pending:
                if left == 0:
                    wait = max(wait, finish - B)
                else:
                    kept.append((left, j, finish))
            exposed[h] = wait
            # next backward starts after the rest of this backward, the wait and the next forward
            shift = B + wait + F
            link_free = max(0.0, link_free - shift)
            pending = [(left - 1, j, finish - shift) for left, j, finish in kept]
        exposures.append(exposed)
        state = (link_free, tuple(pending))
        if state in history:
            cycle_len = len(history) - history.index(state)
            break
        history.append(state)
    if cycle_len == 1:
        final = tuple(exposures[-1])
    else:  # periodic steady state of several periods: average each iteration's wait over the cycle
        tail = exposures[-cycle_len:]
        final = tuple(math.fsum(p[h] for p in tail) / cycle_len for h in range(H))
    return _Cycle(final, tuple(starts), tuple(finishes), tuple(carry))


def _choose_delays(jobs: list[_Job], H: int, B: float, F: float, max_delay: int) -> tuple[list[_Job], float]:
    """Coordinate descent on per-group delays; only strict improvements (or equal totals, smaller d) are taken.

    Returns the jobs with their delays and the steady-state total exposed wait of one period.
    """
    current = list(jobs)
    total = math.fsum(_cycle(current, H, B, F).exposed)
    dmax = min(max_delay, H - 1)
    if dmax == 0 or not jobs:
        return current, total
    for _ in range(_MAX_DESCENT_PASSES):
        changed = False
        for g in range(len(current)):
            best_d, best_total = current[g].delay, total
            for d in range(dmax + 1):
                if d == current[g].delay:
                    continue
                trial = list(current)
                trial[g] = replace(current[g], delay=d)
                t = math.fsum(_cycle(trial, H, B, F).exposed)
                if t < best_total or (t == best_total and d < best_d):
                    best_d, best_total = d, t
            if best_d != current[g].delay:
                current[g] = replace(current[g], delay=best_d)
                total = best_total
                changed = True
        if not changed:
            break
    return current, total


def _staleness(jobs: Sequence[_Job]) -> float:
    """Steps a parameter's average lands late, weighted by bytes (each group's link time): the tie-breaker
    between plans that hide alike. k staggered groups of delay D/k beat one group of delay D; both hide."""
    weight = math.fsum(job.comm for job in jobs)
    if weight <= 0:
        return float(sum(job.delay for job in jobs))
    return math.fsum(job.delay * job.comm for job in jobs) / weight


def _spread_candidates(prof: _Profile, seg: _Segments, H: int) -> list[list[_Job]]:
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
            layers = _layers_of(L, i, j)
            jobs.append(_Job(g * H // k, layers, 0, False, prof.ready[layers[0]], seg.comm(i, j)))
        out.append(jobs)
    return out


def _bubble_fill(jobs: list[_Job], prof: _Profile, link: LinkModel, H: int) -> list[tuple[_Job, float]]:
    """Repeat syncs that fit in idle link time of each backward window; returned with their planned start."""
    L, B = prof.L, prof.B
    cyc = _cycle(jobs, H, B, prof.F)
    base_at = [(0, 0)] * L  # forward layer -> (launch iteration, delay) of its base sync
    for job in jobs:
        for x in job.layers:
            base_at[x] = (job.iteration, job.delay)
    repeats: list[tuple[_Job, float]] = []
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
                    repeats.append((_Job(h, (x,), 0, True, r, c), start))
                    break
    return repeats


def _link_order(jobs: Sequence[_Job], starts: Sequence[float]) -> list[_Job]:
    order = sorted(range(len(jobs)), key=lambda j: (jobs[j].iteration, starts[j], j))
    return [jobs[j] for j in order]


def _plan_from_jobs(jobs: list[_Job], prof: _Profile, H: int, version: int, effective_step: int) -> tuple[Plan, _Cycle]:
    cyc = _cycle(jobs, H, prof.B, prof.F)
    syncs = tuple(
        GroupSync(job.iteration, job.layers, job.delay, cyc.starts[j], job.comm, job.repeat)
        for j, job in enumerate(jobs)
    )
    plan = Plan(version, effective_step, H, prof.names, syncs, cyc.exposed, prof.compute_s)
    return plan, cyc


# ------------------------------------------------------------------------------------------------- public API


def even_plan(costs: Sequence[LayerCost], H: int, version: int = 0, effective_step: int = 0, delay: int = 0) -> Plan:
    """PLSGD baseline and warm-up plan: ceil(L/H) contiguous backward-order layers per iteration, no timing.

    Each iteration's layers form one sync with ``start_s = comm_s = 0`` and no predicted wait; iterations
    beyond the layers (``H > L``) sync nothing. ``delay`` (capped at ``H - 1``) lets every sync land that
    many iterations later: before the link is measured, a WAN run should not block on it.
    """
    prof = _profile(costs)
    _check_H(H)
    _check_version(version, effective_step)
    if not is_int(delay) or delay < 0:
        raise ValueError(f"delay must be an int >= 0, got {delay!r}")
    delay = min(delay, H - 1)
    L = prof.L
    per = -(-L // H)
    syncs = []
    for h in range(H):
        i, j = h * per, min(L, (h + 1) * per)
        if i < j:
            syncs.append(GroupSync(h, _layers_of(L, i, j), delay, 0.0, 0.0))
    return Plan(version, effective_step, H, prof.names, tuple(syncs), (0.0,) * H, prof.compute_s)


def plan_dreamddp(
    costs: Sequence[LayerCost],
    link: LinkModel,
    H: int,
    *,
    version: int = 0,
    effective_step: int = 0,
    max_delay: int = 0,
    bubble_fill: bool = True,
) -> Plan:
    """DreamDDP schedule for ``costs`` (forward order) on ``link`` with period ``H`` (see module docstring)."""
    prof = _profile(costs)
    if not isinstance(link, LinkModel):
        raise ValueError(f"link must be a LinkModel, got {type(link).__name__}")
    _check_H(H)
    _check_version(version, effective_step)
    if not is_int(max_delay) or max_delay < 0:
        raise ValueError(f"max_delay must be an int >= 0, got {max_delay!r}")
    if not isinstance(bubble_fill, bool):
        raise ValueError(f"bubble_fill must be a bool, got {bubble_fill!r}")
    L = prof.L
    seg = _Segments(prof, link)
    jobs: list[_Job] = []
    for h, (s, e) in enumerate(_search(seg, prof.B, H)):
        for i, j in seg.buckets(s, e):
            layers = _layers_of(L, i, j)
            jobs.append(_Job(h, layers, 0, False, prof.ready[layers[0]], seg.comm(i, j)))
    if max_delay > 0 and H > 1:
        # the delay-0 optimum goes first so that ties keep it: max_delay > 0 is never worse than 0
        best: tuple[float, float] | None = None
        for cand in [jobs, *_spread_candidates(prof, seg, H)]:
            chosen, total = _choose_delays(cand, H, prof.B, prof.F, max_delay)
            key = (total, _staleness(chosen))
            if best is None or key < best:
                best, jobs = key, chosen
    plan, cyc = _plan_from_jobs(jobs, prof, H, version, effective_step)
    if not bubble_fill:
        return plan
    repeats = _bubble_fill(jobs, prof, link, H)
    if not repeats:
        return plan
    all_jobs = jobs + [job for job, _ in repeats]
    all_starts = list(cyc.starts) + [start for _, start in repeats]
    filled, _ = _plan_from_jobs(_link_order(all_jobs, all_starts), prof, H, version, effective_step)
    if any(new > old for new, old in zip(filled.exposed_s, plan.exposed_s, strict=True)):
        return plan  # guard: repeats must never cost wait (only reachable with multi-period steady states)
    return filled


# ------------------------------------------------------------------------------------------------- simulation


@dataclass(frozen=True)
class ComputeBlock:
    """Forward or backward computation of one layer, in seconds from the start of the simulated period."""

    layer: int  # forward index
    phase: str  # "fwd" or "bwd"
    start_s: float
    end_s: float


@dataclass(frozen=True)
class CommBlock:
    """One sync on the link, in seconds from the start of the simulated period (may run past its iteration)."""

    layers: tuple[int, ...]
    launch_iteration: int
    due_iteration: int  # (launch + delay) % H: its result is merged before this iteration's optimizer step
    repeat: bool
    start_s: float
    end_s: float


@dataclass(frozen=True)
class IterationTimeline:
    """Gantt data of one iteration of the steady-state period."""

    iteration: int
    start_s: float  # forward begins
    backward_start_s: float
    backward_end_s: float
    end_s: float  # optimizer step: backward end plus the exposed wait
    exposed_s: float
    compute: tuple[ComputeBlock, ...]
    comm: tuple[CommBlock, ...]  # syncs launched in this iteration


# The per-iteration timeline is the unit a Gantt chart is drawn from.
Timeline = IterationTimeline


def simulate(plan: Plan, costs: Sequence[LayerCost], link: LinkModel) -> list[IterationTimeline]:
    """Steady-state timeline of one period of ``plan`` executed with ``costs`` on ``link``.

    Comm times are recomputed from ``link`` (the plan's predictions are not trusted), in the plan's link order,
    with the same cyclic model the planner uses; so a plan can be judged on a link it was not made for.
    """
    prof = _profile(costs)
    if prof.names != plan.layer_names:
        raise ValueError("costs do not describe the plan's layers (names differ)")
    H = plan.period
    jobs = [
        _Job(
            s.iteration,
            s.layers,
            s.delay,
            s.repeat,
            max(prof.ready[x] for x in s.layers),
            ring_comm_time(sum(prof.nbytes[x] for x in s.layers), link),
        )
        for s in plan.syncs
    ]
    cyc = _cycle(jobs, H, prof.B, prof.F)
    out = []
    t = 0.0
    L = prof.L
    for h in range(H):
        compute = []
        clock = t
        for x in range(L):
            compute.append(ComputeBlock(x, "fwd", clock, clock + prof.fwd[x]))
            clock += prof.fwd[x]
        bstart = clock
        for x in range(L - 1, -1, -1):
            compute.append(ComputeBlock(x, "bwd", clock, clock + costs[x].bwd_s))
            clock += costs[x].bwd_s
        bend = bstart + prof.B
        comm = tuple(
            CommBlock(job.layers, h, (h + job.delay) % H, job.repeat, bstart + cyc.starts[j], bstart + cyc.finishes[j])
            for j, job in enumerate(jobs)
            if job.iteration == h
        )
        end = bend + cyc.exposed[h]
        out.append(IterationTimeline(h, t, bstart, bend, end, cyc.exposed[h], tuple(compute), comm))
        t = end
    return out


def predict(
    costs: Sequence[LayerCost],
    link: LinkModel,
    H: int,
    strategy: str,
    *,
    max_delay: int = 0,
    bubble_fill: bool = True,
) -> dict[str, Any]:
    """Predicted step time, compute utilization and wire bytes per step (per peer) of one strategy.

    ``dreamddp``: the planned schedule. ``plsgd``: ``even_plan``, each iteration's layers as one all-reduce
    launched when all of them are ready. ``localsgd``: the full model every H steps, blocking. ``ssgd``: the
    full model's gradients every step, bucketed and overlapped with backward (ASC-WFBP), i.e. the DreamDDP
    timing model with H = 1.
    """
    prof = _profile(costs)
    _check_H(H)
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; expected one of {list(STRATEGIES)}")
    total_bytes = sum(prof.nbytes)
    if strategy == "localsgd":
        exposed = ring_comm_time(total_bytes, link) / H
        wire = ring_wire_bytes(total_bytes, link) / H
        period = H
    else:
        if strategy == "dreamddp":
            plan = plan_dreamddp(costs, link, H, max_delay=max_delay, bubble_fill=bubble_fill)
        elif strategy == "ssgd":
            plan = plan_dreamddp(costs, link, 1, bubble_fill=False)
        else:
            plan = even_plan(costs, H)
        timeline = simulate(plan, costs, link)
        period = plan.period
        exposed = math.fsum(it.exposed_s for it in timeline) / period
        wire = math.fsum(ring_wire_bytes(sum(prof.nbytes[x] for x in s.layers), link) for s in plan.syncs) / period
    step = prof.compute_s + exposed
    return {
        "strategy": strategy,
        "period": period,
        "compute_s": prof.compute_s,
        "exposed_s": exposed,
        "step_time_s": step,
        "compute_utilization": prof.compute_s / step if step > 0 else 1.0,
        "bytes_per_step": wire,
    }
