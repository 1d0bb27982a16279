"""`dreamp2p bench chaos --json` end to end, scaled down: real daemons killed and rejoined, frozen and thawed,
cut off (as root) and healed, then equal digests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

KEYS = {
    "kills",
    "kills_survived",
    "restarts",
    "rejoins",
    "crashes",
    "recovery_s",
    "longest_step_gap_s",
    "rounds_failed",
    "rounds_completed",
    "baseline_rounds_failed",
    "steps_per_s",
    "goodput",
    "rss",
    "flaps",
    "quiet_steps",
    "final_step",
    "stop_steps",
    "digests_equal",
    "digests",
    "flushes",
    "kill_log",
    "kinds",
    "faults",
    "fault_log",
    "partitions",
    "distinct_digests",
}


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_bench_chaos_injects_every_kind_and_ends_with_equal_digests(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    args = ["--minutes", "0.5", "--kill-every", "5", "--down", "1", "3", "--flap-every", "20", "--flap-down", "4"]
    # short freezes and partitions, no long freeze: 30 s of chaos hold one fault of each kind (the kinds come
    # as from a shuffled deck, every kind once in the first three faults)
    args += ["--stop-min", "1", "--stop-max", "3", "--long-stop-p", "0", "--partition-min", "2", "--partition-max", "4"]
    # five daemons on a machine that runs other tests beside this one: a small model and a floor on each step
    # (ten a second), not a core each
    args += ["--width", "32", "--depth", "1", "--min-step", "0.1"]
    out = subprocess.run(
        [sys.executable, "-m", "dreamp2p.cli", "bench", "chaos", "--json", *args, "--run-dir", str(run_dir)],
        capture_output=True,
        text=True,
        timeout=1100,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert set(report) >= KEYS, sorted(KEYS - set(report))
    assert report["nodes"] == 5 and report["max_down"] == 2 and report["min_step_s"] == 0.1
    assert report["kills"] >= 1 and report["restarts"] >= 1 and report["rejoins"] >= 1
    assert report["crashes"] == []
    assert report["kills_survived"] == report["kills"]
    assert report["recovery_s"]["n"] == report["kills"] and report["recovery_s"]["max"] is not None
    assert report["steps_per_s"]["fault_free"] > 0 and report["steps_per_s"]["chaos"] > 0
    assert report["goodput"] is not None and report["goodput"] > 0
    assert "eu-west" in report["rss"]["per_daemon"]  # the protected member lived through the chaos
    root = os.geteuid() == 0
    assert report["flaps"]["on"] is root and report["partitions"]["on"] is root
    if root:
        assert report["flaps"]["count"] == 1  # 30 s of chaos hold one flap, 10 s in
    else:
        assert "root" in report["flaps"]["why_off"] and "root" in report["partitions"]["why_off"]
    kinds = ["kill", "partition", "stop"] if root else ["kill", "stop"]
    assert sorted(report["kinds"]) == kinds and sorted(report["faults"]) == kinds, report["faults"]
    faults = report["faults"]
    assert all(faults[k]["count"] >= 1 for k in kinds), faults
    assert all(faults[k]["recovered"] == faults[k]["count"] for k in kinds), faults
    assert all(faults[k]["recovery_s"]["p99"] is not None for k in kinds), faults
    assert faults["kill"]["count"] == report["kills"], faults
    # every freeze and partition ended with the ring whole again in every member's view (the heal waits for it)
    assert all(faults[k]["one_ring_again"] == faults[k]["count"] for k in kinds if k != "kill"), faults
    made = sorted({f["kind"] for f in report["fault_log"]})
    assert made == kinds, report["fault_log"]
    assert all(f["end"] is not None for f in report["fault_log"]), report["fault_log"]
    # every member stopped after the same step, the last ones at learning rate 0: identical parameters
    assert report["stop_steps"] == [report["final_step"]]
    assert set(report["stop_codes"].values()) == {0}
    assert report["digests_equal"] is True, report["digests"]
    assert len(set(report["digests"].values())) == 1 and report["distinct_digests"] == 1
    # the end-of-run flush went through DreamDDP's compressed path: every member's outer weights agreed
    assert set(report["flushes"].values()) == {"compressed"}, report["flushes"]
    # the daemons' own records back the figures: a --join start for every rejoin
    starts = []
    for name in report["digests"]:
        for line in (run_dir / name / "metrics.jsonl").read_text().splitlines():
            rec = json.loads(line)
            if rec["kind"] == "start":
                starts.append(rec["join"])
    assert sum(starts) == report["restarts"]
