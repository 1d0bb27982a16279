"""How big a bandwidth probe's burst is: large enough that a policer's bucket does not set what it reads.

A burst timed end to end reads a policed link too fast: a policer (tbf, a provider's token bucket) lets
its first ``bucket`` bytes through at line rate, and tbf's bucket here is 4 ms of the rate (at least 32 KiB),
so a fixed 256 KiB burst read 12% over the configured rate at 100 Mbit/s and 42% over at 200. A burst sized
from the link's own estimate to last `probe_span` (50 ms) keeps the bucket's share small at every rate: the
same links read 5% and 11% under (the payload's share of the wire, ~95%, included). Slow links keep the
least size, 256 KiB: 7-8% over at 5 and 20 Mbit/s, as before.

On a long path a burst also meets TCP's window: a connection's first burst, and one after an idle spell
(Linux restarts the window after an idle RTO), crosses in a few round trips paced by a window still opening,
and read 74% under at 100 Mbit/s and 100 ms. Such a burst is sent again at once (`burst_again`): the window
it opened stays open, and at 20 Mbit/s and 100 ms the estimate went from 52% under to 4% under
(`dreamp2p bench probe` prints the error over a grid of rate x RTT x loss). Growing one burst past the window,
a burst that empties the bucket first, and the difference of two timed bursts were each measured and dropped:
through a path whose queue holds one bandwidth-delay product, the extra bytes' losses cost the timed burst up
to half the rate, and one lost packet made a difference read 50 times it. Busy links are measured from their
own transfers instead (`linkstats.BusyMeter`, checked against each stream's delivery).

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
# a burst that crossed in fewer round trips than this may have been paced by TCP's window (`burst_again`): slow
# start from the initial window needs 5 for a 256 KiB burst, 9 for 4 MiB ...
WINDOW_RTTS = 8.0
# ... and is sent again while each repeat reads this many times the one before
OPENING = 1.1
# the most bursts one probe sends (the first and its repeats)
MAX_BURSTS = 6


def burst_again(transfer_s: float, rtt_s: float, previous_Bps: float | None, current_Bps: float) -> bool:
    """Whether a probe sends its burst once more, at once, before recording a reading.

    On a long path a burst that crosses in a few round trips is paced by TCP's window, not by the link: a
    connection's first burst, or one after an idle spell (Linux restarts the window after an idle RTO),
    grows from the initial window, and a 256 KiB burst read 0.68 MB/s of a 2.5 MB/s path at 100 ms. Sent
    again at once, the window it opened stays open and the same burst read 2.39. So a burst whose transfer
    (its time past one round trip, ``transfer_s``) lasted under `WINDOW_RTTS` round trips is repeated while
    each repeat still reads `OPENING` times more than the one before (``previous_Bps``; None: first burst).
    """
    if not (math.isfinite(rtt_s) and rtt_s > 0) or transfer_s >= WINDOW_RTTS * rtt_s:
        return False
    return previous_Bps is None or current_Bps > OPENING * previous_Bps


def repeat_size(size: int, read_Bps: float, rtt_s: float, floor: int, cap: int) -> int:
    """Bytes of a repeated burst (`burst_again`): twice the burst before it (``size``, which read ``read_Bps``),
    or what takes `probe_span` at that reading where more, within [``floor``, ``cap``].

    Doubling lets TCP's slow start run on: a burst about one window long, as one sized from its own reading
    is when the window paced it, leaves the window about where it found it.
    """
    return min(cap, max(2 * size, probe_size(read_Bps, rtt_s, floor, cap)))


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
