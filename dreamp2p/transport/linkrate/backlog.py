"""The round bytes a link carries for this node and the member has not acknowledged yet, in seconds of goodput.

Pure bookkeeping (no I/O): each outbound stream counts in the bytes it takes on (`Backlog.add`) and takes
them out again when it ends (`Backlog.settle`): acknowledged by the member, or given up with the round.
A reader asks how many seconds of the link's measured goodput those bytes are (`Backlog.seconds`): inf
while bytes wait on a link whose goodput has not been measured yet (the caller caps what it does with it).

Bytes leave the count only with the member's acknowledgement, not by an estimate of what the link has
carried meanwhile: the goodput measured from our own sends reads several times the link's rate at the
start of a transfer (gRPC and the kernel take megabytes into their buffers at once: 2.7 MB/s measured on a
2 Mbit/s link), and a backlog drained at that rate read empty while the link still had seconds of our
bytes to carry. Counted whole, a transfer's bytes over the goodput overstate its remaining time as it
nears its end, and never understate it.

The heartbeat reads it (`peer.heartbeat.uplink_saturated`): while this node's uplink holds more than a
heartbeat interval of its own round bytes, the small calls that carry the heartbeats wait behind them or
starve beside them at the bottleneck, so an unanswered heartbeat then is no evidence the member is gone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


def known_rate(rate_Bps: float) -> bool:
    """Whether ``rate_Bps`` is a measured rate (positive and finite, not NaN for "not measured yet")."""
    return rate_Bps > 0 and math.isfinite(rate_Bps)


@dataclass
class Backlog:
    """Bytes of open outbound streams on one link that the member has not acknowledged yet."""

    pending: int = 0

    def add(self, nbytes: int) -> None:
        """A stream took on ``nbytes`` more for the link to carry."""
        self.pending += max(0, nbytes)

    def settle(self, nbytes: int) -> None:
        """A stream that had taken on ``nbytes`` in all ended (acknowledged, failed or aborted)."""
        self.pending = max(0, self.pending - max(0, nbytes))

    def seconds(self, rate_Bps: float) -> float:
        """The pending bytes in seconds of ``rate_Bps`` (the link's measured goodput; NaN: not measured):
        0 when none are pending, inf when some are and the rate is unknown."""
        if self.pending <= 0:
            return 0.0
        return self.pending / rate_Bps if known_rate(rate_Bps) else math.inf
