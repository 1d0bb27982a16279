"""`dreamp2p bench allreduce`: ring all-reduce time, algorithm bandwidth and CPU per round, per codec.

On loopback by default; with ``netns`` (root) the peers run in network namespaces joined by tbf-shaped links
of ``rate`` (`dreamp2p.devtools.netns`, as `bench lm`), where the kernel's per-packet work of a shaped TCP
link joins the round's CPU. CPU per round is each peer process's CPU time over the round (all threads),
averaged over peers: ``cpu_ms_per_round`` for the buffer, ``tiny_cpu_ms_per_round`` for a 1024-element
round (the fixed cost of a round: its stream, frames, commit vote), and ``cpu_ms_per_input_MB``, the
buffer's CPU per MB of fp32 input, which is what a strategy pays for each MB of model it averages.
"""

from __future__ import annotations

import contextlib
from typing import Any

from dreamp2p.compression import codec_names
from dreamp2p.devtools.launch import run_local
from dreamp2p.devtools.netns import Namespaces


def bench_allreduce(
    peers: int = 4,
    mbytes: float = 64.0,
    codecs: list[str] | None = None,
    rounds: int = 3,
    streams: int = 2,
    netns: bool = False,
    rate: str = "100mbit",
) -> dict[str, Any]:
    names = codecs or codec_names()
    config = {"transport": {"streams_per_link": streams, "probe_interval_s": 30.0}}
    with Namespaces(peers, rate) if netns else contextlib.nullcontext() as ns:
        results = run_local(
            peers,
            "dreamp2p.devtools.bench.jobs.averaging:allreduce_timing",
            {"mbytes": mbytes, "codecs": names, "rounds": rounds},
            config,
            hosts=ns.hosts if ns is not None else None,
        )
    nbytes = int(mbytes * 1e6 // 4) * 4
    factor = 2 * (peers - 1) / peers
    out: dict[str, Any] = {}
    for name in names:
        seconds = max(r[name]["seconds"] for r in results)
        cpu = sum(r[name]["cpu_s_per_round"] for r in results) / peers
        tiny = sum(r[name]["tiny_cpu_s_per_round"] for r in results) / peers
        out[name] = {
            "seconds": round(seconds, 4),
            "algbw_MBps": round(nbytes * factor / seconds / 1e6, 1),
            "wire_MB_per_peer": round(results[0][name]["bytes_sent_per_round"] / 1e6, 2),
            "chunk_bytes": results[0][name]["chunk_bytes"],
            "cpu_ms_per_round": round(cpu * 1e3, 2),
            "tiny_cpu_ms_per_round": round(tiny * 1e3, 2),
            "cpu_ms_per_input_MB": round(cpu * 1e3 / (nbytes / 1e6), 3),
        }
    link = {"netns": True, "rate": rate} if netns else {"netns": False}
    return {"peers": peers, "mbytes": mbytes, **link, "codecs": out}
