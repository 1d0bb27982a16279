"""Heartbeats through a saturated slow link: a member busy sending a large round is not counted dead.

Found by `bench plancheck` at 10 Mbit/s: the attach broadcast (13 MB) filled each data connection's socket
buffer with seconds of frames, the heartbeat echoes queued behind them on the same connection, and both
sides counted the other dead mid-round. Two network namespaces joined by a veth pair shaped with tbf
(deploy/netns-wan.sh) at 4 Mbit/s; heartbeats every 0.25 s, dead after 3 misses (0.75 s), while a 6 MB
fp32 all-reduce keeps both directions busy for about 12 s. Needs root.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from dreamp2p.devtools.launch import run_local

SCRIPT = Path(__file__).resolve().parents[2] / "deploy" / "netns-wan.sh"


def _sh(*args: str) -> None:
    subprocess.run(args, check=True, capture_output=True, text=True, timeout=30)


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root")
def test_a_member_sending_a_large_round_over_a_slow_link_stays_alive() -> None:
    prefix = f"dph{os.getpid() % 100000}"
    subnet = f"10.205.{os.getpid() % 200 + 20}"
    _sh("bash", str(SCRIPT), "up", "--prefix", prefix, "--rate", "4mbit", "--subnet", subnet)
    try:
        hosts = [(f"{prefix}-a", f"{subnet}.1"), (f"{prefix}-b", f"{subnet}.2")]
        config = {"transport": {"heartbeat_s": 0.25, "heartbeat_misses": 3, "round_timeout_s": 120.0}}
        results = run_local(
            2,
            "dreamp2p.devtools.bench.jobs.averaging:allreduce_check",
            {"sizes": [1_500_000], "codecs": ["fp32"], "seed": 3},
            config,
            timeout=200,
            hosts=hosts,  # type: ignore[arg-type]
        )
    finally:
        _sh("bash", str(SCRIPT), "down", "--prefix", prefix)
    reports = [r["fp32"] for r in results]
    assert len({r["digest"] for r in reports}) == 1  # the round completed on both, with one result
    assert all(r["finite"] for r in reports)
    # 6 MB from each side at 4 Mbit/s (0.5 MB/s): the link was the bottleneck for about 12 s
    assert reports[0]["bytes_sent"] >= 3_000_000
