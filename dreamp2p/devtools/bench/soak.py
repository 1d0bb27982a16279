"""`dreamp2p bench soak`: 4 peers averaging back to back for minutes; resource growth and round failures.

Reported per run (worst peer): RSS growth after warm-up (the first 20% of the run, at least one sample)
as a fraction, open file descriptors and live asyncio tasks (min and max over the samples after
warm-up), rounds completed and failed. Nothing is injected: any failure is a finding.
"""

from __future__ import annotations

from typing import Any

from dreamp2p.devtools.launch import run_local


def bench_soak(minutes: float = 10.0, peers: int = 4, mbytes: float = 4.0) -> dict[str, Any]:
    seconds = minutes * 60
    sample_s = max(1.0, seconds / 60)
    results = run_local(
        peers,
        "dreamp2p.devtools.bench.jobs.averaging:soak",
        {"seconds": seconds, "mbytes": mbytes, "sample_s": sample_s},
        {"transport": {"probe_interval_s": 5.0}},
        timeout=seconds + 600,
    )
    growth = []
    fds: list[int] = []
    tasks: list[int] = []
    for r in results:
        samples = r["samples"]
        warm = max(1, len(samples) // 5)
        base = samples[warm]["rss"] if warm < len(samples) else samples[-1]["rss"]
        growth.append((samples[-1]["rss"] - base) / base if base else 0.0)
        after = samples[warm:] or samples[-1:]
        fds += [s["fds"] for s in after]
        tasks += [s["tasks"] for s in after]
    return {
        "minutes": minutes,
        "peers": peers,
        "rss_growth_after_warmup": round(max(growth), 4),
        "rss_end_MB": round(max(r["samples"][-1]["rss"] for r in results) / 1e6, 1),
        "fds_min": min(fds),
        "fds_max": max(fds),
        "tasks_min": min(tasks),
        "tasks_max": max(tasks),
        "rounds_completed": sum(r["rounds"] for r in results),
        "rounds_failed": sum(r["failed"] for r in results),
        "frames_rejected": sum(r["frames_rejected"] for r in results),
    }
