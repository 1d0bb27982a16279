"""`bench chaos`'s freezes: `Cluster.freeze` SIGSTOPs a daemon and every process below it, `thaw` resumes them."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from dreamp2p.devtools.bench.chaos.proc import Cluster, descendants

PARENT = (
    "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
    "time.sleep(60)"
)


def state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as fh:
        return fh.read().rsplit(")", 1)[1].split()[0]


def test_freeze_stops_the_daemon_and_its_children_and_thaw_resumes_them(tmp_path: Path) -> None:
    p = subprocess.Popen([sys.executable, "-c", PARENT])
    try:
        deadline = time.time() + 20
        while not (kids := descendants(p.pid)) and time.time() < deadline:
            time.sleep(0.05)
        assert len(kids) == 1
        while {state(p.pid), state(kids[0])} != {"S"} and time.time() < deadline:
            time.sleep(0.05)  # both asleep: a SIGSTOP lands at once (not after a disk wait, "D")
        cluster = Cluster({"a": tmp_path / "a.toml"}, tmp_path, tmp_path / "stop_at", 0, {"a": None})
        cluster.procs["a"] = p  # type: ignore[assignment]
        cluster.freeze("a")
        assert cluster.frozen == {"a": [p.pid, *kids]}
        while {state(p.pid), state(kids[0])} != {"T"} and time.time() < deadline:
            time.sleep(0.05)
        assert {state(p.pid), state(kids[0])} == {"T"}
        cluster.thaw_all()
        time.sleep(0.2)
        assert "T" not in {state(p.pid), state(kids[0])} and cluster.frozen == {}
    finally:
        for pid in descendants(p.pid):
            subprocess.run(["kill", "-9", str(pid)], check=False)
        p.kill()
        p.wait(10)


def test_descendants_of_a_gone_process_is_empty() -> None:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait(10)
    assert descendants(p.pid) == []
