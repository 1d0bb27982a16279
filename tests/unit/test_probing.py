"""When a probe tick sends a link a bandwidth burst (`dreamp2p.peer.probing.wants_burst`), pure."""

from __future__ import annotations

import pytest

from dreamp2p.peer.probing import BURST_EVERY, STALE_TICKS, wants_burst


@pytest.mark.parametrize(
    ("idle", "samples", "tick", "unmeasured", "expected"),
    [
        # a link never measured gets a burst at once, busy or idle: the planner waits for its goodput
        (True, 0, 1, 0, True),
        (False, 0, 1, 0, True),
        (False, 0, BURST_EVERY, 0, True),
        # a measured busy link is left to its own transfers
        (False, 3, 1, 0, False),
        (False, 3, BURST_EVERY, 0, False),
        # a measured idle link: every BURST_EVERY-th tick only
        (True, 3, 1, 0, False),
        (True, 3, BURST_EVERY, 0, True),
        (True, 3, 2 * BURST_EVERY, 0, True),
        # a busy link whose goodput has not moved for STALE_TICKS ticks is measured anyway, at any tick
        (False, 3, 1, STALE_TICKS - 1, False),
        (False, 3, 1, STALE_TICKS, True),
        (False, 3, BURST_EVERY + 1, STALE_TICKS + 5, True),
        (True, 3, 1, STALE_TICKS, True),
    ],
)
def test_which_links_get_a_burst(idle: bool, samples: int, tick: int, unmeasured: int, expected: bool) -> None:
    assert wants_burst(idle, samples, tick, unmeasured) is expected


@pytest.mark.parametrize(
    ("idle", "tick", "unmeasured", "expected"),
    [
        (True, 1, 0, True),  # idle: measured alone at once, not at the next BURST_EVERY-th tick
        (True, BURST_EVERY + 1, 0, True),
        (False, 1, 0, False),  # still busy: another burst would read another share
        (False, 1, STALE_TICKS, True),  # the stale rule holds for floors too
    ],
)
def test_a_link_known_only_by_a_floor_gets_a_burst_on_its_first_idle_tick(
    idle: bool, tick: int, unmeasured: int, expected: bool
) -> None:
    assert wants_burst(idle, 1, tick, unmeasured, floor=True) is expected
