"""`dreamp2p plan --target-cu`: the preferred DreamDDP setting (codec, period, delay) that reaches a target
compute utilization on a given link, by planning each candidate with the DreamDDP planner itself.

The closed-form bounds it falls back on (the bandwidth a setting needs) are `schedule.utilization`'s. Search
order, headroom and what is said when nothing qualifies: see :func:`recommend` and docs/PLANNING.md. Pure:
no I/O, no torch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from dreamp2p.schedule.cost import LayerCost, LinkModel, ring_comm_time, ring_wire_bytes
from dreamp2p.schedule.dreamddp import plan_dreamddp, rounds_per_step, simulate
from dreamp2p.schedule.plancodec import link_busy_fraction
from dreamp2p.schedule.utilization import (
    SEARCH_PERIODS,
    Method,
    Network,
    Workload,
    ceiling,
    check_positive_int,
    check_target,
    needed_bandwidth,
)

__all__ = ["SEARCH_PERIODS", "Recommendation", "Setting", "recommend"]


@dataclass(frozen=True)
class Setting:
    """One DreamDDP setting the search evaluated with the planner, and what the planner predicts for it."""

    codec: str
    period: int
    delay: int  # largest landing delay the planner may use (d < period)
    fragments: int  # all-reduce groups per period in the plan (each layer in exactly one)
    utilization: float
    step_time_s: float
    bytes_per_step: float  # wire bytes per peer per step
    link_busy: float = 0.0  # link seconds of a period's syncs over its compute seconds (margin included)


@dataclass(frozen=True)
class Recommendation:
    target: float
    best: Setting | None  # the preferred setting that reaches the target; None if none in the grid does
    closest: Setting | None  # best if set, else the highest utilization the planner predicted in the grid
    evaluated: int  # planner runs
    needed_Bps: float | None  # when best is None: bandwidth the most frugal grid setting needs (closed form)
    needed_for: str  # that setting, in words ("" when best is set)
    message: str


def _evaluate(
    costs: Sequence[LayerCost], link: LinkModel, codec: str, H: int, d: int, round_cost_s: float = 0.0
) -> Setting:
    """Plan and simulate like ``dreamddp.predict`` (no bubble filling, as ``dreamp2p plan`` does)."""
    plan = plan_dreamddp(costs, link, H, max_delay=d, bubble_fill=False, round_cost_s=round_cost_s)
    timeline = simulate(plan, costs, link)
    exposed = math.fsum(it.exposed_s for it in timeline) / H
    step = plan.compute_s + exposed + rounds_per_step(plan) * round_cost_s
    wire = math.fsum(ring_wire_bytes(sum(costs[x].nbytes for x in s.layers), link) for s in plan.syncs) / H
    groups = sum(1 for s in plan.syncs if not s.repeat)
    util = plan.compute_s / step if step > 0 else 1.0
    busy = link_busy_fraction(costs, link, H, plan)
    return Setting(codec, H, d, groups, util, step, wire, busy)


_BUDGET_ROUNDS = 8  # rescalings of the needed bandwidth until a plan fits the link budget


def _bandwidth_for_budget(
    costs: Sequence[LayerCost], link: LinkModel, codec: str, H: int, d: int, round_cost_s: float, budget: float
) -> tuple[float, int]:
    """Bandwidth at which the planner's plan for this setting keeps the link within ``budget``, and the
    planner runs it took. The budget may bind before utilization does: the bandwidth is scaled by how far
    the link time is over budget until the plan fits (a new bandwidth may change the plan)."""
    bw = link.bandwidth_Bps
    runs = 0
    for _ in range(_BUDGET_ROUNDS):
        lk = LinkModel(bw, link.rtt_s, link.world, link.codec_ratio, link.per_hop_overhead_s, link.margin)
        busy = _evaluate(costs, lk, codec, H, d, round_cost_s).link_busy
        runs += 1
        if busy <= budget:
            break
        bw *= 1.01 * busy / budget
    return bw, runs


def _delays(H: int, cap: int | None) -> list[int]:
    """0, 1, 2, 4, ... below H, and H - 1, capped at ``cap``: small delays first (fresher weights)."""
    top = H - 1 if cap is None else min(cap, H - 1)
    out = {0, top}
    p = 1
    while p < top:
        out.add(p)
        p *= 2
    return sorted(out)


def _throughput_bound(costs: Sequence[LayerCost], link: LinkModel, H: int) -> float:
    """Utilization no plan can beat: a period takes at least as long as the link needs to carry all its bytes."""
    compute = H * math.fsum(c.fwd_s + c.bwd_s for c in costs)
    busy = ring_comm_time(sum(c.nbytes for c in costs), link)  # more groups only add latency
    return compute / max(compute, busy) if compute > 0 else 1.0


def _workload_of(costs: Sequence[LayerCost]) -> Workload:
    compute = math.fsum(c.fwd_s + c.bwd_s for c in costs)
    backward = math.fsum(c.bwd_s for c in costs)
    return Workload("profile", sum(c.nbytes for c in costs) / 4.0, len(costs), compute, backward / compute)


def _unreached(
    costs: Sequence[LayerCost], link: LinkModel, target: float, codecs: Sequence[tuple[str, float]], H: int, d: int
) -> tuple[float | None, str, str]:
    """Bandwidth the most frugal grid setting needs (closed form), that setting in words, and the message tail."""
    name, ratio = min(codecs, key=lambda c: c[1])
    method = Method(f"DreamDDP {name} H={H} d<={d}", "dreamddp", ratio, H, overlap=d)
    work, net = _workload_of(costs), Network(link.world, link.rtt_s)
    needed = needed_bandwidth(method, work, net, target)
    what = f"DreamDDP with codec {name}, period {H}, max delay {d}"
    if needed is None:
        top = ceiling(method, work, net)
        return None, what, f"even unlimited bandwidth cannot reach it at this RTT: {what} tops out at {top:.3f}"
    now = link.bandwidth_Bps * 8 / 1e9
    return needed, what, f"{what} needs about {needed * 8 / 1e9:.3g} Gbit/s (closed-form estimate; {now:.3g} now)"


def _check_search(
    costs: Sequence[LayerCost],
    target: float,
    codecs: Sequence[tuple[str, float]],
    periods: Sequence[int],
    max_delay: int | None,
    link_budget: float | None,
) -> None:
    check_target(target)
    if not codecs:
        raise ValueError("no candidate codecs")
    if link_budget is not None and not 0.0 < link_budget <= 1.0:
        raise ValueError(f"link_budget must be in (0, 1], got {link_budget!r}")
    if not math.fsum(c.fwd_s + c.bwd_s for c in costs) > 0:  # utilization is undefined without compute
        raise ValueError("the layer costs must have some compute time")
    for H in periods:
        check_positive_int("period", H)
    if max_delay is not None and (isinstance(max_delay, bool) or not isinstance(max_delay, int) or max_delay < 0):
        raise ValueError(f"max_delay must be an int >= 0, got {max_delay!r}")


def recommend(
    costs: Sequence[LayerCost],
    link: LinkModel,
    target: float,
    codecs: Sequence[tuple[str, float]],
    periods: Sequence[int] = SEARCH_PERIODS,
    max_delay: int | None = None,
    round_cost_s: float = 0.0,
    link_budget: float | None = None,
) -> Recommendation:
    """The preferred DreamDDP setting whose planned utilization reaches ``target`` on ``link``.

    A setting qualifies when its predicted utilization (each round's ``round_cost_s`` included) reaches the
    target and its syncs keep the link busy at most ``link_budget`` of the period's compute time (with
    ``link.margin``; None: no budget):
    pass a run's own (`SyncConfig.link_margin`, ``round_cost_s``, ``codec_link_budget``) so a recommendation
    keeps the headroom the runtime itself demands of a plan codec, instead of a knife-edge setting.

    ``codecs`` are (name, wire bytes per fp32 byte) in order of preference; ``link.codec_ratio`` is ignored.
    Preference, i.e. search order with the first hit taken: smallest period (workers drift apart less), then
    the codecs in the order given, then smallest delay (fresher weights). The period comes first because it is
    what moves the loss: on bench lm at period 20, DreamDDP's 4-bit pseudo-gradients and fp32, bf16 and int8
    parameter averaging reached the same held-out loss within 0.2% (docs/BENCHMARKS.md), while DiLoCo's
    ablation (arXiv 2311.08105) loses quality as the period grows. Every setting is planned and simulated by
    the DreamDDP planner, after a throughput bound skips periods whose bytes the link cannot carry. For each
    (period, codec) the largest delay is tried first: if the planner cannot reach the target with it, smaller
    delays are not tried (a heuristic: the planner with a larger delay bound is never worse than with none,
    though not provably better than with every smaller bound).
    """
    _check_search(costs, target, codecs, periods, max_delay, link_budget)
    budget = math.inf if link_budget is None else link_budget
    grid = sorted(set(periods))
    evaluated, closest, bound = 0, None, 0.0
    links = [(name, replace(link, codec_ratio=ratio)) for name, ratio in codecs]
    for H in grid:
        for name, lk in links:
            limit = _throughput_bound(costs, lk, H)
            bound = max(bound, limit)
            if limit < target:
                continue
            delays = _delays(H, max_delay)
            top = _evaluate(costs, lk, name, H, delays[-1], round_cost_s)
            evaluated += 1
            closest = top if closest is None or top.utilization > closest.utilization else closest
            if top.utilization < target or top.link_busy > budget:
                continue
            best = top
            for d in delays[:-1]:  # smallest delay first; the largest one is known to reach the target
                trial = _evaluate(costs, lk, name, H, d, round_cost_s)
                evaluated += 1
                if trial.utilization >= target and trial.link_busy <= budget:
                    best = trial
                    break
            msg = (
                f"DreamDDP with codec {best.codec}, period {best.period}, max delay {best.delay} "
                f"({best.fragments} all-reduce groups per period) reaches {best.utilization:.3f} >= {target}"
            )
            return Recommendation(target, best, best, evaluated, None, "", msg)
    H = grid[-1]
    d = H - 1 if max_delay is None else min(max_delay, H - 1)
    needed, what, tail = _unreached(costs, link, target, codecs, H, d)
    if link_budget is not None and needed is not None:
        name, ratio = min(codecs, key=lambda c: c[1])
        lk = LinkModel(link.bandwidth_Bps, link.rtt_s, link.world, ratio, link.per_hop_overhead_s, link.margin)
        for_budget, runs = _bandwidth_for_budget(costs, lk, name, H, d, round_cost_s, link_budget)
        evaluated += runs
        if for_budget > needed:
            needed = for_budget
            tail = f"{what} needs about {needed * 8 / 1e9:.3g} Gbit/s to keep the link within budget "
            tail += f"({link.bandwidth_Bps * 8 / 1e9:.3g} now)"
    head = f"no setting in the grid reaches {target}"
    if link_budget is not None:
        head += f" with the link busy at most {link_budget:.0%} of the period"
    if closest is not None:
        head += f" (closest: codec {closest.codec}, period {closest.period}, delay {closest.delay}: "
        head += f"{closest.utilization:.3f})"
    else:  # every setting was skipped: say how far off the link is
        head += f" (the link time alone caps it at {bound:.3f})"
    return Recommendation(target, None, closest, evaluated, needed, what, f"{head}; {tail}")
