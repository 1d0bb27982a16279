"""`dreamp2p bench probe`: how far a link's bandwidth estimate lies from the rate it was shaped to, per path.

For each point of a grid of rate x RTT x loss, two network namespaces are joined by tbf (no RTT, no loss)
or by the packet emulator (`dreamp2p.devtools.wanemu`), a sink serves the real servicer in one of them
(`bench.transport.beside_sink`) and a :class:`~dreamp2p.transport.client.Link` in the other estimates the
link the way a member's link does: RTT echoes, then bandwidth bursts each after an idle spell (an idle link's
probe, `peer.probing`), then sync-sized streams, whose hand-off times feed the same estimate
(`transport.linkrate.linkstats.BusyMeter`). Each point reports the estimate after the bursts and after the
streams, with its error against the shaped rate: what a planner that trusted it would be off by.
"""

from __future__ import annotations

import asyncio
import itertools
import multiprocessing as mp
import multiprocessing.connection
import time
from typing import Any

from dreamp2p.config import TransportConfig, parse_rate
from dreamp2p.config.parse import parse_duration
from dreamp2p.devtools.bench.transport import beside_sink, report_to, sink_frame, sink_link
from dreamp2p.devtools.launch import enter_netns
from dreamp2p.devtools.netns import Namespaces

RATES = ("5mbit", "20mbit", "100mbit", "200mbit")
RTTS = ("0ms", "50ms", "150ms")
LOSSES = (0.0, 0.001, 0.01)
SYNC_CHUNK = 32 << 10
SYNC_GAP_S = 0.5  # between sync streams: a layer group's sync every few steps


def _prober(
    conn: mp.connection.Connection,
    address: str,
    netns: str | None,
    cfg: TransportConfig,
    bursts: int,
    syncs: int,
    sync_bytes: int,
    idle_s: float,
) -> None:
    if netns:
        enter_netns(netns)

    async def main() -> dict[str, Any]:
        link = await sink_link(cfg, address, "bench-prober")
        try:
            for _ in range(3):
                await link.probe_rtt()
            readings = []
            for _ in range(bursts):
                await asyncio.sleep(idle_s)  # TCP's window decays after an idle RTO: what an idle link's burst meets
                readings.append(await link.probe_bandwidth(cfg.probe_burst_bytes))
            after_bursts = link.stats.goodput_Bps
            # a ring round's stream carries its chunks back to back, so data backs up and the meter samples
            frames = [sink_frame(SYNC_CHUNK // 4, "bench-prober") for _ in range(max(1, sync_bytes // SYNC_CHUNK))]
            t0 = time.perf_counter()
            for _ in range(syncs):
                await asyncio.sleep(SYNC_GAP_S)
                stream = link.open_stream(timeout=120)
                for frame in frames:
                    await stream.put(frame)
                await stream.close()
            return {
                "bursts_MBps": [round(r / 1e6, 3) for r in readings],
                "after_bursts_MBps": after_bursts / 1e6,
                "after_syncs_MBps": link.stats.goodput_Bps / 1e6,
                "syncs_s": time.perf_counter() - t0 - syncs * SYNC_GAP_S,
                "min_rtt_ms": link.stats.min_rtt_s * 1e3,
            }
        finally:
            await link.close()

    report_to(conn, main)


def probe_point(
    rate: str, rtt: str, loss: float, bursts: int = 3, syncs: int = 8, sync_bytes: int = 1 << 20, idle_s: float = 3.0
) -> dict[str, Any]:
    """One grid point: the estimates a link of ``rate``, ``rtt`` and ``loss`` gets, against ``rate``."""
    cfg = TransportConfig()
    with Namespaces(2, rate, rtt=rtt if parse_duration(rtt) else None, loss=loss or None) as net:
        args = (bursts, syncs, sync_bytes, idle_s)
        res, _ = beside_sink(cfg, net.hosts, _prober, args, "prober", 300)
    shaped = parse_rate(rate) / 1e6
    return {
        "rate": rate,
        "rtt": rtt,
        "loss": loss,
        "shaped_MBps": round(shaped, 3),
        "bursts_MBps": res["bursts_MBps"],
        "after_bursts_MBps": round(res["after_bursts_MBps"], 3),
        "bursts_error": round(res["after_bursts_MBps"] / shaped - 1, 3),
        "after_syncs_MBps": round(res["after_syncs_MBps"], 3),
        "syncs_error": round(res["after_syncs_MBps"] / shaped - 1, 3),
        # what the sync streams moved per second of their own time (gaps between them excluded)
        "syncs_MBps": round(syncs * sync_bytes / 1e6 / max(res["syncs_s"], 1e-9), 3),
        "min_rtt_ms": round(res["min_rtt_ms"], 1),
    }


def bench_probe(
    rates: tuple[str, ...] = RATES,
    rtts: tuple[str, ...] = RTTS,
    losses: tuple[float, ...] = LOSSES,
    bursts: int = 3,
    syncs: int = 8,
    sync_kb: int = 1024,
) -> dict[str, Any]:
    """Every point of ``rates`` x ``rtts`` x ``losses`` (`probe_point`), and the worst errors over them."""
    points = [
        probe_point(rate, rtt, loss, bursts, syncs, sync_kb << 10)
        for rate, rtt, loss in itertools.product(rates, rtts, losses)
    ]
    return {
        "points": points,
        "worst_bursts_error": max((p["bursts_error"] for p in points), key=abs),
        "worst_syncs_error": max((p["syncs_error"] for p in points), key=abs),
        "within_15pct": sum(abs(p["syncs_error"]) <= 0.15 for p in points),
        "of": len(points),
    }
