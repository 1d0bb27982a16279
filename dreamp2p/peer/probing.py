"""The active link probe: a tiny echo on every link each interval, and a bandwidth burst on idle ones.

Busy links are measured passively from real transfers (see `transport.linkrate.linkstats`); a link with no
traffic for a whole interval gets a burst now and then, so a plan made for a link that went quiet or
changed rate still has a current goodput, and a link with no sample yet, or none for `STALE_TICKS`
intervals, gets one even while busy (`wants_burst`). A burst sent beside other traffic reads only its share
of the link, so it is recorded as a floor (`LinkEstimator.observe_transfer`), and the link gets a burst on its
next idle interval to replace it. After each probe the link's estimate is checked against the
kernel's TCP ceilings (`transport.linkrate.kernelnet.KernelCheck`, a warning once per link). Runs on the
peer's event loop.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable

from dreamp2p.errors import PeerError
from dreamp2p.transport.client import Link
from dreamp2p.transport.linkrate.kernelnet import KernelCheck

log = logging.getLogger(__name__)

# An idle link gets a bandwidth burst every this many probe intervals (the first one at once).
BURST_EVERY = 4
# A link whose goodput has not been measured for this many probe intervals gets a burst even while busy
# (a minute at the default 5 s interval: one 256 KiB burst a minute is noise beside the syncs it measures).
STALE_TICKS = 12


def _check(kernel: KernelCheck | None, link: Link) -> None:
    if kernel is not None:
        kernel.check(link.dest.node_id, link.stats, link.cfg.streams_per_link)


def wants_burst(idle: bool, samples: int, tick: int, unmeasured_ticks: int, floor: bool = False) -> bool:
    """Whether a probe tick sends a link a burst: an idle link every `BURST_EVERY` ticks, or at once while its
    estimate is only a ``floor``, and any link that has no goodput sample yet, or none for `STALE_TICKS` ticks
    (``unmeasured_ticks``), busy or not.

    A busy link is measured from its own transfers, but only while data backs up in our queue for it
    (`transport.linkrate.linkstats.BusyMeter`). Through a real path the kernel's socket buffers take a modest
    sync at once, nothing backs up here, and a link that carries every sync would never be measured: its
    goodput stays unknown (DreamDDP's planner, which waits for a measured link, never makes its first plan)
    or stays at its first sample for good (a link that slowed from 20 to 1 Mbit/s under syncs of a few
    hundred KB kept reporting its first 0.8 MB/s for the whole run, so the planner never saw the change).
    """
    return samples == 0 or (idle and (floor or tick % BURST_EVERY == 0)) or unmeasured_ticks >= STALE_TICKS


async def probe_forever(
    links: Callable[[], Iterable[Link]], interval_s: float, burst_bytes: int, kernel: KernelCheck | None = None
) -> None:
    """Probe ``links()`` every ``interval_s`` until cancelled; a failed probe is logged, never raised."""
    tick = 0
    measured: dict[str, tuple[int, int]] = {}  # node -> (its sample count, the tick that count was first seen)
    while True:
        await asyncio.sleep(interval_s)
        tick += 1
        for link in list(links()):
            node, samples = link.dest.node_id, link.stats.samples
            count, since = measured.get(node, (samples, tick))
            since = since if count == samples else tick
            measured[node] = (samples, since)
            idle = time.monotonic() - link.stats.last_activity >= interval_s
            try:
                await link.probe_rtt()  # a tiny echo costs nothing even on a busy link
                if wants_burst(idle, samples, tick, tick - since, link.stats.floor):
                    await link.probe_bandwidth(burst_bytes, shared=not idle)
                    link.stats.last_activity = time.monotonic()
            except PeerError as exc:
                log.warning("probe of %s failed: %s", link.dest.node_id, exc)
                continue
            _check(kernel, link)


async def probe_once(links: Iterable[Link], burst_bytes: int, kernel: KernelCheck | None = None) -> None:
    """Measure every link now: an RTT echo and a burst each."""
    for link in links:
        await link.probe_rtt()
        await link.probe_bandwidth(burst_bytes)
        _check(kernel, link)
