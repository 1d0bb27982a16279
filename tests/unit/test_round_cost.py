"""The planner's round cost: trainer time per sync round in DreamDDP's objective and in its predictions."""

from __future__ import annotations

import math
from typing import Any

import pytest

from dreamp2p.config.sync import SyncConfig
from dreamp2p.schedule.cost import LinkModel
from dreamp2p.schedule.dreamddp import plan_dreamddp, predict, rounds_per_step
from dreamp2p.schedule.plan import total_exposed
from dreamp2p.schedule.recommend import recommend
from dreamp2p.schedule.whatif import uniform_costs

# bench lm's byte-level GPT: 3.32M parameters in 16 layers, a 0.28 s step, int8 plans with the runtime's margin
LM = uniform_costs(3.32e6, 16, 0.28)
H = 20


def _link(mbit: float, rtt_s: float, world: int) -> LinkModel:
    return LinkModel(mbit * 1e6 / 8, rtt_s, world, 0.266, margin=1.3)


def _cost(plan: Any, c: float) -> float:
    return total_exposed(plan) + len(plan.syncs) * c


GRID = [(mbit, rtt, world) for mbit in (10, 20, 100) for rtt in (0.0, 0.08) for world in (2, 3)]


@pytest.mark.parametrize(("mbit", "rtt", "world"), GRID)
def test_round_cost_prefers_few_large_groups_where_they_hide(mbit: float, rtt: float, world: int) -> None:
    link = _link(mbit, rtt, world)
    free = plan_dreamddp(LM, link, H, max_delay=H - 1, bubble_fill=False)
    priced = plan_dreamddp(LM, link, H, max_delay=H - 1, bubble_fill=False, round_cost_s=0.08)
    assert total_exposed(free) == 0.0 and total_exposed(priced) == 0.0  # every point of this grid hides
    assert len(free.syncs) >= 3  # rounds priced by the link alone: a group in many iterations
    assert len(priced.syncs) == 2  # within one round's cost of one group, the fresher two staggered groups
    assert {s.iteration for s in priced.syncs} == {0, H // 2}
    assert sorted(x for s in priced.syncs for x in s.layers) == list(range(16))  # every layer once a period


@pytest.mark.parametrize("c", [0.01, 0.08, 0.5])
@pytest.mark.parametrize(("mbit", "rtt", "world"), [(2, 0.0, 2), (5, 0.08, 3), (20, 0.0, 2), (100, 0.08, 3)])
def test_priced_plan_is_within_one_round_of_the_unpriced_plans_cost(
    mbit: float, rtt: float, world: int, c: float
) -> None:
    """The objective: the priced plan never costs more than the unpriced plan, priced, plus one round."""
    link = _link(mbit, rtt, world)
    free = plan_dreamddp(LM, link, H, max_delay=H - 1, bubble_fill=False)
    priced = plan_dreamddp(LM, link, H, max_delay=H - 1, bubble_fill=False, round_cost_s=c)
    assert _cost(priced, c) <= _cost(free, c) + c + 1e-9


def test_zero_round_cost_is_the_link_only_planner() -> None:
    link = _link(20, 0.08, 3)
    assert plan_dreamddp(LM, link, H, max_delay=H - 1) == plan_dreamddp(LM, link, H, max_delay=H - 1, round_cost_s=0.0)


def test_bubble_filling_is_off_while_rounds_cost() -> None:
    link = _link(1000, 0.0, 2)  # a fast link leaves idle link time to fill
    filled = plan_dreamddp(LM, link, H, max_delay=0, bubble_fill=True)
    assert any(s.repeat for s in filled.syncs)
    priced = plan_dreamddp(LM, link, H, max_delay=0, bubble_fill=True, round_cost_s=0.01)
    assert not any(s.repeat for s in priced.syncs)


@pytest.mark.parametrize("strategy", ["dreamddp", "plsgd", "localsgd", "ssgd"])
def test_predict_charges_each_round(strategy: str) -> None:
    link = _link(20, 0.0, 2)
    free = predict(LM, link, H, strategy, max_delay=H - 1, bubble_fill=False)
    priced = predict(LM, link, H, strategy, max_delay=H - 1, bubble_fill=False, round_cost_s=0.08)
    assert priced["rounds_per_step"] > 0
    if strategy != "dreamddp":  # the same schedule either way: only the rounds' cost is added
        assert priced["rounds_per_step"] == free["rounds_per_step"]
        assert math.isclose(priced["step_time_s"], free["step_time_s"] + 0.08 * free["rounds_per_step"])
    else:
        plan = plan_dreamddp(LM, link, H, max_delay=H - 1, bubble_fill=False, round_cost_s=0.08)
        assert priced["rounds_per_step"] == rounds_per_step(plan) == 2 / H
    assert priced["compute_utilization"] < 1.0


def test_predict_charges_nothing_alone() -> None:
    alone = LinkModel(1e6, 0.0, 1)
    assert predict(LM, alone, H, "dreamddp", max_delay=H - 1, round_cost_s=1.0)["compute_utilization"] == 1.0


@pytest.mark.parametrize("bad", [-0.1, math.nan, math.inf, True, "0.1", None])
def test_bad_round_cost_is_refused(bad: Any) -> None:
    with pytest.raises(ValueError, match="round_cost_s"):
        plan_dreamddp(LM, _link(20, 0.0, 2), H, max_delay=H - 1, round_cost_s=bad)
    with pytest.raises(ValueError, match="round_cost_s"):
        predict(LM, _link(20, 0.0, 2), H, "dreamddp", round_cost_s=bad)


@pytest.mark.parametrize("bad", [-1.0, 61.0])
def test_sync_config_bounds_round_cost(bad: float) -> None:
    with pytest.raises(ValueError, match=r"sync\.round_cost_s"):
        SyncConfig(round_cost_s=bad)
    assert SyncConfig().round_cost_s > 0


# ------------------------------------------------------------------ plan --target-cu with a run's headroom

CODECS = [("fp32", 1.0), ("bf16", 0.5), ("int8", 0.266)]


@pytest.mark.parametrize(("mbit", "rtt", "target"), [(20, 0.0, 0.9), (10, 0.08, 0.9), (100, 0.0, 0.95)])
@pytest.mark.parametrize("budget", [0.25, 0.5])
def test_recommendation_keeps_the_link_budget_and_pays_rounds(
    mbit: float, rtt: float, target: float, budget: float
) -> None:
    link = LinkModel(mbit * 1e6 / 8, rtt, 2, margin=1.3)
    rec = recommend(LM, link, target, CODECS, round_cost_s=0.08, link_budget=budget)
    assert rec.best is not None, rec.message
    best = rec.best
    assert best.link_busy <= budget and best.utilization >= target
    lk = LinkModel(link.bandwidth_Bps, rtt, 2, dict(CODECS)[best.codec], margin=1.3)
    again = predict(LM, lk, best.period, "dreamddp", max_delay=best.delay, bubble_fill=False, round_cost_s=0.08)
    assert again["compute_utilization"] == pytest.approx(best.utilization, rel=1e-9)
    # without the budget, the same search may take a setting that keeps the link busier
    loose = recommend(LM, link, target, CODECS, round_cost_s=0.08)
    assert loose.best is not None and loose.best.utilization >= target


def test_a_budget_no_setting_meets_is_said() -> None:
    link = LinkModel(2e6 / 8, 0.0, 2, margin=1.3)  # 2 Mbit/s: 3.5 MB of int8 per period needs > 25% of any period
    rec = recommend(LM, link, 0.5, CODECS, periods=(10, 20), round_cost_s=0.08, link_budget=0.25)
    assert rec.best is None
    assert "with the link busy at most 25% of the period" in rec.message


@pytest.mark.parametrize("budget", [0.0, 1.5, -0.1])
def test_bad_link_budget_is_refused(budget: float) -> None:
    with pytest.raises(ValueError, match="link_budget"):
        recommend(LM, _link(20, 0.0, 2), 0.9, CODECS, link_budget=budget)


def test_the_bandwidth_a_budget_needs_is_enough() -> None:
    costs = uniform_costs(1e9, 24, 0.5)
    link = LinkModel(1.25e8, 0.08, 4, margin=1.3)  # 1 Gbit/s: utilization is reachable, the 25% budget is not
    rec = recommend(costs, link, 0.95, [("int8", 0.266)], periods=(100,), round_cost_s=0.08, link_budget=0.25)
    assert rec.best is None and rec.needed_Bps is not None
    assert "to keep the link within budget" in rec.message
    faster = LinkModel(rec.needed_Bps, 0.08, 4, margin=1.3)
    again = recommend(costs, faster, 0.95, [("int8", 0.266)], periods=(100,), round_cost_s=0.08, link_budget=0.25)
    assert again.best is not None and again.best.link_busy <= 0.25
