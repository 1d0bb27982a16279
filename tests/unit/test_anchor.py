"""DreamDDP's pure run-time pieces: the anchor check (the reset decision every member derives alike from
the averaged check vector) and the control round's packing of link measurements."""

from __future__ import annotations

import math

import pytest
import torch

from dreamp2p.config.sync import SyncConfig
from dreamp2p.schedule.cost import LayerCost
from dreamp2p.sync.strategies.control import in_background, link_bandwidth, pack_control, unpack_control
from dreamp2p.sync.strategies.outer import DIGEST_BITS, anchor_check_vector, anchor_verdict


def _mean(*vectors: torch.Tensor) -> torch.Tensor:
    return torch.stack(vectors).mean(0)


@pytest.mark.parametrize("world", [1, 2, 3, 5, 8])
def test_equal_digests_agree(world: int) -> None:
    vec = anchor_check_vector(False, 0xDEADBEEF)
    assert anchor_verdict(_mean(*[vec] * world)) == "agree"


@pytest.mark.parametrize("world", [2, 3, 5, 8])
@pytest.mark.parametrize("bit", [0, 7, DIGEST_BITS - 1])
def test_one_member_differing_in_one_bit_is_seen(world: int, bit: int) -> None:
    base = 0x1234
    vectors = [anchor_check_vector(False, base)] * (world - 1) + [anchor_check_vector(False, base ^ (1 << bit))]
    assert anchor_verdict(_mean(*vectors)) == "differ"


@pytest.mark.parametrize("world", [1, 2, 3])
def test_a_fresh_member_asks_for_a_reset(world: int) -> None:
    vectors = [anchor_check_vector(False, 5)] * (world - 1) + [anchor_check_vector(True, 5)]
    assert anchor_verdict(_mean(*vectors)) == "fresh"


def test_only_the_low_bits_travel() -> None:
    # digests equal in their low DIGEST_BITS bits look alike (a 1 in 65536 chance for unrelated thetas)
    assert anchor_verdict(_mean(anchor_check_vector(False, 1), anchor_check_vector(False, 1 + (1 << 40)))) == "agree"
    assert anchor_check_vector(False, 0).shape == (1 + DIGEST_BITS,)


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ({"anchor_every": 0}, "anchor_every"),
        ({"delta_codec": "int3"}, "delta_codec"),
        ({"group_outer_lr": 0.0}, "group_outer_lr"),
        ({"group_outer_momentum": 1.0}, "group_outer_momentum"),
        ({"error_feedback": "yes"}, "sync.error_feedback must be true or false"),
        ({"bubble_fill": 1}, "sync.bubble_fill must be true or false"),
    ],
)
def test_bad_anchor_settings_are_refused(bad: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SyncConfig(**bad)  # type: ignore[arg-type]


@pytest.mark.parametrize(("adaptive", "expected"), [(True, (1.0, 0.5)), (False, (1.0, 0.0))])
def test_group_outer_defaults_by_inner_optimizer(adaptive: bool, expected: tuple[float, float]) -> None:
    assert SyncConfig().with_outer_defaults(adaptive).group_outer == expected
    assert SyncConfig(group_outer_lr=0.5).with_outer_defaults(adaptive).group_outer == (0.5, expected[1])
    with pytest.raises(ValueError, match="unresolved"):
        _ = SyncConfig().group_outer


@pytest.mark.parametrize(
    ("goodputs", "rates", "slowest"),
    [
        ((5e6, 4e6), (math.nan, math.nan), 4e6),  # no sync measured yet: the links' goodput
        ((5e6, 4.7e6), (2.4e6, 2.5e6), 2.5e6),  # goodput inflated by buffers: the syncs' pace wins
        ((1e6, 9e6), (3e6, 3e6), 1e6),  # a link slower than the syncs saw so far
        # member 0 steps twice as fast and times each round from its early launch: the pace is member 1's
        ((5e6, 5e6), (0.3e6, 2.4e6), 2.4e6),
        ((5e6, 5e6), (math.nan, 2.4e6), 2.4e6),  # a member with no sync measured yet tells nothing
        ((math.nan, math.nan), (math.nan, math.nan), math.inf),  # nothing measured
    ],
)
def test_control_round_takes_the_slowest_of_goodputs_and_sync_pace(
    goodputs: tuple[float, float], rates: tuple[float, float], slowest: float
) -> None:
    costs = [LayerCost("a", 0.01, 0.02, 1000), LayerCost("b", 0.01, 0.02, 1000)]
    vec = sum(pack_control(r, 2, goodputs[r], 0.01, costs, rates[r]) for r in range(2)) / 2
    g = unpack_control(vec, 2, costs)
    assert g.bandwidth_Bps == pytest.approx(slowest, rel=1e-6)
    # per-link codecs choose from each link's own goodput, never from the ring's common pace
    for got, want in zip(g.link_bandwidths, goodputs, strict=True):
        assert (math.isnan(got) and math.isnan(want)) or got == pytest.approx(want, rel=1e-6)
    assert [c.bwd_s for c in g.costs] == pytest.approx([0.02, 0.02])


@pytest.mark.parametrize(
    ("goodput", "floor", "pace", "reported"),
    [
        (0.6e6, False, math.nan, 0.6e6),  # no sync yet: the goodput as it is
        (0.25e6, True, math.nan, 0.25e6),  # only a floor, but nothing better known
        (0.25e6, True, 0.6e6, 0.6e6),  # a floor below the syncs' pace: the link carries at least the pace
        (0.9e6, True, 0.6e6, 0.9e6),  # a floor above it: at least the floor
        (math.nan, True, 0.6e6, 0.6e6),
        (0.25e6, False, 0.6e6, 0.25e6),  # a full sample below the pace: the link may have slowed; kept
    ],
)
def test_a_member_reports_a_floor_no_lower_than_its_syncs_pace(
    goodput: float, floor: bool, pace: float, reported: float
) -> None:
    assert link_bandwidth(goodput, floor, pace) == pytest.approx(reported)


def test_a_floor_below_the_pace_does_not_set_the_plans_bandwidth() -> None:
    costs = [LayerCost("a", 0.01, 0.02, 1000)]
    bws = [link_bandwidth(0.25e6, True, 0.6e6), link_bandwidth(0.7e6, False, 0.62e6)]
    vec = sum(pack_control(r, 2, bws[r], 0.01, costs, (0.6e6, 0.62e6)[r]) for r in range(2)) / 2
    assert unpack_control(vec, 2, costs).bandwidth_Bps == pytest.approx(0.6e6, rel=1e-6)


@pytest.mark.parametrize(
    ("bwds", "fastest", "want"),
    [
        ((0.02, 0.05), False, 0.05),  # a region at 0.4x: the plan is made for its step, the one lockstep runs at
        ((0.05, 0.02), False, 0.05),
        ((0.0, 0.03), False, 0.03),  # a member not profiled yet (zeros) tells nothing
        ((0.03, 0.03), False, 0.03),  # a tie: the first, on every member alike
        ((0.02, 0.05), True, 0.02),  # periods in time: the clock runs at the fastest member's pace
        ((0.05, 0.02), True, 0.02),
        ((0.0, 0.03), True, 0.03),  # ... and a member not profiled yet is not the fastest
        ((0.0, 0.0), True, 0.0),  # nobody profiled yet: zeros, as in lockstep
    ],
)
def test_the_plan_takes_the_pacing_members_layer_profile(bwds: tuple[float, float], fastest: bool, want: float) -> None:
    template = [LayerCost("a", 0.0, 0.0, 1000), LayerCost("b", 0.0, 0.0, 1000)]
    per_member = [[LayerCost(c.name, b / 4, b, c.nbytes) for c in template] for b in bwds]
    vec = sum(pack_control(r, 2, 1e6, 0.01, per_member[r]) for r in range(2)) / 2
    costs = unpack_control(vec, 2, template, fastest=fastest).costs
    assert [c.bwd_s for c in costs] == pytest.approx([want, want], rel=1e-6)
    assert [c.fwd_s for c in costs] == pytest.approx([want / 4, want / 4], rel=1e-6)


def test_in_background_hands_over_the_result_or_the_exception() -> None:
    assert in_background(lambda x: x * 2, 21).result(10) == 42

    def boom(_: int) -> int:
        raise ValueError("planner failed")

    with pytest.raises(ValueError, match="planner failed"):
        in_background(boom, 0).result(10)
