"""A library training loop gets the daemon's SIGTERM, checkpoint and resume handling through
:class:`~dreamp2p.service.lifecycle.Checkpointer` (issue 13, deliver 4): a real SIGTERM to a process running
the loop (tests/e2e/libloop.py), which drains, saves and exits 0; a second process resumes from that step,
scheduler included, and ends where an uninterrupted run ends."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from dreamp2p.service.checkpoint import checkpoint_step, list_checkpoints

LOOP = Path(__file__).with_name("libloop.py")


def start(tmp: Path, name: str, ckpt: Path, steps: int, sleep: float = 0.0) -> tuple[subprocess.Popen[bytes], Path]:
    out = tmp / f"{name}.json"
    cmd = [sys.executable, str(LOOP), "--dir", str(ckpt), "--steps", str(steps), "--every", "5"]
    cmd += ["--out", str(out), "--progress", str(tmp / f"{name}.progress"), "--sleep", str(sleep)]
    return subprocess.Popen(cmd, stderr=(tmp / f"{name}.log").open("wb")), out


def finished(proc: subprocess.Popen[bytes], out: Path, tmp: Path, name: str) -> dict[str, Any]:
    rc = proc.wait(120)
    assert rc == 0, (tmp / f"{name}.log").read_text()[-3000:]
    result: dict[str, Any] = json.loads(out.read_text())
    return result


@pytest.mark.timeout(300)
def test_sigterm_saves_and_exits_0_and_a_resume_continues_from_that_step(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    proc, out = start(tmp_path, "first", ckpt, steps=1_000_000, sleep=0.02)
    progress = tmp_path / "first.progress"
    # a training loop well under way (pytest's timeout is the hang guard)
    while not (progress.exists() and progress.read_text() and int(progress.read_text()) >= 7):
        assert proc.poll() is None, (tmp_path / "first.log").read_text()[-3000:]
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    first = finished(proc, out, tmp_path, "first")
    stopped = first["step"]
    assert first["signal"] == "SIGTERM"
    assert 7 <= stopped < 1_000_000
    assert first["start"] == 0 and first["resumed_from"] is None
    # the periodic checkpoints and the final one, of exactly the step it stopped after
    steps = [checkpoint_step(p) for p in list_checkpoints(ckpt)]
    assert steps[-1] == stopped and Path(first["checkpoint"]).name == f"ckpt-{stopped:010d}.pt"
    assert 5 in steps or len(steps) == 3  # every 5 steps, 3 kept

    resumed, out2 = start(tmp_path, "second", ckpt, steps=stopped + 6)
    second = finished(resumed, out2, tmp_path, "second")
    assert second["start"] == stopped
    assert second["resumed_from"] == first["checkpoint"]
    assert second["step"] == stopped + 6 and second["signal"] is None
    # the scheduler came back: the rate at the resume is the one it had reached, not a fresh schedule's
    assert second["lr_at_start"] == pytest.approx(0.1 / (1 + stopped))
    assert second["last_epoch"] == stopped + 6
    assert second["lr"] == pytest.approx(0.1 / (1 + stopped + 6))

    # and the model is where one uninterrupted run of as many steps leaves it
    straight, out3 = start(tmp_path, "straight", tmp_path / "other", steps=stopped + 6)
    assert finished(straight, out3, tmp_path, "straight")["digest"] == second["digest"]
