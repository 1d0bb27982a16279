"""`dreamp2p bench probe` on one point of its grid: namespaces the test creates, joined by the packet emulator.

The link estimate a long path leaves after sync-sized streams was 2.9 times the path's rate before the meter's
samples were checked against each stream's acknowledged delivery (buffers took the bytes at once).
"""

from __future__ import annotations

import math
import os

import pytest

from dreamp2p.devtools.bench.probe import bench_probe

pytestmark = [
    pytest.mark.netns,
    pytest.mark.timeout(240),
    pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root"),
]


def test_a_long_path_estimate_is_not_the_speed_its_buffers_took_bytes_at() -> None:
    out = bench_probe(rates=("20mbit",), rtts=("100ms",), losses=(0.0,), bursts=1, syncs=4, sync_kb=2048)
    (point,) = out["points"]
    assert (point["rate"], point["rtt"], point["loss"], out["of"]) == ("20mbit", "100ms", 0.0, 1)
    assert len(point["bursts_MBps"]) == 1 and all(math.isfinite(r) and r > 0 for r in point["bursts_MBps"])
    assert 90 < point["min_rtt_ms"] < 200
    # the streams' own delivery, acknowledged, is under the path's rate; the estimate stays within twice it
    assert 0 < point["syncs_MBps"] <= point["shaped_MBps"]
    assert point["after_syncs_MBps"] < 2 * point["shaped_MBps"], point
