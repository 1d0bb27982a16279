"""`torchrun --nproc-per-node 2 -m dreamp2p node --config region.toml`: two regions of two daemons each (issue 11).

They train one replica, each region writes one checkpoint (local rank 0's), and restarted with ``--resume``
every rank of a region resumes from that checkpoint (rank 0 agrees with the other region and shares it).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import port_range

from dreamp2p.devtools.localrun import child_env, dump_toml, read_records, wait_exits
from dreamp2p.devtools.regionjob import free_port_block

TORCHRUN = Path(sys.executable).parent / "torchrun"
TASK = {"steps": 12, "batch": 4, "context": 16, "dim": 32, "layers": 1, "heads": 2, "eval_every": 6}
TASK["max_corpus_bytes"] = 1 << 18
RANKS = ("a", "a.1", "b", "b.1")


def run_regions(tmp_path: Path, base: int, steps: int, *flags: str) -> None:
    """Both regions (torchrun, two daemons each) trained to ``steps``; fails unless every torchrun exits 0."""
    ring = [{"node_id": r, "address": f"127.0.0.1:{base + 2 * i}"} for i, r in enumerate(("a", "b"))]
    procs: dict[str, subprocess.Popen[bytes]] = {}
    for i, region in enumerate(("a", "b")):
        tables: dict[str, dict[str, Any]] = {
            "node": {"node_id": region, "cluster_id": "regions", "listen": ring[i]["address"], "ring": ring},
            "sync": {"strategy": "ssgd"},
            "task": {**TASK, "steps": steps},
            "checkpoint": {"dir": str(tmp_path / region / "checkpoints"), "every_steps": 100, "keep": 2},
            "metrics": {"run_dir": str(tmp_path), "log_every": 1, "listen": f"127.0.0.1:{base + 4 + 2 * i}"},
        }
        config = tmp_path / f"{region}.toml"
        config.write_text(dump_toml(tables, {"device": "cpu", "threads": 1}))
        cmd = [str(TORCHRUN), "--standalone", "--nproc-per-node", "2", "-m", "dreamp2p", "node"]
        cmd += ["--config", str(config), *flags]
        with (tmp_path / f"{region}.log").open("ab") as log:
            procs[region] = subprocess.Popen(cmd, env=child_env(), stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_exits(procs, tmp_path, None)  # no limit of its own: pytest's timeout is the hang guard
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def records(tmp_path: Path, node: str, kind: str) -> list[dict[str, Any]]:
    return [r for r in read_records(tmp_path, node) if r["kind"] == kind]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_two_torchrun_regions_of_daemons_train_one_replica_and_resume_from_one_checkpoint_each(
    tmp_path: Path,
) -> None:
    # two regions of two ranks: peers, then metrics (each rank: the region's + k)
    base = free_port_block(8, *port_range())
    run_regions(tmp_path, base, TASK["steps"])
    stops = {node: records(tmp_path, node, "stop")[-1] for node in RANKS}  # each rank its own run log
    assert {s["step"] for s in stops.values()} == {TASK["steps"]}
    # S-SGD with DDP inside each region: every rank of every region holds the same parameters
    assert len({s["digest"] for s in stops.values()}) == 1
    for region in ("a", "b"):  # one checkpoint per region, written by local rank 0 only
        folder = tmp_path / region / "checkpoints"
        assert sorted(p.name for p in folder.iterdir()) == [f"ckpt-{TASK['steps']:010d}.pt"]
        assert stops[f"{region}.1"]["checkpoint"] == stops[region]["checkpoint"]

    # the whole cluster restarts with --resume: rank 0 of each region agrees over ring 0 and shares its file
    run_regions(tmp_path, base, TASK["steps"] + 6, "--resume")
    for node in RANKS:
        (resumed,) = records(tmp_path, node, "resume")
        assert resumed["step"] == TASK["steps"]
        assert resumed["digest"] == stops[node]["digest"]  # the checkpoint held exactly what was trained
        assert resumed["path"] == stops[node[0]]["checkpoint"]  # the region's one file
    finals = {node: records(tmp_path, node, "stop")[-1] for node in RANKS}
    assert {s["step"] for s in finals.values()} == {TASK["steps"] + 6}
    assert len({s["digest"] for s in finals.values()}) == 1
