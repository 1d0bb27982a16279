"""DreamDDP planner, cost model and Streaming DiLoCo fragments: parametrized cases plus hypothesis properties.

The reference computations here (exhaustive bucketing, the O(n^2) bucketing DP) are written independently of
the planner so that they check it rather than repeat it.
"""

from __future__ import annotations

import itertools
import json
import math
import random
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from planner_oracle import brute_force

from dreamp2p.schedule.cost import LayerCost, LinkModel, ring_comm_time, ring_wire_bytes
from dreamp2p.schedule.dreamddp import (
    PLANNED_SCHEDULES,
    even_plan,
    plan_dreamddp,
    predict,
    simulate,
    warmup_plan,
)
from dreamp2p.schedule.fragments import fragment_offsets, fragments_due, strided_fragments
from dreamp2p.schedule.plan import GroupSync, Plan, total_exposed

# ----------------------------------------------------------------------------------------------------- helpers


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-9 * max(1.0, abs(a), abs(b))


def _ready(costs: list[LayerCost]) -> list[float]:
    out = [0.0] * len(costs)
    acc = 0.0
    for x in range(len(costs) - 1, -1, -1):
        acc += costs[x].bwd_s
        out[x] = acc
    return out


def _best_finish(costs: list[LayerCost], link: LinkModel, layers: list[int]) -> float:
    """Earliest finish of syncing ``layers`` (contiguous) in one iteration: plain O(n^2) bucketing DP."""
    ready = _ready(costs)
    order = sorted(layers, reverse=True)  # backward order
    f = [0.0]
    for j in range(1, len(order) + 1):
        r = ready[order[j - 1]]
        f.append(min(max(r, f[i]) + ring_comm_time(sum(costs[x].nbytes for x in order[i:j]), link) for i in range(j)))
    return f[-1]


def _base_segments(plan: Plan) -> list[list[int]]:
    """Forward layers synced (non-repeat) in each iteration, ascending."""
    segs: list[list[int]] = [[] for _ in range(plan.period)]
    for s in plan.syncs:
        if not s.repeat:
            segs[s.iteration].extend(s.layers)
    return [sorted(x) for x in segs]


def _table(fwd: list[float], bwd: list[float], nbytes: list[int]) -> list[LayerCost]:
    return [LayerCost(f"layer{i}", f, b, n) for i, (f, b, n) in enumerate(zip(fwd, bwd, nbytes, strict=True))]


@st.composite
def cost_tables(draw: Any, max_layers: int = 8) -> list[LayerCost]:
    n = draw(st.integers(1, max_layers))
    times = st.floats(0.0, 0.1, allow_nan=False, allow_subnormal=False)
    fwd = draw(st.lists(times, min_size=n, max_size=n))
    bwd = draw(st.lists(times, min_size=n, max_size=n))
    nbytes = draw(st.lists(st.integers(0, 20_000_000), min_size=n, max_size=n))
    return _table(fwd, bwd, nbytes)


links = st.builds(
    LinkModel,
    bandwidth_Bps=st.sampled_from([1e5, 1e6, 1.25e7, 1e8, 1e9]),
    rtt_s=st.sampled_from([0.0, 0.001, 0.02, 0.08, 0.2]),
    world=st.integers(1, 8),
    codec_ratio=st.sampled_from([1.0, 0.5, 0.266, 0.14]),
    per_hop_overhead_s=st.sampled_from([0.0, 1e-4]),
)


def _assert_valid(plan: Plan, costs: list[LayerCost], H: int) -> None:
    assert plan.period == H
    assert plan.layer_names == tuple(c.name for c in costs)
    assert len(plan.exposed_s) == H
    assert all(math.isfinite(w) and w >= 0 for w in plan.exposed_s)
    base = sorted(x for s in plan.syncs if not s.repeat for x in s.layers)
    assert base == list(range(len(costs)))  # every layer exactly once among base syncs
    assert [(s.iteration, s.start_s) for s in plan.syncs] == sorted((s.iteration, s.start_s) for s in plan.syncs)


# ---------------------------------------------------------------------------------------------------- cost.py


@pytest.mark.parametrize(
    ("nbytes", "link", "expected"),
    [
        (1000, LinkModel(1000.0, 0.0, 2), 1.0),
        (1000, LinkModel(1000.0, 0.1, 2), 1.1),
        (4_000_000, LinkModel(1e6, 0.08, 4, 0.25, 0.001), 1.5 + 6 * 0.041),
        (8_000_000, LinkModel(1e6, 0.0, 8, 1.0), 14.0),
        (10**9, LinkModel(1e9, 0.05, 1), 0.0),
        (0, LinkModel(1e6, 0.08, 4), 0.0),
        (1000, LinkModel(1000.0, 0.1, 2, margin=1.5), 1.65),  # planning margin scales the whole estimate
    ],
)
def test_ring_comm_time_cases(nbytes: int, link: LinkModel, expected: float) -> None:
    assert ring_comm_time(nbytes, link) == pytest.approx(expected, rel=1e-12)


def test_ring_wire_bytes() -> None:
    assert ring_wire_bytes(1000, LinkModel(1.0, 0.0, 4, 0.5)) == pytest.approx(750.0)
    assert ring_wire_bytes(1000, LinkModel(1.0, 0.0, 1)) == 0.0


@pytest.mark.parametrize(
    "kwargs",
    [
        {"bandwidth_Bps": 0.0},
        {"bandwidth_Bps": -1.0},
        {"bandwidth_Bps": math.inf},
        {"bandwidth_Bps": math.nan},
        {"rtt_s": -0.1},
        {"rtt_s": math.nan},
        {"world": 0},
        {"world": 2.0},
        {"world": True},
        {"codec_ratio": 0.0},
        {"codec_ratio": 4.5},
        {"per_hop_overhead_s": -1e-3},
        {"margin": 0.9},
        {"margin": math.inf},
        {"margin": True},
    ],
)
def test_link_model_rejects(kwargs: dict[str, Any]) -> None:
    args: dict[str, Any] = {"bandwidth_Bps": 1e6, "rtt_s": 0.01, "world": 2} | kwargs
    with pytest.raises(ValueError):
        LinkModel(**args)


@pytest.mark.parametrize(
    "args",
    [("", 0.1, 0.1, 1), ("a", -0.1, 0.1, 1), ("a", 0.1, math.inf, 1), ("a", 0.1, 0.1, -1), ("a", 0.1, 0.1, 1.5)],
)
def test_layer_cost_rejects(args: tuple[Any, ...]) -> None:
    with pytest.raises(ValueError):
        LayerCost(*args)


@pytest.mark.parametrize("nbytes", [-1, 1.0, True])
def test_ring_comm_time_rejects_bad_bytes(nbytes: Any) -> None:
    with pytest.raises(ValueError):
        ring_comm_time(nbytes, LinkModel(1e6, 0.0, 2))


# ------------------------------------------------------------------------------------------- planner: exactness


@given(costs=cost_tables(), link=links, data=st.data())
@settings(max_examples=250, deadline=None)
def test_planner_matches_brute_force(costs: list[LayerCost], link: LinkModel, data: st.DataObject) -> None:
    H = data.draw(st.integers(1, len(costs) + 2), label="H")
    plan = plan_dreamddp(costs, link, H, bubble_fill=False)
    best, segments = brute_force(costs, link, H)
    assert len(segments) == H
    assert sorted(x for seg in segments for x in seg) == list(range(len(costs)))
    got = total_exposed(plan)
    assert got <= best + 1e-9 * max(1.0, best), (got, best)
    assert _close(got, best)


@given(costs=cost_tables(max_layers=40), link=links)
@settings(max_examples=60, deadline=None)
def test_single_iteration_bucketing_is_optimal(costs: list[LayerCost], link: LinkModel) -> None:
    # H = 1: one segment of every layer, so the wait is exactly the best bucketing's finish past backward end
    plan = plan_dreamddp(costs, link, 1, bubble_fill=False)
    B = _ready(costs)[0]
    expected = max(0.0, _best_finish(costs, link, list(range(len(costs)))) - B)
    assert _close(total_exposed(plan), expected)


@given(costs=cost_tables(max_layers=24), link=links, data=st.data())
@settings(max_examples=200, deadline=None)
def test_dfs_properties(costs: list[LayerCost], link: LinkModel, data: st.DataObject) -> None:
    H = data.draw(st.integers(1, len(costs) + 2), label="H")
    plan = plan_dreamddp(costs, link, H, bubble_fill=False)
    _assert_valid(plan, costs, H)
    B = _ready(costs)[0]
    segs = _base_segments(plan)
    # segments are contiguous and walk the layers in backward order: iteration 0 holds the output side
    flat = [x for seg in segs for x in sorted(seg, reverse=True)]
    assert flat == list(range(len(costs) - 1, -1, -1))
    for seg in segs:
        if seg:
            assert seg == list(range(seg[0], seg[-1] + 1))
    # (2) at-least-one: the non-empty iterations form a prefix of the period
    nonempty = [bool(seg) for seg in segs]
    assert nonempty == sorted(nonempty, reverse=True)
    # (1) optimal hiding: a layer moved on to the next iteration would not have hidden in the previous one
    for seg, nxt in itertools.pairwise(segs):
        if seg and nxt:
            would = _best_finish(costs, link, [*seg, nxt[-1]])
            assert would > B - 1e-9 * max(1.0, B), (seg, nxt, would, B)
    # (3) every layer syncs at least once per period (exactly once among base syncs)
    assert sorted(x for seg in segs for x in seg) == list(range(len(costs)))
    # the plan's predictions are the simulator's
    assert tuple(it.exposed_s for it in simulate(plan, costs, link)) == plan.exposed_s


@given(costs=cost_tables(max_layers=16), link=links, data=st.data())
@settings(max_examples=80, deadline=None)
def test_dreamddp_never_slower_than_baselines(costs: list[LayerCost], link: LinkModel, data: st.DataObject) -> None:
    H = data.draw(st.integers(1, 12), label="H")
    mine = predict(costs, link, H, "dreamddp")["step_time_s"]
    for other in ("plsgd", "localsgd", "ssgd"):
        theirs = predict(costs, link, H, other)["step_time_s"]
        assert mine <= theirs + 1e-9 * max(1.0, theirs), (other, mine, theirs)


# ------------------------------------------------------------------------------------------ planner: edge cases


def _slow_link() -> LinkModel:
    return LinkModel(1.0, 0.1, 4)


@pytest.mark.parametrize(
    ("name", "costs", "link", "H"),
    [
        ("one layer", _table([0.01], [0.02], [10**6]), LinkModel(1e7, 0.05, 3), 4),
        ("H = 1", _table([0.01] * 6, [0.02] * 6, [10**6] * 6), LinkModel(1e7, 0.05, 3), 1),
        ("H > L", _table([0.01] * 3, [0.02] * 3, [10**6] * 3), LinkModel(1e7, 0.05, 3), 7),
        ("zero costs", _table([0.0] * 5, [0.0] * 5, [0] * 5), LinkModel(1e7, 0.05, 3), 3),
        ("zero times", _table([0.0] * 5, [0.0] * 5, [10**6] * 5), LinkModel(1e7, 0.05, 3), 3),
        ("enormous comm", _table([0.01] * 5, [0.02] * 5, [10**6] * 5), _slow_link(), 3),
        ("world 1", _table([0.01] * 5, [0.02] * 5, [10**6] * 5), LinkModel(1.0, 0.3, 1), 3),
    ],
)
@pytest.mark.parametrize("max_delay", [0, 2])
@pytest.mark.parametrize("bubble_fill", [False, True])
def test_degenerate_inputs_give_valid_plans(
    name: str, costs: list[LayerCost], link: LinkModel, H: int, max_delay: int, bubble_fill: bool
) -> None:
    plan = plan_dreamddp(costs, link, H, max_delay=max_delay, bubble_fill=bubble_fill)
    _assert_valid(plan, costs, H)
    assert Plan.from_dict(plan.to_dict()) == plan
    if name in ("world 1", "zero costs"):
        assert plan.exposed_s == (0.0,) * H
        assert all(s.comm_s == 0.0 for s in plan.syncs)
        assert not any(s.repeat for s in plan.syncs)
    if name == "H = 1":
        assert [s.iteration for s in plan.syncs] == [0] * len(plan.syncs)
    if name == "H > L" and max_delay == 0:  # at-least-one packs the layers into the first iterations
        assert all(not plan.syncs_at(h) for h in range(len(costs), H))
    if name == "enormous comm" and max_delay == 0:
        assert total_exposed(plan) > 1e6


def test_empty_costs_and_bad_arguments() -> None:
    costs = _table([0.01] * 3, [0.02] * 3, [10**6] * 3)
    link = LinkModel(1e7, 0.05, 3)
    with pytest.raises(ValueError, match="at least one layer"):
        plan_dreamddp([], link, 2)
    with pytest.raises(ValueError, match="unique"):
        plan_dreamddp([costs[0], costs[0]], link, 2)
    for H in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="period"):
            plan_dreamddp(costs, link, H)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_delay"):
        plan_dreamddp(costs, link, 2, max_delay=-1)
    with pytest.raises(ValueError, match="version"):
        plan_dreamddp(costs, link, 2, version=-1)
    with pytest.raises(ValueError, match="LinkModel"):
        plan_dreamddp(costs, "1gbit", 2)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="exhaustive"):
        brute_force(_table([0.0] * 11, [0.0] * 11, [1] * 11), link, 2)
    with pytest.raises(ValueError, match="strategy"):
        predict(costs, link, 2, "allreduce")


# ------------------------------------------------------------------------------------------------ even plan


@pytest.mark.parametrize(
    ("L", "H", "expected"),
    [
        (10, 3, [[6, 7, 8, 9], [2, 3, 4, 5], [0, 1]]),
        (4, 4, [[3], [2], [1], [0]]),
        (3, 5, [[2], [1], [0], [], []]),
        (5, 1, [[0, 1, 2, 3, 4]]),
        (7, 2, [[3, 4, 5, 6], [0, 1, 2]]),
    ],
)
def test_even_plan(L: int, H: int, expected: list[list[int]]) -> None:
    plan = even_plan(_table([0.01] * L, [0.02] * L, [100] * L), H, version=3, effective_step=40)
    assert _base_segments(plan) == expected
    assert plan.exposed_s == (0.0,) * H
    assert all(s.delay == 0 and s.start_s == 0.0 and s.comm_s == 0.0 for s in plan.syncs)
    assert (plan.version, plan.effective_step) == (3, 40)
    assert plan.iteration_of(40) == 0 and plan.iteration_of(40 + H + 1) == 1 % H
    assert plan.step_time_s() == pytest.approx(0.03 * L)


@pytest.mark.parametrize(("H", "delay", "expected"), [(4, 2, 2), (4, 9, 3), (1, 5, 0), (3, 0, 0)])
def test_even_plan_delay_is_capped_below_the_period(H: int, delay: int, expected: int) -> None:
    plan = even_plan(_table([0.01] * 3, [0.02] * 3, [100] * 3), H, delay=delay)
    assert {s.delay for s in plan.syncs} == {expected}


@pytest.mark.parametrize("delay", [-1, 1.5, True])
def test_even_plan_rejects_bad_delay(delay: Any) -> None:
    with pytest.raises(ValueError, match="delay"):
        even_plan(_table([0.01], [0.02], [100]), 2, delay=delay)


@pytest.mark.parametrize(
    ("nbytes", "H", "groups", "expected", "iterations"),
    [
        ([100] * 4, 20, 2, [[2, 3], [0, 1]], [0, 10]),
        ([300, 100, 100, 100], 20, 2, [[1, 2, 3], [0]], [0, 10]),
        ([100, 100, 100, 300], 20, 2, [[3], [0, 1, 2]], [0, 10]),
        ([100] * 6, 9, 3, [[4, 5], [2, 3], [0, 1]], [0, 3, 6]),
        ([100] * 3, 20, 1, [[0, 1, 2]], [0]),
        ([100] * 3, 2, 5, [[1, 2], [0]], [0, 1]),  # no more groups than iterations
        ([100] * 2, 20, 5, [[1], [0]], [0, 10]),  # nor than layers
        ([0, 0, 0, 100], 4, 2, [[3], [0, 1, 2]], [0, 2]),
        ([100, 0, 0, 0], 4, 3, [[3], [2], [0, 1]], [0, 1, 2]),  # zero-byte tails still get a layer each
    ],
)
def test_warmup_plan_splits_bytes_evenly_into_few_spread_syncs(
    nbytes: list[int], H: int, groups: int, expected: list[list[int]], iterations: list[int]
) -> None:
    L = len(nbytes)
    plan = warmup_plan(_table([0.01] * L, [0.02] * L, nbytes), H, groups, delay=3)
    assert [list(s.layers) for s in plan.syncs] == expected
    assert [s.iteration for s in plan.syncs] == iterations
    assert sorted(li for s in plan.syncs for li in s.layers) == list(range(L))
    assert {s.delay for s in plan.syncs} == {min(3, H - 1)}
    assert (plan.version, plan.effective_step) == (0, 0)


@pytest.mark.parametrize(("groups", "delay"), [(0, 0), (1.5, 0), (True, 0), (2, -1), (2, 0.5)])
def test_warmup_plan_rejects_bad_arguments(groups: Any, delay: Any) -> None:
    with pytest.raises(ValueError, match=r"groups|delay"):
        warmup_plan(_table([0.01], [0.02], [100]), 4, groups, delay=delay)


# --------------------------------------------------------------------------------------------- bubble filling


@given(costs=cost_tables(max_layers=16), link=links, data=st.data())
@settings(max_examples=150, deadline=None)
def test_bubble_fill_only_adds_free_repeats(costs: list[LayerCost], link: LinkModel, data: st.DataObject) -> None:
    H = data.draw(st.integers(1, 10), label="H")
    max_delay = data.draw(st.integers(0, 3), label="max_delay")
    bare = plan_dreamddp(costs, link, H, max_delay=max_delay, bubble_fill=False)
    filled = plan_dreamddp(costs, link, H, max_delay=max_delay, bubble_fill=True)
    assert all(new <= old for new, old in zip(filled.exposed_s, bare.exposed_s, strict=True))
    assert [s for s in filled.syncs if not s.repeat] == list(bare.syncs)
    B = _ready(costs)[0]
    base_iter = {x: (s.iteration, s.delay) for s in bare.syncs for x in s.layers}
    seen = set()
    for s in filled.syncs:
        if s.repeat:
            assert s.delay == 0 and s.comm_s > 0
            assert s.start_s + s.comm_s <= B + 1e-12  # inside the backward window
            assert (s.iteration, s.layers) not in seen
            seen.add((s.iteration, s.layers))
            for x in s.layers:
                hb, d = base_iter[x]
                assert (s.iteration - hb) % H > d  # never while the layer's own sync is launched or in flight
    # the link never runs two syncs at once
    for tl in simulate(filled, costs, link):
        blocks = sorted((c.start_s, c.end_s) for c in tl.comm)
        for (_, end), (start, _) in itertools.pairwise(blocks):
            assert start >= end - 1e-9


def test_bubble_fill_uses_idle_link() -> None:
    # fast link, many iterations: base syncs hide easily and leave most of each backward idle
    costs = _table([0.01] * 8, [0.05] * 8, [10**5] * 8)
    link = LinkModel(1e8, 0.001, 2)
    plan = plan_dreamddp(costs, link, 4)
    assert any(s.repeat for s in plan.syncs)
    assert plan.exposed_s == plan_dreamddp(costs, link, 4, bubble_fill=False).exposed_s


# ---------------------------------------------------------------------------------------------- WAN extension


@given(costs=cost_tables(max_layers=10), link=links, data=st.data())
@settings(max_examples=120, deadline=None)
def test_delays_never_hurt(costs: list[LayerCost], link: LinkModel, data: st.DataObject) -> None:
    H = data.draw(st.integers(1, 8), label="H")
    max_delay = data.draw(st.integers(1, 4), label="max_delay")
    base = plan_dreamddp(costs, link, H, bubble_fill=False)
    delayed = plan_dreamddp(costs, link, H, max_delay=max_delay, bubble_fill=False)
    assert total_exposed(delayed) <= total_exposed(base)
    assert all(s.delay <= min(max_delay, H - 1) for s in delayed.syncs)
    _assert_valid(delayed, costs, H)
    assert tuple(it.exposed_s for it in simulate(delayed, costs, link)) == delayed.exposed_s


def test_delays_hide_enormous_comm() -> None:
    costs = _table([0.5] * 6, [1.0] * 6, [1000] * 6)
    link = LinkModel(1.0, 0.0, 2)  # 1 byte/s: every layer takes ~1000 s
    base = plan_dreamddp(costs, link, 3, bubble_fill=False)
    delayed = plan_dreamddp(costs, link, 3, max_delay=5, bubble_fill=False)
    assert any(s.delay > 0 for s in delayed.syncs)
    assert total_exposed(delayed) < total_exposed(base) - 1.0


def test_delays_hide_wan_sync_longer_than_backward() -> None:
    # 0.75 s per layer against a 2 s backward: the input-side layers cannot hide at delay 0, but the link is
    # busy only 3 s of every 16 s period, so landing one iteration later hides everything
    costs = _table([0.5] * 4, [0.5] * 4, [750_000] * 4)
    link = LinkModel(1e6, 0.0, 2)
    base = plan_dreamddp(costs, link, 4, bubble_fill=False)
    delayed = plan_dreamddp(costs, link, 4, max_delay=2, bubble_fill=False)
    assert total_exposed(base) > 0
    assert total_exposed(delayed) == 0.0
    assert delayed.step_time_s() == delayed.compute_s


def test_delays_reach_design_target_on_wan() -> None:
    # design target: a full-model sync costing H/2 compute steps over an 80 ms RTT ring still leaves >= 95%
    # of the compute-only step rate once syncs may land later in the period
    L, H, step_s = 24, 10, 0.1
    costs = _table([step_s / 3 / L] * L, [2 * step_s / 3 / L] * L, [4 * 10**6] * L)
    wire = ring_wire_bytes(sum(c.nbytes for c in costs), LinkModel(1.0, 0.08, 4))
    link = LinkModel(wire / (H / 2 * step_s), 0.08, 4)
    plan = plan_dreamddp(costs, link, H, max_delay=H - 1)
    assert plan.compute_s / plan.step_time_s() >= 0.95
    assert plan.compute_s / plan_dreamddp(costs, link, H).step_time_s() < 0.95


def test_seeded_sweep_matches_brute_force() -> None:
    # a dense deterministic sweep next to the hypothesis test: rarely hit ties and boundaries show up here
    rng = random.Random(20250216)
    for _ in range(1500):
        L = rng.randint(1, 7)
        H = rng.randint(1, L + 1)
        costs = _table(
            [rng.uniform(0, 0.1) for _ in range(L)],
            [rng.uniform(0, 0.1) for _ in range(L)],
            [rng.choice([0, rng.randint(1, 2 * 10**7)]) for _ in range(L)],
        )
        link = LinkModel(rng.choice([1e6, 1.25e7, 1e8, 1e9]), rng.choice([0.0, 0.001, 0.02, 0.08]), rng.randint(1, 8))
        got = total_exposed(plan_dreamddp(costs, link, H, bubble_fill=False))
        best, _ = brute_force(costs, link, H)
        assert _close(got, best), (costs, link, H, got, best)


# ------------------------------------------------------------------------------------- determinism and serde


@given(costs=cost_tables(max_layers=12), link=links, data=st.data())
@settings(max_examples=60, deadline=None)
def test_deterministic_and_round_trips(costs: list[LayerCost], link: LinkModel, data: st.DataObject) -> None:
    H = data.draw(st.integers(1, 8), label="H")
    max_delay = data.draw(st.integers(0, 2), label="max_delay")
    a = plan_dreamddp(costs, link, H, version=7, effective_step=123, max_delay=max_delay)
    b = plan_dreamddp(list(costs), link, H, version=7, effective_step=123, max_delay=max_delay)
    assert a == b
    assert Plan.from_dict(a.to_dict()) == a
    wire = json.dumps(a.to_dict(), sort_keys=True)
    assert Plan.from_dict(json.loads(wire)) == a
    assert json.dumps(Plan.from_dict(json.loads(wire)).to_dict(), sort_keys=True) == wire


def _plan_dict() -> dict[str, Any]:
    costs = _table([0.01] * 4, [0.05] * 4, [10**6] * 4)
    d = plan_dreamddp(costs, LinkModel(2e7, 0.01, 3), 2).to_dict()
    assert {s["iteration"] for s in d["syncs"]} == {0, 1} and any(s["repeat"] for s in d["syncs"])
    return d


def _mutations() -> list[tuple[str, Any]]:
    def set_(path: tuple[Any, ...], value: Any) -> Any:
        def apply(d: dict[str, Any]) -> None:
            target: Any = d
            for key in path[:-1]:
                target = target[key]
            target[path[-1]] = value

        return apply

    def drop_sync_of_layer(d: dict[str, Any]) -> None:
        d["syncs"] = [s for s in d["syncs"] if 0 not in s["layers"]]

    def reverse_syncs(d: dict[str, Any]) -> None:
        d["syncs"] = d["syncs"][::-1]

    return [
        ("format", set_(("format",), "other/9")),
        ("period", set_(("period",), 0)),
        ("exposed length", set_(("exposed_s",), [0.0])),
        ("negative exposed", set_(("exposed_s",), [-1.0, 0.0])),
        ("nan compute", set_(("compute_s",), math.nan)),
        ("duplicate names", set_(("layer_names",), ["a", "a", "b", "c"])),
        ("layer out of range", set_(("syncs", 0, "layers"), [9])),
        ("unsorted layers", set_(("syncs", 0, "layers"), [3, 2])),
        ("iteration out of range", set_(("syncs", 0, "iteration"), 5)),
        ("delay too long", set_(("syncs", 0, "delay"), 2)),
        ("bool iteration", set_(("syncs", 0, "iteration"), True)),
        ("string start", set_(("syncs", 0, "start_s"), "0")),
        ("repeat not bool", set_(("syncs", 0, "repeat"), 1)),
        ("extra sync field", set_(("syncs", 0, "extra"), 1)),
        ("missing layer", drop_sync_of_layer),
        ("unordered", reverse_syncs),
        ("syncs not list", set_(("syncs",), "x")),
        ("sync not mapping", set_(("syncs", 0), 3)),
    ]


@pytest.mark.parametrize(("name", "mutate"), _mutations(), ids=[m[0] for m in _mutations()])
def test_from_dict_rejects_malformed(name: str, mutate: Any) -> None:
    d = json.loads(json.dumps(_plan_dict()))
    assert Plan.from_dict(d) is not None
    mutate(d)
    with pytest.raises(ValueError):
        Plan.from_dict(d)


def test_from_dict_rejects_missing_fields_and_non_mapping() -> None:
    d = _plan_dict()
    del d["compute_s"]
    with pytest.raises(ValueError, match="lacks"):
        Plan.from_dict(d)
    with pytest.raises(ValueError):
        Plan.from_dict([])  # type: ignore[arg-type]


def test_group_sync_and_plan_accessors() -> None:
    with pytest.raises(ValueError):
        GroupSync(0, (), 0, 0.0, 0.0)
    with pytest.raises(ValueError):
        GroupSync(0, (1,), -1, 0.0, 0.0)
    costs = _table([0.01] * 6, [0.02] * 6, [10**6] * 6)
    plan = plan_dreamddp(costs, LinkModel(1e7, 0.05, 3), 3)
    assert sum(len(plan.syncs_at(h)) for h in range(3)) == len(plan.syncs)
    with pytest.raises(ValueError):
        plan.syncs_at(3)
    with pytest.raises(ValueError):
        plan.iteration_of(-1)
    assert plan.step_time_s() == pytest.approx(plan.compute_s + sum(plan.exposed_s) / 3)


# ----------------------------------------------------------------------------------------- simulate / predict


def test_simulate_timeline_shape() -> None:
    costs = _table([0.01, 0.02, 0.03], [0.02, 0.04, 0.06], [10**6, 2 * 10**6, 3 * 10**6])
    link = LinkModel(2e7, 0.02, 3)
    plan = plan_dreamddp(costs, link, 2, max_delay=1)
    timeline = simulate(plan, costs, link)
    assert [it.iteration for it in timeline] == [0, 1]
    t = 0.0
    for it in timeline:
        assert it.start_s == pytest.approx(t)
        phases = [(b.layer, b.phase) for b in it.compute]
        assert phases == [(0, "fwd"), (1, "fwd"), (2, "fwd"), (2, "bwd"), (1, "bwd"), (0, "bwd")]
        assert it.backward_start_s == pytest.approx(t + 0.06)
        assert it.backward_end_s == pytest.approx(t + 0.18)
        assert it.end_s == pytest.approx(it.backward_end_s + it.exposed_s)
        for c in it.comm:
            assert c.launch_iteration == it.iteration
            assert c.end_s >= c.start_s >= it.backward_start_s
        t = it.end_s
    with pytest.raises(ValueError, match="names"):
        simulate(plan, _table([0.01], [0.01], [1]), link)


def test_predict_fields_and_strategy_relations() -> None:
    costs = _table([0.01] * 8, [0.02] * 8, [4 * 10**6] * 8)
    link = LinkModel(1.25e7, 0.08, 4, 0.266)
    H = 4
    res = {s: predict(costs, link, H, s) for s in PLANNED_SCHEDULES}
    for r in res.values():
        assert set(r) == {
            "strategy",
            "period",
            "compute_s",
            "exposed_s",
            "step_time_s",
            "compute_utilization",
            "bytes_per_step",
            "rounds_per_step",
        }
        assert 0 < r["compute_utilization"] <= 1
        assert r["step_time_s"] == pytest.approx(r["compute_s"] + r["exposed_s"])
    full = ring_wire_bytes(32 * 10**6, link)
    assert res["ssgd"]["bytes_per_step"] == pytest.approx(full)
    assert res["localsgd"]["bytes_per_step"] == pytest.approx(full / H)
    assert res["plsgd"]["bytes_per_step"] == pytest.approx(full / H)
    assert res["dreamddp"]["bytes_per_step"] >= full / H * (1 - 1e-12)  # repeats may add bytes
    assert res["dreamddp"]["step_time_s"] <= min(r["step_time_s"] for r in res.values()) + 1e-12
    alone = predict(costs, LinkModel(1e6, 0.1, 1), H, "ssgd")
    assert alone["compute_utilization"] == 1.0 and alone["bytes_per_step"] == 0.0


# ---------------------------------------------------------------------------------------------- fragments.py


@pytest.mark.parametrize(
    ("blocks", "P", "expected"),
    [
        (24, 8, [[0, 8, 16], [1, 9, 17], [2, 10, 18], [3, 11, 19], [4, 12, 20], [5, 13, 21], [6, 14, 22], [7, 15, 23]]),
        (5, 2, [[0, 2, 4], [1, 3]]),
        (3, 3, [[0], [1], [2]]),
        (4, 1, [[0, 1, 2, 3]]),
    ],
)
def test_strided_fragments(blocks: int, P: int, expected: list[list[int]]) -> None:
    assert strided_fragments(blocks, P) == expected


@pytest.mark.parametrize(("blocks", "P"), [(4, 0), (4, 5), (0, 1), (4, 2.0)])
def test_strided_fragments_rejects(blocks: int, P: Any) -> None:
    with pytest.raises(ValueError):
        strided_fragments(blocks, P)


@pytest.mark.parametrize(
    ("P", "H", "expected"),
    [(4, 100, [0, 25, 50, 75]), (3, 10, [0, 3, 6]), (1, 30, [0]), (4, 2, [0, 0, 1, 1]), (5, 5, [0, 1, 2, 3, 4])],
)
def test_fragment_offsets(P: int, H: int, expected: list[int]) -> None:
    assert fragment_offsets(P, H) == expected


@given(P=st.integers(1, 16), H=st.integers(1, 120), first=st.integers(1, 500))
@settings(max_examples=150, deadline=None)
def test_every_fragment_due_once_per_period(P: int, H: int, first: int) -> None:
    offsets = fragment_offsets(P, H)
    assert offsets == sorted(offsets) and all(0 <= o < H for o in offsets)
    # spread: consecutive offsets differ by floor or ceil of H / P
    gaps = [b - a for a, b in itertools.pairwise([*offsets, offsets[0] + H])]
    assert all(H // P <= g <= -(-H // P) for g in gaps)
    counts = [0] * P
    for step in range(first, first + H):
        for p in fragments_due(step, offsets, H):
            counts[p] += 1
    assert counts == [1] * P


def test_fragments_due_cases() -> None:
    offsets = fragment_offsets(4, 8)  # [0, 2, 4, 6]
    assert fragments_due(0, offsets, 8) == []
    assert fragments_due(2, offsets, 8) == [1]
    assert fragments_due(8, offsets, 8) == [0]
    assert fragments_due(14, offsets, 8) == [3]
    assert fragments_due(3, offsets, 8) == []
    with pytest.raises(ValueError):
        fragments_due(-1, offsets, 8)
    with pytest.raises(ValueError):
        fragments_due(1, [8], 8)
    with pytest.raises(ValueError):
        fragments_due(1, [0], 0)
