"""`dreamp2p bench allreduce`: ring all-reduce time and algorithm bandwidth per codec on loopback."""

from __future__ import annotations

from typing import Any

from dreamp2p.compression import codec_names
from dreamp2p.devtools.launch import run_local


def bench_allreduce(
    peers: int = 4, mbytes: float = 64.0, codecs: list[str] | None = None, rounds: int = 3, streams: int = 2
) -> dict[str, Any]:
    names = codecs or codec_names()
    config = {"transport": {"streams_per_link": streams, "probe_interval_s": 30.0}}
    results = run_local(
        peers,
        "dreamp2p.devtools.bench.jobs:allreduce_timing",
        {"mbytes": mbytes, "codecs": names, "rounds": rounds},
        config,
    )
    nbytes = int(mbytes * 1e6 // 4) * 4
    factor = 2 * (peers - 1) / peers
    out: dict[str, Any] = {}
    for name in names:
        seconds = max(r[name]["seconds"] for r in results)
        out[name] = {
            "seconds": round(seconds, 4),
            "algbw_MBps": round(nbytes * factor / seconds / 1e6, 1),
            "wire_MB_per_peer": round(results[0][name]["bytes_sent_per_round"] / 1e6, 2),
            "chunk_bytes": results[0][name]["chunk_bytes"],
        }
    return {"peers": peers, "mbytes": mbytes, "codecs": out}
