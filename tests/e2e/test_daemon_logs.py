"""The node daemon's own log: INFO progress lines and lifecycle events by default, JSON records on request.

One daemon (a ring of one) trains a few dozen steps of a small byte LM. In text mode every step writes a
progress line (``progress_every_s = 0``) and the lifecycle events appear in order. In JSON mode a task
that raises at a known step shows that every record is one JSON object carrying the node and cluster id,
and that the error is logged with its traceback before the process exits 1.
"""

from __future__ import annotations

import json
import os
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import pytest

from dreamp2p.devtools.localrun import child_env, dump_toml, python_command, write_configs

TASK = {"batch": 4, "context": 32, "dim": 32, "layers": 1, "heads": 2, "eval_every": 10, "max_corpus_bytes": 1 << 18}
SYNC = {"strategy": "dreamddp", "period": 4, "warmup_steps": 2, "control_every": 5, "max_delay": 1}
FAIL_AT = 12
FAILING_TASK = f"""
from dreamp2p.service.tasks import BytesLM


class FailingLM(BytesLM):
    def batch(self, step):
        if step == {FAIL_AT}:
            raise RuntimeError("injected failure at step {FAIL_AT}")
        return super().batch(step)


def make(cfg, rank, world, device):
    return FailingLM(cfg, rank, world, device)
"""


def node_config(tmp_path: Path, steps: int, **task: Any) -> Path:
    """One node's file, with a progress line at every step."""
    (config,) = write_configs(
        tmp_path, 1, rate_Bps=None, delay_s=0.0, sync=SYNC, task={**TASK, "steps": steps, **task}, metrics=False
    )
    data = tomllib.loads(config.read_text())
    data["metrics"]["progress_every_s"] = 0.0
    data["checkpoint"]["every_steps"] = 20
    top = {k: v for k, v in data.items() if not isinstance(v, dict)}
    node = data.pop("node")
    tables = {"node": {k: v for k, v in node.items() if k != "transport"}, "node.transport": node["transport"]}
    tables.update({k: v for k, v in data.items() if isinstance(v, dict)})
    config.write_text(dump_toml(tables, top))
    return config


def run_node(config: Path, *flags: str, pythonpath: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = child_env()
    if pythonpath is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(pythonpath), *filter(None, [env.get("PYTHONPATH")])])
    return subprocess.run(
        python_command("-m", "dreamp2p.cli", "node", "--config", str(config), *flags),
        capture_output=True,
        text=True,
        timeout=400,
        env=env,
        check=False,
    )


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_text_log_has_a_progress_line_per_step_and_the_lifecycle(tmp_path: Path) -> None:
    steps = 30
    out = run_node(node_config(tmp_path, steps))
    assert out.returncode == 0, out.stderr[-4000:]
    lines = out.stderr.splitlines()
    progress = [line for line in lines if " INFO [eu-west] dreamp2p.service.progresslog: step " in line]
    assert len(progress) == steps, "\n".join(lines[-40:])  # INFO without -v, one line per step here
    assert progress[-1].split(": ", 1)[1].startswith(f"step {steps}/{steps} loss ")
    for word in ("tok/s", "hidden", "Mbit/s", "plan v", "ETA"):
        assert word in progress[-1]
    events = [
        "node started on cpu",
        "checkpoint at step 20",
        f"draining rounds in flight at step {steps}",
        f"stopped at step {steps}",
    ]
    positions = [next((i for i, line in enumerate(lines) if e in line), -1) for e in events]
    assert -1 not in positions and positions == sorted(positions), (positions, "\n".join(lines[-40:]))


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_json_log_records_parse_and_carry_the_error_with_its_traceback(tmp_path: Path) -> None:
    (tmp_path / "failing_task.py").write_text(FAILING_TASK)
    config = node_config(tmp_path, 40, entry="failing_task:make")
    out = run_node(config, "--log-format", "json", pythonpath=tmp_path)
    assert out.returncode == 1, out.stderr[-4000:]
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    records = [json.loads(line) for line in lines]  # every line of the node's log is one JSON object
    assert all(r["node_id"] == "eu-west" and r["cluster_id"] == "local-demo" for r in records)
    progress = [r for r in records if r.get("event") == "progress"]
    assert [r["step"] for r in progress] == list(range(1, FAIL_AT + 1))
    assert all(r["level"] == "INFO" and r["final_step"] == 40 and "loss" in r for r in progress)
    start = next(r for r in records if r.get("event") == "start")
    assert start["level"] == "INFO" and start["params"] > 0 and "node started on cpu" in start["message"]
    (error,) = [r for r in records if r["level"] == "ERROR"]
    assert error["event"] == "error" and f"injected failure at step {FAIL_AT}" in error["message"]
    assert "Traceback (most recent call last)" in error["exc_info"]
    assert f"RuntimeError: injected failure at step {FAIL_AT}" in error["exc_info"]
    assert "failing_task.py" in error["exc_info"]  # where it was raised


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_a_comm_process_logs_json_like_its_node(tmp_path: Path) -> None:
    """With ``[node] comm = "process"`` the peer runs in a child process: its records are JSON objects with
    the node's ids too, not plain lines in the middle of the node's JSON log (issue 35, item 5)."""
    config = node_config(tmp_path, 10)
    text = config.read_text().replace("[node]\n", '[node]\ncomm = "process"\n', 1)
    assert 'comm = "process"' in text
    config.write_text(text)
    out = run_node(config, "--log-format", "json")
    assert out.returncode == 0, out.stderr[-4000:]
    records = [json.loads(line) for line in out.stderr.splitlines() if line.strip()]
    assert all(r["node_id"] == "eu-west" and r["cluster_id"] == "local-demo" for r in records)
    # the child's peer announces its port: a record of the comm process, in the node's format
    assert any(r["logger"] == "dreamp2p.peer.peer" and "listening on port" in r["message"] for r in records)
