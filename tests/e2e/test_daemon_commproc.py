"""Node daemons with ``[node] comm = "process"``: the peer of each runs in a comm process of its own."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from dreamp2p.config import DaemonConfig
from dreamp2p.devtools.localrun import last_step, read_records, start_node, wait_exits, wait_progress, write_configs

SYNC = {"strategy": "dreamddp", "period": 4, "warmup_steps": 2, "control_every": 5, "max_delay": 1}
TASK = {"steps": 30, "batch": 8, "context": 32, "dim": 64, "layers": 1, "heads": 2, "max_corpus_bytes": 1 << 20}


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_daemons_train_with_comm_processes(tmp_path: Path) -> None:
    configs = write_configs(tmp_path, 2, rate_Bps=20e6, delay_s=0.002, sync=SYNC, task=TASK, checkpoint_every=10)
    for path in configs:
        text = path.read_text()
        assert text.count("[node]\n") == 1
        path.write_text(text.replace("[node]\n", '[node]\ncomm = "process"\n'))
        assert DaemonConfig.from_toml(path).node.comm == "process"
    names = ("eu-west", "us-east")
    procs = [start_node(c) for c in configs]
    try:
        children = [comm_child(p) for p in procs]
        assert all(children), children  # each daemon ran its peer in a child process
        wait_exits(dict(zip(names, procs, strict=True)), tmp_path, 240)  # exit code 0 each, else NodeExited
        for n in names:
            assert last_step(tmp_path, n) == TASK["steps"] - 1
            assert not [r for r in read_records(tmp_path, n) if r["kind"] == "join"]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
    assert not [pid for pid in children if pid is not None and alive(pid)]  # the daemons reaped them


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_sigterm_to_daemon_and_comm_process_stops_in_order(tmp_path: Path) -> None:
    """As systemd or a terminal signal the whole process group: the daemons still checkpoint and exit 0."""
    task = {**TASK, "steps": 100_000}
    configs = write_configs(tmp_path, 2, rate_Bps=20e6, delay_s=0.002, sync=SYNC, task=task, checkpoint_every=1000)
    for path in configs:
        path.write_text(path.read_text().replace("[node]\n", '[node]\ncomm = "process"\n'))
    names = ("eu-west", "us-east")
    procs = [start_node(c) for c in configs]
    try:
        children = [comm_child(p) for p in procs]
        assert all(children), children
        running = dict(zip(names, procs, strict=True))
        wait_progress(lambda: min(last_step(tmp_path, n) for n in names) >= 8, running, tmp_path)
        for daemon, child in zip(procs, children, strict=True):
            assert child is not None
            os.kill(child, signal.SIGTERM)  # the comm process first, as a group signal may deliver it
            daemon.terminate()
        wait_exits(running, tmp_path, 120)  # exit code 0 each, else NodeExited with the log's tail
        for n in names:
            stops = [r for r in read_records(tmp_path, n) if r["kind"] == "stop"]
            assert len(stops) == 1 and stops[0]["signal"] == "SIGTERM" and stops[0]["checkpoint"]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
    assert not [pid for pid in children if pid is not None and alive(pid)]


def comm_child(daemon: subprocess.Popen[bytes]) -> int | None:
    """The pid of ``daemon``'s comm process, once it has one; None if the daemon exits first."""
    while daemon.poll() is None:
        out = subprocess.run(
            ["pgrep", "-P", str(daemon.pid), "-f", "dreamp2p.sync.comm.child"], capture_output=True, check=False
        )
        if out.stdout.split():
            return int(out.stdout.split()[0])
        time.sleep(0.1)
    return None


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
