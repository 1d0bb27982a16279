"""Per-link statistics: smoothed RTT and goodput from passive transfer samples and active probes.

Pure bookkeeping (no I/O): the transport feeds it timestamps and byte counts, the planner reads it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


def rate_past_latency(nbytes: int, seconds: float, latency_s: float) -> float:
    """Bytes per second of a transfer of ``nbytes`` that took ``seconds``, ``latency_s`` of which were latency.

    The latency comes off at most half the time: a latency estimate that queueing inflated cannot make a
    sample read more than twice its raw rate.
    """
    return nbytes / max(seconds - latency_s, 0.5 * seconds)


# A meter sample more than this many times what its whole stream delivered is not the link's pace (see
# `delivery_checked`); the slack covers the stream's own gaps, which lower the delivered figure.
METER_SLACK = 2.0


def delivery_checked(
    samples: list[tuple[int, float]], stream_bytes: int, stream_s: float, latency_s: float
) -> list[tuple[int, float]]:
    """The hand-off samples of one stream (`BusyMeter`) that its delivery confirms.

    A stream whose bytes the socket buffers and HTTP/2 windows take at once is handed off at memory speed: on a
    100 ms path a 2 MB sync read 7.3 MB/s through a 2.5 MB/s link, and DreamDDP's syncs of a few hundred KB
    read 18-50 times the link. The acknowledgement that ends the stream comes only once every byte arrived,
    so ``stream_bytes`` over ``stream_s`` (first hand-off to acknowledgement, ``latency_s`` of it one round
    trip) bounds the link's rate from below; a sample over `METER_SLACK` times that bound is dropped.
    """
    if stream_bytes <= 0 or not (stream_s > 0 and math.isfinite(stream_s)):
        return []
    latency = latency_s if math.isfinite(latency_s) and latency_s > 0 else 0.0
    bound = METER_SLACK * rate_past_latency(stream_bytes, stream_s, latency)
    return [(b, s) for b, s in samples if s > 0 and b / s <= bound]


@dataclass
class LinkEstimator:
    """EWMA of a link's goodput (bytes/s) and RTT (seconds), plus traffic counters."""

    alpha: float = 0.3
    rtt_s: float = math.nan
    goodput_Bps: float = math.nan
    samples: int = 0
    rtt_samples: int = 0
    min_rtt_s: float = math.inf  # propagation estimate, free of queueing and scheduling delay
    bytes_sent: int = 0
    bytes_received: int = 0
    last_activity: float = 0.0
    delay_line_peak: int = 0  # most frames at once in the emulated delay line (transport.delay_s)
    # every goodput sample so far was shared with other traffic (`observe_transfer`): the link carries at
    # least ``goodput_Bps``, maybe much more
    floor: bool = False

    def observe_transfer(self, nbytes: int, seconds: float, *, shared: bool = False) -> None:
        """A period during which the link was kept busy moved ``nbytes`` in ``seconds``.

        ``shared``: other traffic held the link meanwhile (a probe burst sent beside a sync), so the rate may be
        only the share the transfer got: at 5 Mbit/s such a burst read 0.25 MB/s of a 0.625 MB/s link. While
        the link has no other sample, the latest such reading stands as a floor (``floor``), and the first
        sample of the link alone replaces it outright. The latest, not the highest: on a link that syncs keep
        busy, shared readings may be the only news that the link slowed (`peer.probing.wants_burst`), and a
        floor that could only rise would hide it. Once the link has a full sample, a shared reading is a
        sample like any other, for the same reason.
        """
        if nbytes <= 0 or seconds <= 0 or not math.isfinite(seconds):
            return
        rate = nbytes / seconds
        if self.samples == 0 or self.floor:
            self.goodput_Bps = rate
            self.floor = shared
        else:
            self.goodput_Bps = (1 - self.alpha) * self.goodput_Bps + self.alpha * rate
        self.samples += 1

    def observe_rtt(self, seconds: float) -> None:
        if seconds <= 0 or not math.isfinite(seconds):
            return
        self.rtt_s = seconds if self.rtt_samples == 0 else (1 - self.alpha) * self.rtt_s + self.alpha * seconds
        self.min_rtt_s = min(self.min_rtt_s, seconds)
        self.rtt_samples += 1


@dataclass
class BusyMeter:
    """Turns a stream of "frame handed to the link" events into goodput samples.

    Only intervals during which more data was already waiting count: then the link, not the producer,
    set the pace, so bytes / busy time estimates what the link can carry. A sample is emitted once
    ``window_s`` of busy time has accumulated.
    """

    window_s: float = 0.05
    _last_t: float | None = None
    _last_backlogged: bool = False
    _busy_bytes: int = 0
    _busy_s: float = 0.0

    def on_send(self, now: float, nbytes: int, backlogged: bool) -> tuple[int, float] | None:
        sample = None
        if self._last_t is not None and self._last_backlogged:
            self._busy_bytes += nbytes
            self._busy_s += max(0.0, now - self._last_t)
            if self._busy_s >= self.window_s:
                sample = (self._busy_bytes, self._busy_s)
                self._busy_bytes, self._busy_s = 0, 0.0
        self._last_t = now
        self._last_backlogged = backlogged
        return sample

    def idle(self) -> None:
        self._last_t = None
        self._last_backlogged = False
