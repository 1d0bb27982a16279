"""A node daemon whose checkpoint disk is full (a small tmpfs, root only): it logs one warning line per
checkpoint that does not fit (the cause, the size needed, the free space, the checkpoint kept), leaves no
partial file, trains on to its last step and exits 0; with ``[checkpoint] on_write_error = "stop"`` it
stops at the first checkpoint that does not fit, exit 1, the error naming the cause.

A first run writes the checkpoint of step 10 on a roomy tmpfs; the tmpfs is then shrunk to leave half a
checkpoint free, and the node is started again with ``--resume``, as the operator in the report did.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import pytest
from conftest import resize_tmpfs, small_tmpfs

from dreamp2p.devtools.localrun import child_env, dump_toml, python_command, write_configs

TASK = {"batch": 4, "context": 32, "dim": 32, "layers": 1, "heads": 2, "eval_every": 100, "max_corpus_bytes": 1 << 18}
SYNC = {"strategy": "localsgd", "period": 4}
MiB = 1 << 20


def node_config(tmp_path: Path, disk: Path, steps: int, **checkpoint: Any) -> Path:
    """One node's file (a ring of one) checkpointing every 10 steps into ``disk``."""
    (config,) = write_configs(
        tmp_path, 1, rate_Bps=None, delay_s=0.0, sync=SYNC, task={**TASK, "steps": steps}, metrics=False
    )
    data = tomllib.loads(config.read_text())
    data["checkpoint"].update({"dir": str(disk), "every_steps": 10, **checkpoint})
    top = {k: v for k, v in data.items() if not isinstance(v, dict)}
    node = data.pop("node")
    tables = {"node": {k: v for k, v in node.items() if k != "transport"}, "node.transport": node["transport"]}
    tables.update({k: v for k, v in data.items() if isinstance(v, dict)})
    config.write_text(dump_toml(tables, top))
    return config


def run_node(config: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        python_command("-m", "dreamp2p.cli", "node", "--config", str(config), *flags),
        capture_output=True,
        text=True,
        timeout=400,
        env=child_env(),
        check=False,
    )


def failure_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if " WARNING " in line and "not written to" in line]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_full_checkpoint_disk_is_a_warning_and_the_node_trains_on(tmp_path: Path) -> None:
    with small_tmpfs(tmp_path / "disk", 16 * MiB) as disk:
        first = run_node(node_config(tmp_path, disk, 10))
        assert first.returncode == 0, first.stderr[-4000:]
        kept = disk / "ckpt-0000000010.pt"
        size = kept.stat().st_size
        resize_tmpfs(disk, shutil.disk_usage(disk).used + size // 2)  # the disk fills up meanwhile

        out = run_node(node_config(tmp_path, disk, 30), "--resume")
        assert out.returncode == 0, out.stderr[-4000:]
        assert "Traceback" not in out.stderr and "unexpected pos" not in out.stderr
        lines = failure_lines(out.stderr)
        assert len(lines) == 2, out.stderr[-4000:]  # steps 20 and 30 (the stop's), one line each
        at_20, at_30 = (line.split(" dreamp2p.service.lifecycle: ", 1)[1] for line in lines)
        assert at_20.startswith(f"checkpoint of step 20 not written to {disk}: No space left on device (ENOSPC)")
        assert f"previous checkpoint {kept} is kept" in at_20 and "training on, next try at step 30" in at_20
        assert "bytes free" in at_20 and "the state's tensors" in at_20
        assert at_30.startswith("checkpoint of step 30 not written") and "stopping without it" in at_30
        assert "stopped at step 30" in out.stderr  # it trained to the end
        summary = json.loads(out.stdout.strip().splitlines()[-1])
        assert summary["step"] == 30 and summary["checkpoint"] == str(kept)  # what a resume finds
        assert sorted(p.name for p in disk.iterdir()) == [kept.name]  # no partial file left behind

        stop = run_node(node_config(tmp_path, disk, 30, on_write_error="stop"), "--resume")
        assert stop.returncode == 1, stop.stderr[-4000:]
        assert "checkpoint of step 20 not written" in stop.stderr and "(ENOSPC)" in stop.stderr
        assert failure_lines(stop.stderr) == []  # an error that ends the node, not a warning
        assert sorted(p.name for p in disk.iterdir()) == [kept.name]
