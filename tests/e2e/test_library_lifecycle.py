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

from dreamp2p.devtools.localrun import free_ports
from dreamp2p.service.checkpoint import checkpoint_step, list_checkpoints

LOOP = Path(__file__).with_name("libloop.py")


def start(
    tmp: Path, name: str, ckpt: Path, steps: int, sleep: float = 0.0, extra: list[str] | None = None
) -> tuple[subprocess.Popen[bytes], Path]:
    out = tmp / f"{name}.json"
    cmd = [sys.executable, str(LOOP), "--dir", str(ckpt), "--steps", str(steps), "--every", "5", *(extra or [])]
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
    progressed(tmp_path, "first", proc, 7)  # a training loop well under way
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


def progressed(tmp: Path, name: str, proc: subprocess.Popen[bytes], step: int) -> None:
    """Wait until ``name`` has finished ``step`` steps (pytest's timeout is the hang guard)."""
    progress = tmp / f"{name}.progress"
    while not (progress.exists() and int(progress.read_text() or "0") >= step):
        assert proc.poll() is None, (tmp / f"{name}.log").read_text()[-3000:]
        time.sleep(0.05)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("rolling", [False, True])
def test_two_members_stopped_by_sigterm_resume_together(tmp_path: Path, rolling: bool) -> None:
    """SIGTERM to both members of a ring, at once (as an orchestrator stops a cluster) or one after the other
    (``rolling``: p0 trains on alone for a while). Each saves the step it stopped after (a member whose last
    round lost its peer abandons that step) and exits 0. Restarted, they agree where to resume: the newest
    checkpoint's holder resumes, the other joins it by state transfer (both resume when they stopped at the
    same step); both end on the same step with the same parameters and learning-rate schedule."""
    ports = free_ports(2)
    ring = ",".join(f"p{i}=127.0.0.1:{port}" for i, port in enumerate(ports))

    def run(phase: str, steps: int, sleep: float) -> list[tuple[subprocess.Popen[bytes], Path]]:
        out = []
        for i in range(2):
            name = f"{phase}{i}"
            extra = ["--node-id", f"p{i}", "--ring", ring]
            out.append(start(tmp_path, name, tmp_path / f"ckpt{i}", steps, sleep, extra))
        return out

    procs = run("first", 1_000_000, 0.02)
    for i, (proc, _) in enumerate(procs):
        progressed(tmp_path, f"first{i}", proc, 7)
    if rolling:
        procs[1][0].send_signal(signal.SIGTERM)
        one = finished(*procs[1], tmp_path, "first1")
        progressed(tmp_path, "first0", procs[0][0], one["step"] + 3)
    for proc, _ in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    first = [finished(proc, out, tmp_path, f"first{i}") for i, (proc, out) in enumerate(procs)]
    stopped = [r["step"] for r in first]
    assert all(r["signal"] == "SIGTERM" for r in first)
    if rolling:
        assert stopped[0] > stopped[1]
    for i, r in enumerate(first):
        assert checkpoint_step(list_checkpoints(tmp_path / f"ckpt{i}")[-1]) == r["step"]

    total = max(stopped) + 6 + (max(stopped) % 2)  # even: the last step ends a period, so both just averaged
    procs = run("second", total, 0.0)
    second = [finished(proc, out, tmp_path, f"second{i}") for i, (proc, out) in enumerate(procs)]
    newest = max(stopped)
    if rolling:
        assert second[1]["joined"]
    for i, r in enumerate(second):
        if stopped[i] == newest:
            assert r["resumed_from"] is not None and r["start"] == newest and not r["joined"]
        else:  # its own checkpoint is older than the other's: it takes the state from the member instead
            assert r["resumed_from"] is None and r["joined"] and r["start"] > newest
    assert [r["step"] for r in second] == [total, total]
    assert second[0]["digest"] == second[1]["digest"]
    assert [r["last_epoch"] for r in second] == [total, total]
    assert second[0]["lr"] == pytest.approx(second[1]["lr"])
