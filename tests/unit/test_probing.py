"""When a probe tick sends a link a bandwidth burst (`dreamp2p.peer.probing.wants_burst`), pure."""

from __future__ import annotations

import pytest

from dreamp2p.peer.probing import BURST_EVERY, wants_burst


@pytest.mark.parametrize(
    ("idle", "samples", "tick", "expected"),
    [
        # a link never measured gets a burst at once, busy or idle: the planner waits for its goodput
        (True, 0, 1, True),
        (False, 0, 1, True),
        (False, 0, BURST_EVERY, True),
        # a measured busy link is left to its own transfers
        (False, 3, 1, False),
        (False, 3, BURST_EVERY, False),
        # a measured idle link: every BURST_EVERY-th tick only
        (True, 3, 1, False),
        (True, 3, BURST_EVERY, True),
        (True, 3, 2 * BURST_EVERY, True),
    ],
)
def test_which_links_get_a_burst(idle: bool, samples: int, tick: int, expected: bool) -> None:
    assert wants_burst(idle, samples, tick) is expected
