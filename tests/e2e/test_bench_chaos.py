"""`dreamp2p bench chaos --json` end to end, scaled down: real daemons killed, rejoined, then equal digests."""

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
    "kill_log",
}


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_bench_chaos_kills_rejoins_and_ends_with_equal_digests(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    args = ["--minutes", "0.5", "--kill-every", "6", "--down", "1", "3", "--flap-every", "20", "--flap-down", "4"]
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
    assert report["nodes"] == 5 and report["max_down"] == 2
    assert report["kills"] >= 1 and report["restarts"] >= 1 and report["rejoins"] >= 1
    assert report["crashes"] == []
    assert report["kills_survived"] == report["kills"]
    assert report["recovery_s"]["n"] == report["kills"] and report["recovery_s"]["max"] is not None
    assert report["steps_per_s"]["fault_free"] > 0 and report["steps_per_s"]["chaos"] > 0
    assert report["goodput"] is not None and report["goodput"] > 0
    assert "eu-west" in report["rss"]["per_daemon"]  # the protected member lived through the chaos
    assert report["flaps"]["on"] is (os.geteuid() == 0)
    if report["flaps"]["on"]:
        assert report["flaps"]["count"] == 1  # 30 s of chaos hold one flap, 10 s in
    else:
        assert "root" in report["flaps"]["why_off"]
    # every member stopped after the same step, the last ones at learning rate 0: identical parameters
    assert report["stop_steps"] == [report["final_step"]]
    assert set(report["stop_codes"].values()) == {0}
    assert report["digests_equal"] is True, report["digests"]
    assert len(set(report["digests"].values())) == 1
    # the daemons' own records back the figures: a --join start for every rejoin
    starts = []
    for name in report["digests"]:
        for line in (run_dir / name / "metrics.jsonl").read_text().splitlines():
            rec = json.loads(line)
            if rec["kind"] == "start":
                starts.append(rec["join"])
    assert sum(starts) == report["restarts"]
