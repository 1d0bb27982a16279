"""Which codec a DreamDDP plan's layer syncs use: the least lossy one that hides with headroom.

Bandwidth-aware compression (arXiv 2408.14736) picks the compression level from the measured link: more
compression only where the link cannot carry the less lossy form in time. Here the question is asked of
the whole plan: for each candidate codec (least lossy first) the planner makes the plan it would use,
and the first candidate is taken whose plan hides every sync (predicted exposed wait at most ``slack`` of
the period's compute) while the link is busy at most ``link_budget`` of the period. The budget is the
headroom for what the timing model leaves out: every byte also costs CPU (encoding, checksums, copies,
framing) on cores the trainer shares, and links vary. If no candidate qualifies, the one with the least
exposed wait is taken (ties: the one that keeps the link busy least, since the budget is exceeded anyway).

Where the plan's syncs send pseudo-gradients in a fixed codec (DreamDDP's ``delta_codec``), the plan is made
for that codec's size and the candidates only carry the rare anchors (parameters, after a check found the
members apart): `choose_anchor_codec` takes the least lossy one whose syncs, all anchors at once, would keep
the link busy at most the budget. Pure: no I/O, no torch.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from dreamp2p.schedule.cost import LayerCost, LinkModel, ring_comm_time
from dreamp2p.schedule.plan import Plan, total_exposed


@dataclass(frozen=True)
class CodecChoice:
    codec: str
    plan: Plan
    busy_fraction: float  # link time of one period's syncs / the period's compute time
    exposed_s: float  # predicted exposed wait per period
    hides: bool  # met both the hiding and the budget criteria


def link_busy_fraction(costs: Sequence[LayerCost], link: LinkModel, H: int, plan: Plan) -> float:
    """Seconds the link spends on one period's syncs, over the period's compute seconds."""
    nbytes = {i: c.nbytes for i, c in enumerate(costs)}
    busy = math.fsum(ring_comm_time(sum(nbytes[x] for x in s.layers), link) for s in plan.syncs)
    period_s = H * plan.compute_s
    return busy / period_s if period_s > 0 else math.inf


def choose_plan_codec(
    candidates: Sequence[tuple[str, float]],
    costs: Sequence[LayerCost],
    link: LinkModel,
    H: int,
    make_plan: Callable[[LinkModel], Plan],
    link_budget: float,
    slack: float = 0.01,
) -> CodecChoice:
    """The least lossy of ``candidates`` (name, wire bytes per fp32 byte; least lossy first) that hides."""
    if not candidates:
        raise ValueError("no candidate codecs")
    if not 0.0 < link_budget <= 1.0:
        raise ValueError(f"link_budget must be in (0, 1], got {link_budget!r}")
    choices = []
    for name, ratio in candidates:
        lk = LinkModel(link.bandwidth_Bps, link.rtt_s, link.world, ratio, link.per_hop_overhead_s, link.margin)
        plan = make_plan(lk)
        exposed = total_exposed(plan)
        busy = link_busy_fraction(costs, lk, H, plan)
        hides = exposed <= slack * H * plan.compute_s and busy <= link_budget
        choice = CodecChoice(name, plan, busy, exposed, hides)
        if hides:
            return choice
        choices.append(choice)
    return min(choices, key=lambda c: (c.exposed_s, c.busy_fraction))


def choose_anchor_codec(
    candidates: Sequence[tuple[str, float]],
    costs: Sequence[LayerCost],
    link: LinkModel,
    H: int,
    plan: Plan,
    link_budget: float,
) -> str:
    """The least lossy of ``candidates`` (least lossy first) whose anchors, every sync of ``plan`` at once,
    keep the link busy at most ``link_budget`` of the period; the most compressive if none does.

    ``plan`` was made for the pseudo-gradients' size: an anchor may outlast its delay, but anchors follow
    only a failed check, so the link's share is what bounds the choice, not hiding.
    """
    if not candidates:
        raise ValueError("no candidate codecs")
    if not 0.0 < link_budget <= 1.0:
        raise ValueError(f"link_budget must be in (0, 1], got {link_budget!r}")
    for name, ratio in candidates:
        if link_busy_fraction(costs, replace(link, codec_ratio=ratio), H, plan) <= link_budget:
            return name
    return candidates[-1][0]
