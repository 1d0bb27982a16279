"""How long a DreamDDP plan's period is: the configured one, or a multiple of it where the link cannot carry
the plan's syncs in that time.

DreamDDP (Tang et al., arXiv 2502.11058) hides each period's layer syncs behind the period's computation,
which only works while the link can carry a whole model's syncs (in the pseudo-gradients' codec) within a
period. On a tighter link no delay or bucketing hides them: at 2 Mbit/s the int4 syncs of `bench lm`'s GPT
needed 1.4 periods of link time, every step waited, and the plan the planner kept was the same as at 5 Mbit/s.
DiLoCo's answer (Douillard et al., arXiv 2311.08455) is a longer outer period: the same bytes per sync, fewer
syncs. So where the syncs of a plan at the configured period ``H`` would keep the link busy more than
`STRETCH_LINK_BUDGET` of the period's compute, the plan is made at the shortest of ``2H``, ``4H``, ... up to
``max_stretch`` times ``H`` that keeps it within (the longest, if none does). The link's share falls with
the period, since each layer still syncs once per period. A longer period is also a larger delay bound (a
sync may land up to a period later), so the syncs of a stretched plan spread over more steps. Only the link
decides: a plan whose syncs fit keeps the configured period whatever else it exposes (a round's own cost, a
tiny model's), so fast links plan exactly as without stretching. Pure: no I/O, no torch.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from dreamp2p.schedule.cost import LayerCost, LinkModel, ring_wire_bytes
from dreamp2p.schedule.dreamddp import FRESH_SHARE, weighted_delay
from dreamp2p.schedule.plan import Plan, total_exposed
from dreamp2p.schedule.plancodec import CodecChoice, choose_plan_codec, link_busy_fraction

# the most of a period's compute a plan's syncs may keep the link busy before the period is lengthened: the
# rest is headroom for what the timing model leaves out (each byte's CPU on the trainer's cores, a link that
# varies, the anchors that follow a failed check). At 0.5, bench lm at 2 Mbit/s stretched its period 8x
# (160 steps) where 2x carried the syncs: a period that long gave the model of one region training alone.
STRETCH_LINK_BUDGET = 0.8


@dataclass(frozen=True)
class PeriodChoice:
    plan: Plan
    stretch: int  # the plan's period over the configured one
    busy_fraction: float  # link time of one period's sync bytes / the period's compute time (`link_share`)
    fits: bool  # busy within STRETCH_LINK_BUDGET


def stretched_periods(period: int, max_stretch: int) -> tuple[int, ...]:
    """``period`` times 1, 2, 4, ... up to ``max_stretch`` (at least ``period`` itself)."""
    if period < 1 or max_stretch < 1:
        raise ValueError(f"period and max_stretch must be >= 1, got {period} and {max_stretch}")
    out = [period]
    while out[-1] * 2 <= period * max_stretch:
        out.append(out[-1] * 2)
    return tuple(out)


def link_share(costs: Sequence[LayerCost], link: LinkModel, H: int, plan: Plan) -> float:
    """Seconds ``link`` takes to carry the bytes of one period of ``plan``'s syncs, over the period's compute
    seconds. Bytes only: a round's latency holds the round, not the link, and it is what a tiny model's syncs
    mostly are (they fit the link at any period). At the measured bandwidth, not at the planner's margin
    (``link.margin``): `STRETCH_LINK_BUDGET` is the headroom here, and both together stretched `bench lm`'s
    plan at 5 Mbit/s, 0.6 of the link, where the plan at the configured period hid every sync."""
    nbytes = {i: c.nbytes for i, c in enumerate(costs)}
    wire = math.fsum(ring_wire_bytes(sum(nbytes[x] for x in s.layers), link) for s in plan.syncs)
    period_s = H * plan.compute_s
    return wire / link.bandwidth_Bps / period_s if period_s > 0 else math.inf


def stretch_for(busy: float, periods: Sequence[int]) -> int:
    """Of ``periods`` (shortest first), the shortest at which syncs that keep the link ``busy`` of the first
    one's compute stay within `STRETCH_LINK_BUDGET` (busy falls as 1 / period); the longest if none does."""
    if not periods:
        raise ValueError("no candidate periods")
    if not math.isfinite(busy):
        return periods[-1]
    return next((H for H in periods if busy * periods[0] / H <= STRETCH_LINK_BUDGET), periods[-1])


def choose_period(
    periods: Sequence[int], costs: Sequence[LayerCost], link: LinkModel, make_plan: Callable[[int], Plan]
) -> PeriodChoice:
    """``make_plan(H)`` at the first of ``periods`` (the configured one) or, where its syncs would keep ``link``
    busy more than the budget, at the period `stretch_for` names."""
    return _stretched(periods, costs, link, make_plan, make_plan(periods[0]))


def _stretched(
    periods: Sequence[int], costs: Sequence[LayerCost], link: LinkModel, make_plan: Callable[[int], Plan], plan: Plan
) -> PeriodChoice:
    """`choose_period` given ``plan``, already made at the first of ``periods``."""
    busy = link_share(costs, link, periods[0], plan)
    chosen = stretch_for(busy, periods)
    if chosen != periods[0]:
        plan = make_plan(chosen)
        busy = link_share(costs, link, chosen, plan)
    return PeriodChoice(plan, chosen // periods[0], busy, busy <= STRETCH_LINK_BUDGET)


def choose_codec_and_period(
    candidates: Sequence[tuple[str, float]],
    costs: Sequence[LayerCost],
    link: LinkModel,
    periods: Sequence[int],
    make_plan: Callable[[LinkModel, int], Plan],
    link_budget: float,
) -> CodecChoice:
    """For syncs that average parameters in a codec of ``candidates``: `choose_plan_codec` at the first of
    ``periods``, then, where that codec's syncs would keep the link busy more than `STRETCH_LINK_BUDGET`, the
    same codec's plan at the period `stretch_for` names."""
    first = choose_plan_codec(
        candidates, costs, link, periods[0], functools.partial(_at_period, make_plan, periods[0]), link_budget
    )
    ratio = dict(candidates)[first.codec]
    lk = replace(link, codec_ratio=ratio)
    chosen = stretch_for(link_share(costs, lk, periods[0], first.plan), periods)
    if chosen == periods[0]:
        return first
    plan = make_plan(lk, chosen)
    busy = link_busy_fraction(costs, lk, chosen, plan)
    exposed = total_exposed(plan)
    return CodecChoice(
        first.codec, plan, busy, exposed, exposed <= 0.01 * chosen * plan.compute_s and busy <= link_budget
    )


def _at_period(make_plan: Callable[[LinkModel, int], Plan], H: int, link: LinkModel) -> Plan:
    return make_plan(link, H)


def choose_delta_codec(
    candidates: Sequence[tuple[str, float]],
    costs: Sequence[LayerCost],
    link: LinkModel,
    periods: Sequence[int],
    make_plan: Callable[[LinkModel, int], Plan],
) -> tuple[str, PeriodChoice]:
    """For syncs of pseudo-gradients: the first of ``candidates`` (name, wire bytes per fp32 byte; least
    compressive first) whose plan at the configured period keeps ``link`` busy within `STRETCH_LINK_BUDGET`
    and lands its syncs within `FRESH_SHARE` of the period (`landing_share`), else the first that keeps the
    link within budget, else the last; then that codec's `choose_period`. A more compressive codec is tried
    before a longer period: 2 bits of each pseudo-gradient every period kept `bench lm`'s model at 2 Mbit/s
    (held-out 2.4407 after flush), where a longer period lost 0.5-0.6%. And before a stale plan: at 2 Mbit/s
    2 bits fitted the link but only as one group landing 19 steps late, each replica worse than one region
    alone (2.5765 against 2.4822), where the sparse codec's groups, landing 2 steps late, gave 2.4626."""
    if not candidates:
        raise ValueError("no candidate codecs")
    fitting: tuple[str, LinkModel, Plan] | None = None  # the first that fits, if none fits fresh
    last: tuple[str, LinkModel, Plan] | None = None
    for name, ratio in candidates:
        lk = replace(link, codec_ratio=ratio)
        last = (name, lk, make_plan(lk, periods[0]))
        if link_share(costs, lk, periods[0], last[2]) <= STRETCH_LINK_BUDGET:
            if landing_share(last[2]) <= FRESH_SHARE:
                break
            # kept for when none lands fresh: staleness from latency (a tiny model's rounds) no codec cures
            fitting = fitting or last
    else:
        last = fitting or last
    assert last is not None  # candidates is not empty
    name, lk, first = last
    return name, _stretched(periods, costs, lk, functools.partial(make_plan, lk), first)


def landing_share(plan: Plan) -> float:
    """How late ``plan``'s syncs land on average, weighted by their link time, as a share of its period."""
    syncs = [s for s in plan.syncs if not s.repeat]
    late = weighted_delay([(s.delay, s.comm_s) for s in syncs])
    if late is None:  # no link time at all: the plain mean
        late = math.fsum(s.delay for s in syncs) / len(syncs) if syncs else 0.0
    return late / plan.period
