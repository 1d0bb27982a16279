"""Which of the DreamDDP planner's candidates wins (pure: `dreamp2p.schedule.dreamddp`): the freshest of those
alike in cost, unless it lands more than half a period late and a fresher one costs little more."""

from __future__ import annotations

import pytest

from dreamp2p.schedule.cost import LayerCost, LinkModel
from dreamp2p.schedule.dreamddp import FRESH_SHARE, STALE_PRICE, _pick, plan_dreamddp
from dreamp2p.schedule.linkcodec import wire_ratio
from dreamp2p.schedule.plan import Plan

H = 20
PERIOD_S = 2.5  # the period's compute: STALE_PRICE of it is 0.25 s


@pytest.mark.parametrize(
    ("scored", "expected"),
    [
        # within a round's cost (0.08) of the fastest: the freshest
        ([(1.0, 5.0, "a"), (1.05, 2.0, "b")], "b"),
        ([(1.0, 19.0, "a"), (1.08, 10.0, "b"), (1.4, 7.0, "c")], "b"),
        # the fastest lands 19 steps late: the cheapest that lands within 12, at most 0.25 s dearer
        ([(1.0, 19.0, "a"), (1.2, 11.0, "b"), (1.24, 5.0, "c")], "b"),
        ([(1.0, 13.0, "a"), (1.1, 9.0, "b"), (1.2, 4.0, "c")], "b"),
        # ... and none that costs more than that
        ([(1.0, 19.0, "a"), (1.3, 10.0, "b")], "a"),
        ([(1.0, 19.0, "a"), (1.09, 11.5, "b"), (1.3, 10.0, "c")], "b"),
        ([(1.0, 19.0, "a"), (1.09, 12.5, "b"), (1.3, 10.0, "c")], "a"),  # b lands too late, c costs too much
        # fresh enough already: a fresher plan that costs more than a round is not bought
        ([(1.0, 12.0, "a"), (1.1, 1.0, "b")], "a"),
    ],
)
def test_the_freshest_alike_or_the_cheapest_that_lands_in_time(
    scored: list[tuple[float, float, str]], expected: str
) -> None:
    cands = [(cost, stale, [name]) for cost, stale, name in scored]
    assert _pick(cands, 0.08, H, PERIOD_S) == [expected]  # type: ignore[arg-type]
    assert pytest.approx((0.25, 12)) == (STALE_PRICE * PERIOD_S, FRESH_SHARE * H)


def _staleness(plan: Plan, costs: list[LayerCost]) -> float:
    weights = [sum(costs[li].nbytes for li in s.layers) for s in plan.syncs]
    return sum(w * s.delay for w, s in zip(weights, plan.syncs, strict=True)) / sum(weights)


def test_a_tight_link_plans_syncs_that_land_within_half_a_period() -> None:
    """bench lm's shape at 2 Mbit/s with 2-bit pseudo-gradients: with the planner's margin a period's syncs
    outlast the period, so one group of every layer (landing 19 steps late) exposes the least; staggered halves
    expose a little more and are bought."""
    costs = [LayerCost(f"l{i}", 0.01, 0.02, 1_600_000) for i in range(8)]  # a 0.24 s step, 12.8 MB in fp32
    link = LinkModel(0.3e6, 0.35, 2, wire_ratio("int2"), margin=1.3)
    plan = plan_dreamddp(costs, link, H, max_delay=H - 1, round_cost_s=0.08)
    assert len(plan.syncs) >= 2
    assert _staleness(plan, costs) <= FRESH_SHARE * H
    # where the link carries the syncs easily nothing changes: the fastest plan lands within a few steps
    fast = plan_dreamddp(costs, LinkModel(2.5e6, 0.05, 2, wire_ratio("int4")), H, max_delay=H - 1, round_cost_s=0.08)
    assert _staleness(fast, costs) <= 5
