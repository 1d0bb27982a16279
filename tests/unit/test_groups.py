"""Group ids: every use gets its own range, and ids outside the ranges are refused instead of colliding."""

from __future__ import annotations

import pytest

from dreamp2p.sync.model.groups import (
    GROUP_CONTROL,
    GROUP_FRAGMENT_BASE,
    GROUP_PLAN_BASE,
    MAX_FRAGMENTS,
    MAX_PLAN_SYNCS,
    MAX_PLAN_VERSION,
    anchor_check_group,
    anchor_group,
    fragment_group,
    plan_sync_group,
)

RETRY_BIT = 1 << 31


@pytest.mark.parametrize("version", [0, 1, 7, MAX_PLAN_VERSION - 1])
def test_a_plans_syncs_anchors_and_checks_stay_below_the_next_plans_range(version: int) -> None:
    first, last = plan_sync_group(version, 0), plan_sync_group(version, MAX_PLAN_SYNCS - 1)
    anchors = [anchor_group(plan_sync_group(version, i)) for i in (0, MAX_PLAN_SYNCS - 1)]
    checks = [anchor_check_group(plan_sync_group(version, i)) for i in (0, MAX_PLAN_SYNCS - 1)]
    assert first < last < anchors[0] < anchors[1] < checks[0] < checks[1] < plan_sync_group(version + 1, 0)


def test_the_largest_ids_stay_below_the_retry_bit_and_the_ranges_do_not_meet() -> None:
    top = anchor_check_group(plan_sync_group(MAX_PLAN_VERSION, MAX_PLAN_SYNCS - 1))
    assert top < RETRY_BIT
    assert GROUP_CONTROL < GROUP_FRAGMENT_BASE
    assert fragment_group(MAX_FRAGMENTS - 1) < GROUP_PLAN_BASE == plan_sync_group(0, 0)


def test_a_large_models_plan_gets_distinct_ids() -> None:
    # e.g. 80 blocks x 9 parameter-owning modules, each its own sync: ids of the old layout (1000 per
    # plan, checks at +500) would have collided from sync 500 on
    syncs = 720
    ids = [plan_sync_group(3, i) for i in range(syncs)]
    anchors = [anchor_group(g) for g in ids]
    checks = [anchor_check_group(g) for g in ids]
    assert len(set(ids) | set(anchors) | set(checks)) == 3 * syncs


@pytest.mark.parametrize(
    ("version", "index", "message"),
    [
        (0, MAX_PLAN_SYNCS, "at most"),
        (0, -1, "at most"),
        (MAX_PLAN_VERSION + 1, 0, "plan version"),
        (-1, 0, "plan version"),
    ],
)
def test_ids_outside_the_ranges_are_refused(version: int, index: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        plan_sync_group(version, index)


@pytest.mark.parametrize("fragment", [-1, MAX_FRAGMENTS])
def test_fragments_outside_their_range_are_refused(fragment: int) -> None:
    with pytest.raises(ValueError, match="fragment"):
        fragment_group(fragment)
