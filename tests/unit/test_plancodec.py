"""The per-plan codec choice of DreamDDP (pure): least lossy candidate that hides within the link budget; with
pseudo-gradients, the anchors' codec for a plan made for the pseudo-gradients' size."""

from __future__ import annotations

import pytest

from dreamp2p.schedule.cost import LayerCost, LinkModel
from dreamp2p.schedule.dreamddp import plan_dreamddp
from dreamp2p.schedule.plan import Plan
from dreamp2p.schedule.plancodec import choose_anchor_codec, choose_plan_codec, link_busy_fraction

CANDIDATES = [("fp32", 1.0), ("bf16", 0.5), ("int8", 0.265625), ("int4", 0.140625)]
# 16 layers of 0.83 MB (a 3.3M-parameter model), 25 ms fwd + 50 ms bwd each: 1.2 s per step
COSTS = [LayerCost(f"l{i}", 0.025, 0.05, 830_000) for i in range(16)]
H = 20


def _plan(costs: list[LayerCost]):  # type: ignore[no-untyped-def]
    def make(link: LinkModel) -> Plan:
        return plan_dreamddp(costs, link, H, max_delay=H - 1, bubble_fill=False)

    return make


@pytest.mark.parametrize(
    ("bandwidth_Bps", "budget", "expected"),
    [
        (1e9, 0.25, "fp32"),  # a fast link carries full precision with room to spare
        (25e6, 0.25, "fp32"),  # 13.3 MB per 24 s period: 2.2% busy
        # 20 Mbit/s, 80 ms RTT, staggered single-layer groups (each pays its latency chain): fp32 keeps the
        # link 36% busy (margin 1.3), bf16 20%, int8 15%, int4 9%
        (2.5e6, 0.25, "bf16"),
        (2.5e6, 0.16, "int8"),  # a tighter budget: int8
        (2.5e6, 0.1, "int4"),
        (2.5e6, 0.05, "int4"),  # a tight budget takes the most compressive
        (0.2e6, 0.25, "int4"),  # nothing fits the budget: least exposed, then least link time
    ],
)
def test_least_lossy_codec_within_budget(bandwidth_Bps: float, budget: float, expected: str) -> None:
    link = LinkModel(bandwidth_Bps, 0.08, 2, margin=1.3)
    choice = choose_plan_codec(CANDIDATES, COSTS, link, H, _plan(COSTS), budget)
    assert choice.codec == expected, choice
    if choice.hides:
        assert choice.busy_fraction <= budget


def test_choice_is_the_first_candidate_that_qualifies() -> None:
    link = LinkModel(2.5e6, 0.08, 2, margin=1.3)
    choices = [choose_plan_codec(CANDIDATES[i:], COSTS, link, H, _plan(COSTS), 0.25) for i in range(4)]
    busy = [c.busy_fraction for c in choices]
    assert busy == sorted(busy, reverse=True)  # more compression, less link time


@pytest.mark.parametrize(("candidates", "budget"), [([], 0.25), (CANDIDATES, 0.0), (CANDIDATES, 1.5)])
def test_bad_arguments_are_refused(candidates: list[tuple[str, float]], budget: float) -> None:
    with pytest.raises(ValueError):
        choose_plan_codec(candidates, COSTS, LinkModel(1e6, 0.0, 2), H, _plan(COSTS), budget)


@pytest.mark.parametrize(
    ("bandwidth_Bps", "budget", "expected"),
    [
        (1e9, 0.25, "fp32"),
        # the int4 plan's syncs at 20 Mbit/s, 80 ms RTT: all anchors in fp32 would keep the link 36% busy
        (2.5e6, 0.25, "bf16"),
        (2.5e6, 0.16, "int8"),
        (2.5e6, 0.05, "int4"),  # nothing within the budget: the most compressive
        (0.2e6, 0.25, "int4"),
    ],
)
def test_anchor_codec_is_the_least_lossy_within_budget_for_the_pseudo_gradient_plan(
    bandwidth_Bps: float, budget: float, expected: str
) -> None:
    link = LinkModel(bandwidth_Bps, 0.08, 2, codec_ratio=CANDIDATES[-1][1], margin=1.3)
    plan = _plan(COSTS)(link)  # made for int4 pseudo-gradients
    codec = choose_anchor_codec(CANDIDATES, COSTS, link, H, plan, budget)
    assert codec == expected
    ratio = dict(CANDIDATES)[codec]
    busy = link_busy_fraction(COSTS, LinkModel(bandwidth_Bps, 0.08, 2, codec_ratio=ratio, margin=1.3), H, plan)
    assert busy <= budget or codec == CANDIDATES[-1][0]


@pytest.mark.parametrize(("candidates", "budget"), [([], 0.25), (CANDIDATES, 0.0), (CANDIDATES, 1.5)])
def test_anchor_codec_refuses_bad_arguments(candidates: list[tuple[str, float]], budget: float) -> None:
    link = LinkModel(1e6, 0.0, 2)
    with pytest.raises(ValueError):
        choose_anchor_codec(candidates, COSTS, link, H, _plan(COSTS)(link), budget)
