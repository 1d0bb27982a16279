"""`Plan.inflight_share`: the largest share of the model whose layer syncs travel across a step boundary, the
host memory a DreamDDP member holds for them between steps (a snapshot and a mean per element)."""

from __future__ import annotations

import pytest

from dreamp2p.schedule.plan import GroupSync, Plan

LAYER_BYTES = [100, 200, 300, 400]


def plan(period: int, *syncs: tuple[int, tuple[int, ...], int]) -> Plan:
    """A plan of ``syncs`` given as (iteration, layers, delay), over the four layers of LAYER_BYTES."""
    groups = tuple(GroupSync(i, layers, d, 0.0, 0.0) for i, layers, d in sorted(syncs))
    return Plan(1, 0, period, ("a", "b", "c", "d"), groups, (0.0,) * period, 0.01)


@pytest.mark.parametrize(
    ("syncs", "share"),
    [
        ([(0, (0, 1, 2, 3), 0)], 0.0),  # every sync lands in the step that launched it
        ([(0, (0, 1, 2, 3), 1)], 1.0),  # the whole model travels across the end of step 0
        ([(0, (0, 1), 2), (2, (2, 3), 1)], 0.7),  # never at once: the larger group's 700 of 1000 bytes
        ([(0, (0, 1), 3), (2, (2, 3), 1)], 1.0),  # both across the end of step 2
        ([(3, (0, 1), 2), (0, (2, 3), 1)], 1.0),  # launched at the last step, it wraps into the next period
        ([(1, (3,), 3), (2, (0, 1, 2), 0)], 0.4),  # a delay-0 sync never holds memory between steps
    ],
)
def test_the_share_in_flight_is_the_largest_across_any_step_end(
    syncs: list[tuple[int, tuple[int, ...], int]], share: float
) -> None:
    assert plan(4, *syncs).inflight_share(LAYER_BYTES) == pytest.approx(share)


def test_a_model_of_no_bytes_has_nothing_in_flight() -> None:
    assert plan(4, (0, (0, 1, 2, 3), 2)).inflight_share([0, 0, 0, 0]) == 0.0
