"""`bench chaos`'s daemons as processes: start, SIGKILL, SIGSTOP/SIGCONT, restart with ``--join``, sample RSS,
follow their logs.

Every daemon is a real `dreamp2p node` process (``python -P -m dreamp2p.cli node``), started through
:func:`dreamp2p.devtools.localrun.start_node`, inside a network namespace when the run has them. Records
are read incrementally from each member's ``metrics.jsonl`` (only whole lines: a daemon may be writing).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dreamp2p.devtools.localrun import log_tail, start_node, stop_nodes

log = logging.getLogger(__name__)

# the record kinds the bench reads; the others (eval, link, checkpoint) are skipped while reading
KINDS = frozenset({"start", "step", "peer", "join", "stop"})


class RecordTail:
    """Each member's metrics.jsonl records of the kinds in :data:`KINDS`, read on as the files grow."""

    def __init__(self, run_dir: Path, members: list[str]) -> None:
        self.run_dir = run_dir
        self.records: dict[str, list[dict[str, Any]]] = {m: [] for m in members}
        self.start_t: dict[str, float] = dict.fromkeys(members, 0.0)  # t of the newest START record
        self.stepped: dict[str, bool] = dict.fromkeys(members, False)  # a STEP record since that START
        self.last_step: dict[str, int] = dict.fromkeys(members, -1)
        self.live: dict[str, int] = dict.fromkeys(members, 0)  # members alive in the newest PEER record
        self._offset: dict[str, int] = dict.fromkeys(members, 0)
        self._inode: dict[str, int] = dict.fromkeys(members, -1)

    def poll(self) -> None:
        for member in self.records:
            path = self.run_dir / member / "metrics.jsonl"
            try:
                inode = path.stat().st_ino
            except FileNotFoundError:
                continue
            if inode != self._inode[member]:
                # a daemon that rotates its log renamed the part we were reading to metrics.jsonl.1
                older = path.with_name("metrics.jsonl.1")
                if self._inode[member] >= 0 and older.exists() and older.stat().st_ino == self._inode[member]:
                    self._read(member, older)
                self._inode[member], self._offset[member] = inode, 0
            self._read(member, path)

    def _read(self, member: str, path: Path) -> None:
        try:
            with open(path, "rb") as fh:
                fh.seek(self._offset[member])
                data = fh.read()
        except FileNotFoundError:
            return
        end = data.rfind(b"\n") + 1  # a line still being written waits for the next poll
        self._offset[member] += end
        for line in data[:end].splitlines():
            self._take(member, line)

    def _take(self, member: str, line: bytes) -> None:
        try:
            rec = json.loads(line)
        except ValueError:
            return
        if not isinstance(rec, dict) or rec.get("kind") not in KINDS:
            return
        self.records[member].append(rec)
        kind = rec["kind"]
        if kind == "start":
            self.start_t[member] = float(rec["t"])
            self.stepped[member] = False
            self.live[member] = 0
        elif kind == "step":
            self.stepped[member] = True
            self.last_step[member] = int(rec["step"])
        elif kind == "peer":
            self.live[member] = len(rec.get("live", ()))


@dataclass
class Sample:
    pid: int
    samples: list[tuple[float, int]] = field(default_factory=list)  # (wall time, RSS bytes)


def rss_bytes(pid: int) -> int | None:
    """The resident set size of process ``pid`` (/proc), None once it is gone."""
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    return None


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (/proc's children lists, all its threads'), nearest first; [] once gone."""
    out: list[int] = []
    todo = [pid]
    while todo:
        parent = todo.pop(0)
        try:
            tids = os.listdir(f"/proc/{parent}/task")
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
        for tid in tids:
            try:
                with open(f"/proc/{parent}/task/{tid}/children") as fh:
                    kids = [int(x) for x in fh.read().split()]
            except (FileNotFoundError, ProcessLookupError, PermissionError):
                continue
            for kid in kids:
                if kid not in out:
                    out.append(kid)
                    todo.append(kid)
    return out


class Cluster:
    """The run's daemons: one process per member at a time, the ones we killed, and RSS per process."""

    def __init__(
        self,
        configs: dict[str, Path],
        run_dir: Path,
        stop_file: Path,
        quiet_steps: int,
        netns: dict[str, str | None],
    ) -> None:
        self.configs = configs
        self.run_dir = run_dir
        self.stop_file = stop_file
        self.quiet_steps = quiet_steps
        self.netns = netns
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.started_at: dict[str, float] = {}  # wall time each member's current process was started
        self.killed: set[int] = set()  # pids this bench killed
        self.rss: dict[int, Sample] = {}  # per process
        self.lives: dict[str, list[int]] = {m: [] for m in configs}  # pids of each member, in order
        self.frozen: dict[str, list[int]] = {}  # members SIGSTOPped now -> the pids stopped

    def start(self, member: str, join: bool = False) -> None:
        self.started_at[member] = time.time()
        p = start_node(
            self.configs[member],
            stop_at_file=self.stop_file,
            join=join,
            quiet_steps=self.quiet_steps,
            netns=self.netns[member],
        )
        self.procs[member] = p
        self.lives[member].append(p.pid)
        self.rss[p.pid] = Sample(p.pid)
        log.info("started %s (pid %d%s)", member, p.pid, ", --join" if join else "")

    def kill(self, member: str) -> float:
        """SIGKILL the member's daemon; the wall time of the kill."""
        p = self.procs[member]
        t = time.time()
        self.killed.add(p.pid)
        os.kill(p.pid, signal.SIGKILL)
        p.wait(30)
        log.info("killed %s (pid %d)", member, p.pid)
        return t

    def freeze(self, member: str) -> float:
        """SIGSTOP the member's daemon and any process it started; the wall time of the stop."""
        p = self.procs[member]
        t = time.time()
        os.kill(p.pid, signal.SIGSTOP)
        kids = descendants(p.pid)
        for kid in kids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(kid, signal.SIGSTOP)
        self.frozen[member] = [p.pid, *kids]
        log.info("froze %s (pid %d%s)", member, p.pid, f" and {len(kids)} below it" if kids else "")
        return t

    def thaw(self, member: str) -> float:
        """SIGCONT what :meth:`freeze` stopped (children first); the wall time of the SIGCONT."""
        pids = self.frozen.pop(member, [])
        t = time.time()
        for pid in reversed(pids):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        log.info("thawed %s", member)
        return t

    def thaw_all(self) -> None:
        for member in list(self.frozen):
            self.thaw(member)

    def alive(self, member: str) -> bool:
        p = self.procs.get(member)
        return p is not None and p.poll() is None

    def training(self, tail: RecordTail) -> set[str]:
        """Members whose current daemon is running and has logged a step since it started."""
        return {
            m
            for m in self.procs
            # the newest START record must be this process's (same wall clock, written after its start)
            if self.alive(m) and tail.stepped[m] and tail.start_t[m] >= self.started_at[m]
        }

    def crashed(self) -> dict[str, int]:
        """Members whose current daemon exited without being killed by us: name -> exit code."""
        out = {}
        for m, p in self.procs.items():
            code = p.poll()
            if code is not None and p.pid not in self.killed:
                out[m] = code
        return out

    def note_crash(self, member: str) -> None:
        """Remember a crash once (it is not asked about again) and log the end of the daemon's log."""
        p = self.procs[member]
        self.killed.add(p.pid)
        log.warning("%s exited by itself with code %s; last lines:\n%s", member, p.returncode, self.tail(member))

    def tail(self, member: str) -> str:
        return log_tail(self.run_dir / f"{member}.log", lines=15)

    def sample_rss(self) -> None:
        now = time.time()
        for m in self.procs:
            if self.alive(m):
                rss = rss_bytes(self.procs[m].pid)
                if rss is not None:
                    self.rss[self.procs[m].pid].samples.append((now, rss))

    def stop_all(self) -> None:
        self.thaw_all()  # a stopped daemon would sit on its SIGTERM until the grace ran out
        stop_nodes(self.procs, grace_s=5.0)
