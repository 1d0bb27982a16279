"""The pace a member reports for its layer syncs: the most recent syncs' best delivery rate.

A sync's delivery rate (bytes sent / round seconds) can only understate the link: a round slowed by the
trainers' CPU, a GIL hand-off or a small round's fixed cost reads slow, but nothing makes it read faster
than the link carries. So the estimate is a windowed maximum of recent samples, as BBR estimates the
bottleneck bandwidth (Cardwell et al., "BBR: Congestion-Based Congestion Control", ACM Queue 14(5), 2016).
An average would follow that noise: on a 2-core host at 100 Mbit/s it swung 2.5x between control rounds
and crossed the re-plan threshold for three rounds in a row, re-planning a plan that still hid every sync.
A real slowdown still shows once the window holds only samples taken after it.

A sample is the rate the link carried, not the round's: a ring round of N members also waits 2(N-1) hops
of half an RTT, which the planner's cost model charges on its own (`cost.ring_comm_time`), so
`delivery_rate` takes that chain off first. Left in, it was counted twice: at 10 Mbit/s and 80 ms RTT
(2 regions, bench lm) a 0.93 MB sync read 1.01 MB/s on a 1.25 MB/s link, and the smaller a sync, the larger
the share of latency in its time, so the planner priced small staggered groups slowest of all. Pure: no I/O.
"""

from __future__ import annotations

import collections
import math

from dreamp2p.transport.linkrate.linkstats import rate_past_latency

# samples the maximum is taken over: two periods of a plan of two syncs per period, the shape DreamDDP's
# planner picks on a WAN; a slower link is reported once this many syncs have seen it
PACE_WINDOW = 4


class PaceFilter:
    """Windowed maximum of delivery-rate samples (bytes per second); NaN until the first sample."""

    def __init__(self, window: int = PACE_WINDOW) -> None:
        if window < 1:
            raise ValueError(f"pace window must be >= 1, got {window}")
        self._samples: collections.deque[float] = collections.deque(maxlen=window)

    def add(self, rate: float) -> None:
        """Take one sample; non-finite or non-positive ones say nothing about the link and are ignored."""
        if math.isfinite(rate) and rate > 0:
            self._samples.append(rate)

    @property
    def rate(self) -> float:
        return max(self._samples) if self._samples else math.nan


def delivery_rate(nbytes: int, seconds: float, world: int, rtt_s: float) -> float:
    """Bytes per second the link carried in a ring round of ``world`` members that sent ``nbytes`` in ``seconds``.

    The round's latency chain, 2(world-1) hops of ``rtt_s`` / 2, is taken off its time, at most half of it, as
    the transport's bandwidth probe takes off its RTT (`rate_past_latency`). An unknown RTT (NaN, 0) leaves the
    raw rate; NaN when the round had no time.
    """
    if not seconds > 0 or not math.isfinite(seconds):
        return math.nan
    chain = (world - 1) * rtt_s if world > 1 and math.isfinite(rtt_s) and rtt_s > 0 else 0.0
    return rate_past_latency(nbytes, seconds, chain)
