"""A DreamDDP plan's period (pure logic, `dreamp2p.schedule.stretch`): the configured one wherever the link
carries its syncs with headroom, else the shortest multiple of it that does."""

from __future__ import annotations

import math

import pytest

from dreamp2p.schedule.cost import LayerCost, LinkModel
from dreamp2p.schedule.dreamddp import plan_dreamddp
from dreamp2p.schedule.plan import GroupSync, Plan
from dreamp2p.schedule.plancodec import choose_plan_codec
from dreamp2p.schedule.stretch import (
    STRETCH_LINK_BUDGET,
    choose_codec_and_period,
    choose_delta_codec,
    choose_period,
    landing_share,
    link_share,
    stretch_for,
    stretched_periods,
)

# 8 layers of 1 MB, 30 ms of compute each (a step: 0.24 s); int4-sized pseudo-gradients: 1 MB a full sync
COSTS = [LayerCost(f"l{i}", 0.01, 0.02, 1 << 20) for i in range(8)]
PERIOD = 4
PERIODS = (4, 8, 16, 32)


def _link(bandwidth: float, ratio: float = 0.125) -> LinkModel:
    return LinkModel(bandwidth, 0.0, 2, ratio)


def _make(link: LinkModel, H: int) -> Plan:
    return plan_dreamddp(COSTS, link, H, max_delay=H - 1, round_cost_s=0.08)


def _busy(link: LinkModel, H: int) -> float:
    return link_share(COSTS, link, H, _make(link, H))


@pytest.mark.parametrize(
    ("period", "max_stretch", "expected"),
    [(4, 1, (4,)), (4, 2, (4, 8)), (4, 8, (4, 8, 16, 32)), (4, 7, (4, 8, 16)), (20, 4, (20, 40, 80)), (1, 3, (1, 2))],
)
def test_the_candidate_periods_double_up_to_the_stretch(
    period: int, max_stretch: int, expected: tuple[int, ...]
) -> None:
    assert stretched_periods(period, max_stretch) == expected


@pytest.mark.parametrize(("period", "max_stretch"), [(0, 4), (4, 0)])
def test_out_of_range_periods_are_refused(period: int, max_stretch: int) -> None:
    with pytest.raises(ValueError, match="must be >= 1"):
        stretched_periods(period, max_stretch)


B = STRETCH_LINK_BUDGET


@pytest.mark.parametrize(
    ("busy", "expected"),
    [
        (0.0, 4),
        (0.5 * B, 4),
        (B, 4),  # within the budget: kept
        (1.01 * B, 8),
        (2 * B, 8),  # the link's share halves with each doubling
        (2.01 * B, 16),
        (4 * B, 16),
        (7.9 * B, 32),
        (100.0, 32),  # nothing fits: the longest
        (math.inf, 32),
        (math.nan, 32),
    ],
)
def test_the_shortest_period_whose_syncs_fit_the_link(busy: float, expected: int) -> None:
    assert stretch_for(busy, PERIODS) == expected


@pytest.mark.parametrize("bandwidth", [50e6, 10e6, 4e6])
def test_a_link_that_carries_the_syncs_keeps_the_configured_period(bandwidth: float) -> None:
    link = _link(bandwidth)
    choice = choose_period(PERIODS, COSTS, link, lambda H: _make(link, H))
    assert (choice.plan.period, choice.stretch, choice.fits) == (PERIOD, 1, True)
    assert choice.plan == _make(link, PERIOD)  # exactly the plan made without stretching


@pytest.mark.parametrize("bandwidth", [1.2e6, 0.9e6, 0.6e6, 0.3e6])
def test_a_tight_link_gets_the_shortest_period_whose_syncs_fit(bandwidth: float) -> None:
    link = _link(bandwidth)
    assert _busy(link, PERIOD) > STRETCH_LINK_BUDGET
    choice = choose_period(PERIODS, COSTS, link, lambda H: _make(link, H))
    period = choice.plan.period
    assert choice.fits and period > PERIOD and period == PERIOD * choice.stretch
    assert choice.busy_fraction == pytest.approx(_busy(link, period)) and choice.busy_fraction <= STRETCH_LINK_BUDGET
    assert _busy(link, period // 2) > STRETCH_LINK_BUDGET  # the shortest that fits
    # a stretched plan may delay a sync beyond the configured period
    assert max(s.delay for s in choice.plan.syncs) < period
    assert choice.plan.exposed_s and len(choice.plan.exposed_s) == period


def test_a_link_no_period_fits_gets_the_longest() -> None:
    link = _link(0.02e6)
    choice = choose_period(PERIODS, COSTS, link, lambda H: _make(link, H))
    assert (choice.plan.period, choice.fits) == (PERIODS[-1], False)


def test_without_stretch_the_period_is_kept_even_where_the_link_cannot_carry_it() -> None:
    link = _link(0.3e6)
    choice = choose_period((PERIOD,), COSTS, link, lambda H: _make(link, H))
    assert (choice.plan.period, choice.fits) == (PERIOD, False)


def test_parameter_syncs_keep_the_codec_choice_and_stretch_only_where_it_does_not_fit() -> None:
    candidates = [("fp32", 1.0), ("int8", 0.27)]
    fast = _link(20e6, 1.0)
    picked = choose_codec_and_period(candidates, COSTS, fast, PERIODS, _make, 0.25)
    at_period = choose_plan_codec(candidates, COSTS, fast, PERIOD, lambda lk: _make(lk, PERIOD), 0.25)
    assert picked == at_period
    slow = _link(0.5e6, 1.0)
    picked = choose_codec_and_period(candidates, COSTS, slow, PERIODS, _make, 0.25)
    first = choose_plan_codec(candidates, COSTS, slow, PERIOD, lambda lk: _make(lk, PERIOD), 0.25)
    assert picked.codec == first.codec and picked.plan.period == stretch_for(first.busy_fraction, PERIODS) > PERIOD
    assert picked.busy_fraction < first.busy_fraction


# bench lm's GPT as its plans saw it: 28 layers, 13.3 MB in fp32, int4 pseudo-gradients, 0.254 s a step,
# 2 regions, planned at sync.plan_margin 0.3
GPT = [LayerCost(f"g{i}", 0.254 / 28 / 3, 2 * 0.254 / 28 / 3, 13_294_592 // 28) for i in range(28)]


@pytest.mark.parametrize("margin", [1.0, 1.3, 2.0])
def test_the_share_is_at_the_measured_bandwidth_whatever_the_planners_margin(margin: float) -> None:
    link = LinkModel(0.616e6, 0.0, 2, 0.140625, margin=margin)
    plan = plan_dreamddp(GPT, link, 20, max_delay=19, round_cost_s=0.08)
    wire = 13_294_592 // 28 * 28 * 0.140625  # a 2-member ring: each member sends the whole vector once
    assert link_share(GPT, link, 20, plan) == pytest.approx(wire / 0.616e6 / (20 * plan.compute_s), rel=1e-9)


@pytest.mark.parametrize(
    ("mbit", "expected"),
    [
        (100.0, 1),
        (20.0, 1),
        (5.0, 1),  # 0.6 of the link: the plan at the configured period hid every sync, so it is kept
        (4.0, 1),  # 0.75: within the budget (at the planner's margin, 0.98, it was stretched)
        (2.0, 2),  # 1.5 of the link: twice the period carries it
        (1.0, 4),
    ],
)
def test_bench_lms_gpt_stretches_only_where_the_link_cannot_carry_it(mbit: float, expected: int) -> None:
    link = LinkModel(mbit * 1e6 / 8 * 0.985, 0.0, 2, 0.140625, margin=1.3)  # 0.985: what a 5 Mbit/s tbf read

    def make(H: int) -> Plan:
        return plan_dreamddp(GPT, link, H, max_delay=H - 1, round_cost_s=0.08)

    assert choose_period((20, 40, 80, 160), GPT, link, make).stretch == expected


# pseudo-gradients in "q4" (1 MB a full sync) or "q2" (half of it)
DELTAS = [("q4", 0.125), ("q2", 0.0625)]


@pytest.mark.parametrize(
    ("bandwidth", "periods", "codec", "period"),
    [
        (2e6, PERIODS, "q4", 4),  # the link carries the least compressive
        (1e6, PERIODS, "q2", 4),  # it carries only the second, at the configured period
        (1e6, (4,), "q2", 4),
        (0.4e6, PERIODS, "q2", 8),  # it carries neither: the last, stretched until it fits
        (0.4e6, (4,), "q2", 4),  # ... or kept where the period may not stretch
    ],
)
def test_pseudo_gradients_take_the_first_codec_the_link_carries_before_a_longer_period(
    bandwidth: float, periods: tuple[int, ...], codec: str, period: int
) -> None:
    name, choice = choose_delta_codec(DELTAS, COSTS, _link(bandwidth), periods, _make)
    assert (name, choice.plan.period) == (codec, period)
    ratio = dict(DELTAS)[name]
    assert choice.plan == _make(_link(bandwidth, ratio), period)  # planned at the chosen codec's size
    shares = [_busy(_link(bandwidth, r), PERIOD) for _, r in DELTAS]
    first_fit = next((c for (c, _), sh in zip(DELTAS, shares, strict=True) if sh <= STRETCH_LINK_BUDGET), "q2")
    assert name == first_fit


def test_pseudo_gradients_need_a_candidate() -> None:
    with pytest.raises(ValueError, match="no candidate"):
        choose_delta_codec([], COSTS, _link(1e6), PERIODS, _make)


def _groups(H: int, delays: tuple[int, ...], comm: tuple[float, ...]) -> Plan:
    """A plan of ``len(delays)`` groups over the 8 layers of COSTS, launched in iterations 0, 1, ..."""
    cut = len(COSTS) // len(delays)
    syncs = tuple(
        GroupSync(i, tuple(range(i * cut, (i + 1) * cut if i < len(delays) - 1 else len(COSTS))), d, 0.0, c)
        for i, (d, c) in enumerate(zip(delays, comm, strict=True))
    )
    return Plan(1, 0, H, tuple(c.name for c in COSTS), syncs, (0.0,) * H, 0.03)


@pytest.mark.parametrize(
    ("delays", "comm", "share"),
    [
        ((19,), (1.0,), 0.95),
        ((10, 10), (1.0, 1.0), 0.5),
        ((2, 18), (3.0, 1.0), (2 * 3 + 18) / 4 / 20),  # weighted by link time
        ((0, 0), (0.0, 0.0), 0.0),
        ((4, 8), (0.0, 0.0), 6 / 20),  # no link time: plain mean
    ],
)
def test_landing_share_is_the_link_time_weighted_delay_over_the_period(
    delays: tuple[int, ...], comm: tuple[float, ...], share: float
) -> None:
    assert landing_share(_groups(20, delays, comm)) == pytest.approx(share)


def test_a_codec_whose_plan_fits_the_link_but_lands_stale_gives_way_to_the_next() -> None:
    """q4 and q2 fit the link, but only as one group landing a period late: q1 (sparser) is taken, whose groups
    land fresh. Where no candidate lands fresh (staleness that bytes do not cause, as a tiny model's round
    latency), the first that fits is taken, not the most compressive."""

    def make(link: LinkModel, H: int) -> Plan:
        return _groups(H, (H - 1,), (0.01,)) if link.codec_ratio > 0.05 else _groups(H, (2, 2), (0.01, 0.01))

    deltas = [("q4", 0.125), ("q2", 0.0625), ("q1", 0.01)]
    name, choice = choose_delta_codec(deltas, COSTS, _link(1e9), (20,), make)
    assert (name, landing_share(choice.plan)) == ("q1", 0.1)
    name, _ = choose_delta_codec(deltas[:2], COSTS, _link(1e9), (20,), make)
    assert name == "q4"
