"""How big a bandwidth probe's burst is: large enough that a policer's bucket does not set what it reads.

A burst timed end to end reads a policed link too fast: a policer (tbf, a provider's token bucket) lets
its first ``bucket`` bytes through at line rate, and tbf's bucket here is 4 ms of the rate (at least 32 KiB),
so a fixed 256 KiB burst read 12% over the configured rate at 100 Mbit/s and 42% over at 200. A burst sized
from the link's own estimate to last `probe_span` (50 ms) keeps the bucket's share small at every rate: the
same links read 5% and 11% under (the payload's share of the wire, ~95%, included). Slow links keep the
least size, 256 KiB: 7-8% over at 5 and 20 Mbit/s, as before.

Not solved here: on a long path a burst shorter than a few bandwidth-delay products never leaves TCP's first
windows, and what it reads sets the next burst's size, so the estimate stays where it started: 74% under at
100 Mbit/s and 100 ms, 20% under at 20 Mbit/s and 150 ms (4% under at 5-20 Mbit/s and 100 ms). Growing the
burst past the window, a burst that empties the bucket first, and the difference of two timed bursts were
each measured and dropped: through a path whose queue holds one bandwidth-delay product, the extra bytes'
losses cost the timed burst up to half the rate, and one lost packet made a difference read 50 times it.
Busy links are measured from their own transfers instead (`linkstats.BusyMeter`).

Pure: no I/O, no clock.
"""

from __future__ import annotations

import math

# the largest burst a peer accepts in one Probe call (its own bursts stay within it too)
MAX_PROBE_BYTES = 4 << 20
# the least time a probe's burst should take at the link's estimated rate: a bucket of a few ms of the
# rate stays a small share of it, and so do a few ms of scheduling noise
PROBE_MIN_SPAN_S = 0.05
# ... and at least this many round trips on a longer path
PROBE_SPAN_RTTS = 1.0


def probe_span(rtt_s: float) -> float:
    """The least time a probe's burst should take, on a path of ``rtt_s``."""
    rtt = rtt_s if math.isfinite(rtt_s) and rtt_s > 0 else 0.0
    return max(PROBE_MIN_SPAN_S, PROBE_SPAN_RTTS * rtt)


def probe_size(goodput_Bps: float, rtt_s: float, floor: int, cap: int) -> int:
    """Bytes of a probe's burst: what takes `probe_span` at ``goodput_Bps`` (the link's estimate; unknown,
    NaN: ``floor``), within [``floor``, ``cap``]."""
    if floor < 1 or cap < floor:
        raise ValueError(f"probe sizes need 1 <= floor <= cap, got floor={floor}, cap={cap}")
    if not (math.isfinite(goodput_Bps) and goodput_Bps > 0):
        return floor
    return int(min(cap, max(floor, goodput_Bps * probe_span(rtt_s))))
