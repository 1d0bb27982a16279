"""Several node daemons on one machine: loopback configs, daemon processes, and following their logs.

Used by `dreamp2p demo` and by the end-to-end tests: real `dreamp2p node` processes, real sockets on
127.0.0.1, WAN links emulated in process (rate limit + one-way delay per hop).

Daemons run as ``python -P -m dreamp2p.cli``: ``-P`` keeps the working directory off ``sys.path``, so a
``dreamp2p/`` folder where the user happens to stand cannot shadow the package (see :func:`child_env` for
running from a source checkout that is not installed).
"""

from __future__ import annotations

import json
import logging
import os
import re
import site
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import dreamp2p
from dreamp2p.service.jsonl import jsonl_parts
from dreamp2p.service.metrics import METRICS_FILE, RecordKind

log = logging.getLogger(__name__)

NAMES = ["eu-west", "us-east", "ap-south", "sa-east", "af-south", "me-central", "ca-central", "au-east"]


def free_ports(n: int) -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def metrics_port(run_dir: Path, name: str) -> int:
    """The port node ``name`` serves its metrics on, as its log under ``run_dir`` says (its latest start)."""
    found = re.findall(r"metrics on \S+ \(port (\d+)\)", (run_dir / f"{name}.log").read_text(errors="replace"))
    if not found:
        raise RuntimeError(f"{name} has not logged its metrics port in {run_dir / f'{name}.log'}")
    return int(found[-1])


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{k} = {_toml(v)}" for k, v in value.items()) + " }"
    raise TypeError(f"cannot write {type(value).__name__} to TOML")


def dump_toml(tables: dict[str, dict[str, Any]], top: dict[str, Any] | None = None) -> str:
    lines = [f"{k} = {_toml(v)}" for k, v in (top or {}).items()]
    for name, table in tables.items():
        lines.append(f"\n[{name}]")
        lines += [f"{k} = {_toml(v)}" for k, v in table.items()]
    return "\n".join(lines) + "\n"


def write_configs(
    run_dir: Path,
    nodes: int,
    *,
    rate_Bps: float | None,
    delay_s: float,
    sync: dict[str, Any],
    task: dict[str, Any],
    checkpoint_every: int = 100,
    metrics: bool = True,
    threads: int = 1,
    token: str | None = "local-demo-token",
    device: str = "cpu",
    hosts: list[str] | None = None,
    log_every: int = 1,
    train: dict[str, Any] | None = None,
) -> list[Path]:
    """One TOML per node sharing a ring, on 127.0.0.1 or on ``hosts`` (an address per node); their paths.

    ``train``: the ``[train]`` table, if any (e.g. ``{"min_step_s": 0.05}``: daemons that share a host).

    With ``hosts`` (addresses inside network namespaces) clear text is allowed on the ring.
    """
    if not 1 <= nodes <= len(NAMES):
        raise ValueError(f"nodes must be in 1..{len(NAMES)}, got {nodes}")
    run_dir.mkdir(parents=True, exist_ok=True)
    ports = free_ports(nodes)
    names = NAMES[:nodes]
    ring = [{"node_id": n, "address": f"{(hosts or ['127.0.0.1'] * nodes)[i]}:{ports[i]}"} for i, n in enumerate(names)]
    transport: dict[str, Any] = {"delay_s": delay_s, "probe_interval_s": 2.0, "round_timeout_s": 120.0}
    if rate_Bps:
        transport["rate_limit"] = rate_Bps
    paths = []
    for i, name in enumerate(names):
        node: dict[str, Any] = {"node_id": name, "cluster_id": "local-demo", "listen": ring[i]["address"], "ring": ring}
        if token:
            node["token"] = token
        if hosts:
            node["allow_insecure"] = True
        tables = {
            "node": node,
            "node.transport": transport,
            "sync": sync,
            "task": task,
            **({"train": train} if train else {}),
            "checkpoint": {"dir": str(run_dir / name / "checkpoints"), "every_steps": checkpoint_every, "keep": 2},
            "metrics": {
                "run_dir": str(run_dir),
                "log_every": log_every,
                # port 0: the daemon binds a free port and logs it (``metrics_port``); a fixed one, picked here
                # and bound later, can be taken meanwhile (a restart runs minutes after the pick)
                **({"listen": "127.0.0.1:0"} if metrics else {}),
            },
        }
        path = run_dir / f"{name}.toml"
        path.write_text(dump_toml(tables, {"device": device, "threads": threads}))
        paths.append(path)
    return paths


def python_command(*args: str) -> list[str]:
    """This interpreter with ``-P`` (the child's working directory is never on ``sys.path``), then ``args``."""
    return [sys.executable, "-P", *args]


def child_env(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """Environment for a child Python (run with ``-P``) that must import the same ``dreamp2p`` as this process.

    Installed packages (site-packages, editable installs) need nothing. When this process found the package
    through a plain ``sys.path`` entry instead (run from a source checkout, where that entry is the working
    directory), ``-P`` would drop it, so that folder goes first on the child's ``PYTHONPATH``.
    """
    env = dict(os.environ if base is None else base)
    env["PYTHONUNBUFFERED"] = "1"
    root = Path(dreamp2p.__file__).resolve().parent.parent
    on_path = {Path(entry or os.getcwd()).resolve() for entry in sys.path}
    site_dirs = {Path(d).resolve() for d in [*site.getsitepackages(), site.getusersitepackages()]}
    if root in on_path and root not in site_dirs:
        env["PYTHONPATH"] = os.pathsep.join([str(root), *filter(None, [env.get("PYTHONPATH")])])
    return env


def node_log(config: Path, log_dir: Path | None = None) -> Path:
    """Where :func:`start_node` writes the daemon's stdout and stderr."""
    return (log_dir or config.parent) / f"{config.stem}.log"


def start_node(
    config: Path,
    resume: bool = False,
    log_dir: Path | None = None,
    stop_at_file: Path | None = None,
    *,
    join: bool = False,
    quiet_steps: int = 0,
    netns: str | None = None,
) -> subprocess.Popen[bytes]:
    """Start ``dreamp2p node`` on ``config`` (its flags as named), in network namespace ``netns`` if given.

    ``ip netns exec`` replaces itself with the daemon, so the process returned is the daemon's either way.
    """
    args = python_command("-m", "dreamp2p.cli", "node", "--config", str(config))
    if resume:
        args.append("--resume")
    if join:
        args.append("--join")
    if stop_at_file is not None:
        args += ["--stop-at-file", str(stop_at_file)]
    if quiet_steps:
        args += ["--quiet-steps", str(quiet_steps)]
    if netns is not None:
        args = ["ip", "netns", "exec", netns, *args]
    out = open(node_log(config, log_dir), "ab")  # noqa: SIM115 - handed to the child process
    try:
        return subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env=child_env())
    finally:
        out.close()  # the child holds its own copy


class NodeExited(RuntimeError):
    """A node daemon exited when it should have been running; names it, its exit code and its log's tail."""

    def __init__(self, node: str, code: int, log_path: Path, tail: str, when: str, others: dict[str, int]) -> None:
        self.node = node
        self.code = code
        self.log_path = log_path
        self.tail = tail
        self.others = others  # further nodes found exited at the same check: name -> exit code
        also = "; also exited: " + ", ".join(f"{n} (code {c})" for n, c in others.items()) if others else ""
        shown = f"last lines of {log_path}:\n{tail}" if tail else f"{log_path} is empty"
        super().__init__(f"node {node} exited with code {code} {when}{also}; {shown}")


def log_tail(path: Path, lines: int = 20, max_bytes: int = 64 << 10) -> str:
    """The last ``lines`` lines of a log file (empty if it does not exist)."""
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            fh.seek(max(0, fh.tell() - max_bytes))
            data = fh.read()
    except FileNotFoundError:
        return ""
    return "\n".join(data.decode("utf-8", "replace").rstrip().splitlines()[-lines:])


def check_nodes(procs: Mapping[str, subprocess.Popen[bytes]], log_dir: Path, *, clean_exit_ok: bool, when: str) -> None:
    """Raise :class:`NodeExited` if a node has exited (with a non-zero code, or at all unless ``clean_exit_ok``).

    Logs are expected where :func:`start_node` puts them by default: ``log_dir/<node>.log``.
    """
    exited = {
        name: code for name, p in procs.items() if (code := p.poll()) is not None and not (clean_exit_ok and code == 0)
    }
    if exited:
        name, code = next(iter(exited.items()))
        del exited[name]
        path = log_dir / f"{name}.log"
        raise NodeExited(name, code, path, log_tail(path), when, exited)


def wait_exits(
    procs: Mapping[str, subprocess.Popen[bytes]],
    log_dir: Path,
    timeout: float | None,
    *,
    when: str = "on its way out",
) -> None:
    """Wait up to ``timeout`` s in all (None: no limit of its own) for every node to exit; :class:`NodeExited`
    (with its log's tail) unless 0.

    Raises ``subprocess.TimeoutExpired`` for a node still running at the deadline.
    """
    deadline = None if timeout is None else time.monotonic() + timeout
    for p in procs.values():
        p.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
    check_nodes(procs, log_dir, clean_exit_ok=True, when=when)


def stop_nodes(procs: Mapping[str, subprocess.Popen[bytes]], grace_s: float = 10.0) -> dict[str, int]:
    """SIGTERM every node still running, SIGKILL those not gone after ``grace_s``; their exit codes."""
    for p in procs.values():
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + grace_s
    for name, p in procs.items():
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.warning("node %s did not stop within %.0f s of SIGTERM; killing it", name, grace_s)
            p.kill()
            p.wait()
    return {name: int(p.returncode) for name, p in procs.items()}


def wait_started(
    procs: Mapping[str, subprocess.Popen[bytes]],
    run_dir: Path,
    timeout: float,
    *,
    interval: float = 0.2,
    progress: Callable[[], None] | None = None,
    progress_every: float = 10.0,
) -> None:
    """Wait until every node has logged its first training step to ``run_dir/<node>/metrics.jsonl``.

    A node that exits meanwhile (with any code: none was asked to stop) raises :class:`NodeExited` at the
    next poll, ``interval`` seconds at most; ``timeout`` passing first raises TimeoutError naming the nodes
    still starting. ``progress`` is called every ``progress_every`` seconds while waiting.
    """
    start = time.monotonic()
    next_progress = start + progress_every
    waiting = list(procs)
    while True:
        check_nodes(procs, run_dir, clean_exit_ok=False, when="before it started training")
        waiting = [n for n in waiting if last_step(run_dir, n) < 0]
        if not waiting:
            return
        now = time.monotonic()
        if now - start >= timeout:
            raise TimeoutError(
                f"node(s) {', '.join(waiting)} did not start training within {timeout:g} s; "
                f"see {', '.join(str(run_dir / f'{n}.log') for n in waiting)}"
            )
        if progress is not None and now >= next_progress:
            progress()
            next_progress = now + progress_every
        time.sleep(interval)


def read_records(run_dir: Path, node: str) -> list[dict[str, Any]]:
    """A node's run-log records, oldest first (the rotated parts of ``metrics.jsonl`` before it)."""
    out = []
    for path in jsonl_parts(run_dir / node / METRICS_FILE):
        try:
            text = path.read_text()
        except FileNotFoundError:
            continue  # rotated away while we read
        for line in text.splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # a line being written right now
    return out


def last_step(run_dir: Path, node: str) -> int:
    steps = [r["step"] for r in read_records(run_dir, node) if r.get("kind") == RecordKind.STEP]
    return max(steps) if steps else -1


def wait_progress(
    pred: Callable[[], bool], procs: Mapping[str, subprocess.Popen[bytes]], log_dir: Path, interval: float = 0.2
) -> None:
    """Wait until ``pred()`` holds while the nodes in ``procs`` run; :class:`NodeExited` as soon as one exits.

    No time limit of its own: progress is judged by the nodes' records, a dead node fails at once, and a
    hang is left to the caller's overall timeout (in tests, pytest-timeout).
    """
    while not pred():
        check_nodes(procs, log_dir, clean_exit_ok=False, when="while the others waited for progress")
        time.sleep(interval)
