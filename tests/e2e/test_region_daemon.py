"""`torchrun --nproc-per-node 2 -m dreamp2p node --config region.toml`: two regions of two daemons each (issue 11)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from dreamp2p.devtools.localrun import child_env, dump_toml, read_records
from dreamp2p.devtools.regionjob import free_port_block

TORCHRUN = Path(sys.executable).parent / "torchrun"
TASK = {"steps": 12, "batch": 4, "context": 16, "dim": 32, "layers": 1, "heads": 2, "eval_every": 6}
TASK["max_corpus_bytes"] = 1 << 18


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_two_torchrun_regions_of_daemons_train_one_replica(tmp_path: Path) -> None:
    base = free_port_block(8)  # two regions of two ranks: peers, then metrics (each rank: the region's + k)
    ring = [{"node_id": r, "address": f"127.0.0.1:{base + 2 * i}"} for i, r in enumerate(("a", "b"))]
    procs: dict[str, subprocess.Popen[bytes]] = {}
    for i, region in enumerate(("a", "b")):
        tables: dict[str, dict[str, Any]] = {
            "node": {"node_id": region, "cluster_id": "regions", "listen": ring[i]["address"], "ring": ring},
            "sync": {"strategy": "ssgd"},
            "task": TASK,
            "checkpoint": {"dir": str(tmp_path / region / "checkpoints"), "every_steps": 100, "keep": 1},
            "metrics": {"run_dir": str(tmp_path), "log_every": 1, "listen": f"127.0.0.1:{base + 4 + 2 * i}"},
        }
        config = tmp_path / f"{region}.toml"
        config.write_text(dump_toml(tables, {"device": "cpu", "threads": 1}))
        cmd = [
            str(TORCHRUN),
            "--standalone",
            "--nproc-per-node",
            "2",
            "-m",
            "dreamp2p",
            "node",
            "--config",
            str(config),
        ]
        with (tmp_path / f"{region}.log").open("wb") as log:
            procs[region] = subprocess.Popen(cmd, env=child_env(), stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 480  # a hang guard
    try:
        for region, proc in procs.items():
            code = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            assert code == 0, f"region {region} exited {code}:\n{(tmp_path / f'{region}.log').read_text()[-4000:]}"
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    stops = {}
    for node in ("a", "a.1", "b", "b.1"):  # each rank its own peer, metrics and run log
        records = read_records(tmp_path, node)
        stops[node] = [r for r in records if r["kind"] == "stop"][-1]
        assert stops[node]["step"] == TASK["steps"]
        assert (tmp_path / node[0] / "checkpoints" / node).is_dir()  # each rank its own copy
    # S-SGD with DDP inside each region: every rank of every region holds the same parameters
    assert len({s["digest"] for s in stops.values()}) == 1
