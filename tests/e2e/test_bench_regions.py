"""`dreamp2p bench regions --json` end to end at a toy size, in real network namespaces (root only).

Two regions of two ranks, each rank a host of its own, and two of one, over tbf-shaped shard links: the final
JSON line's fields, the identity check, each local rank's share of the WAN bytes, and that the namespaces are
gone afterwards.
No speeds are asserted: the figures belong to docs/BENCHMARKS.md, not to a test on a shared host.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from dreamp2p.devtools.localrun import child_env

TINY = ["--steps", "3", "--width", "32", "--depth", "1", "--rate", "50mbit"]


def _namespaces(prefix: str) -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30, check=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(prefix + "-")]


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.skipif(
    os.geteuid() != 0, reason="bench regions puts every rank in a network namespace shaped by tc tbf: root"
)
def test_bench_regions_tiny_reports_goodput_bytes_and_identity() -> None:
    # --hosts: every rank a host of its own (its torchrun agent, static rendezvous), each region's ring entry
    # listing its ranks' addresses: a region spanning hosts (regions on one host are tests/net/test_regions.py's)
    cmd = [sys.executable, "-P", "-m", "dreamp2p", "bench", "regions", "--json", "--hosts", *TINY]
    proc = subprocess.Popen(cmd, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = proc.communicate(timeout=840)  # a hang guard, not a bound on speed
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, stderr[-4000:]
    assert _namespaces(f"dpr{proc.pid % 100000}") == []  # every namespace it made is gone
    out = json.loads(stdout.strip().splitlines()[-1])  # the final line is one JSON object

    assert out["bench"] == "regions" and out["shaping"] == "tbf"
    assert (out["regions"], out["ranks"], out["strategy"], out["hosts"]) == (2, 2, "ssgd", "a host per rank")
    assert (out["steps"], out["timed_steps"], out["quiet_steps"]) == (3, 2, 2)
    assert out["target_ratio"] == 1.7
    assert isinstance(out["meets_target"], bool)
    one, many = out["one_rank"], out["sharded"]
    assert sorted(one["bytes_per_rank"]) == ["r0", "r1"]  # a region of one rank: one peer
    assert sorted(many["bytes_per_rank"]) == ["r0", "r0.1", "r1", "r1.1"]  # each local rank its own peer
    for phase in (one, many):
        assert phase["steps_per_s"] > 0 and phase["goodput_MBps"] > 0 and phase["link_util"] > 0
        assert len(phase["per_region"]) == 2
        assert set(phase["rounds_skipped"].values()) == {0}
        assert math.isfinite(phase["loss_first"]) and math.isfinite(phase["loss_last"])
        for node, payload in phase["bytes_per_rank"].items():
            # the WAN device carried the round payload and more (framing, TCP/IP, heartbeats)
            assert 0 < payload < phase["wire_bytes_per_rank"][node], node
    # S-SGD, quiet stretch at lr 0: every rank of every region bit-identical
    assert many["identical"] is True and one["identical"] is True and out["identical"] is True
    # each local rank carries half of what a one-rank region sends (the same rounds, half the elements)
    assert abs(out["bytes_per_rank_ratio"] - 0.5) <= 0.05, out["bytes_per_rank_ratio"]
    assert out["goodput_ratio"] > 0 and out["wire_goodput_ratio"] > 0
