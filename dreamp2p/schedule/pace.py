"""The pace a member reports for its layer syncs: the most recent syncs' best delivery rate.

A sync's delivery rate (bytes sent / round seconds) can only understate the link: a round slowed by the
trainers' CPU, a GIL hand-off or a small round's fixed cost reads slow, but nothing makes it read faster
than the link carries. So the estimate is a windowed maximum of recent samples, as BBR estimates the
bottleneck bandwidth (Cardwell et al., "BBR: Congestion-Based Congestion Control", ACM Queue 14(5), 2016).
An average would follow that noise: on a 2-core host at 100 Mbit/s it swung 2.5x between control rounds
and crossed the re-plan threshold for three rounds in a row, re-planning a plan that still hid every sync.
A real slowdown still shows once the window holds only samples taken after it. Pure: no I/O.
"""

from __future__ import annotations

import collections
import math

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
