"""Several node daemons on one machine: loopback configs, daemon processes, and following their logs.

Used by `dreamp2p demo` and by the end-to-end tests: real `dreamp2p node` processes, real sockets on
127.0.0.1, WAN links emulated in process (rate limit + one-way delay per hop).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

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
) -> list[Path]:
    """One TOML per node, all on 127.0.0.1, sharing a ring; returns their paths."""
    if not 1 <= nodes <= len(NAMES):
        raise ValueError(f"nodes must be in 1..{len(NAMES)}, got {nodes}")
    run_dir.mkdir(parents=True, exist_ok=True)
    ports = free_ports(2 * nodes)
    names = NAMES[:nodes]
    ring = [{"node_id": n, "address": f"127.0.0.1:{ports[i]}"} for i, n in enumerate(names)]
    transport: dict[str, Any] = {"delay_s": delay_s, "probe_interval_s": 2.0, "round_timeout_s": 120.0}
    if rate_Bps:
        transport["rate_limit"] = rate_Bps
    paths = []
    for i, name in enumerate(names):
        node: dict[str, Any] = {"node_id": name, "cluster_id": "local-demo", "listen": ring[i]["address"], "ring": ring}
        if token:
            node["token"] = token
        tables = {
            "node": node,
            "node.transport": transport,
            "sync": sync,
            "task": task,
            "checkpoint": {"dir": str(run_dir / name / "checkpoints"), "every_steps": checkpoint_every, "keep": 2},
            "metrics": {"run_dir": str(run_dir), **({"listen": f"127.0.0.1:{ports[nodes + i]}"} if metrics else {})},
        }
        path = run_dir / f"{name}.toml"
        path.write_text(dump_toml(tables, {"device": device, "threads": threads}))
        paths.append(path)
    return paths


def start_node(
    config: Path, resume: bool = False, log_dir: Path | None = None, stop_at_file: Path | None = None
) -> subprocess.Popen[bytes]:
    args = [sys.executable, "-m", "dreamp2p.cli", "node", "--config", str(config)]
    if resume:
        args.append("--resume")
    if stop_at_file is not None:
        args += ["--stop-at-file", str(stop_at_file)]
    log_dir = log_dir or config.parent
    out = open(log_dir / f"{config.stem}.log", "ab")  # noqa: SIM115 - handed to the child process
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env=env)


def read_records(run_dir: Path, node: str) -> list[dict[str, Any]]:
    path = run_dir / node / "metrics.jsonl"
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line being written right now
    return out


def last_step(run_dir: Path, node: str) -> int:
    steps = [r["step"] for r in read_records(run_dir, node) if r.get("kind") == "step"]
    return max(steps) if steps else -1


def wait_until(pred: Any, timeout: float, interval: float = 0.2) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(interval)
    return bool(pred())
