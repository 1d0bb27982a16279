"""`dreamp2p report RUN_DIR [--out DIR]` on small generated run folders (issue 35).

The node logs are written by the daemons' own writer (`NodeMetrics`), laid out as each producer lays them
out: the demo (every node with steps, evals, link measurements and a DreamDDP plan, beside the nodes' TOML
files and logs), a daemon's ``[metrics] run_dir`` (one node, a strategy without a plan), and
`bench chaos --run-dir` (five daemons restarted with --join, no link measured, no plan). A plot whose inputs
are missing is skipped and named in the summary; a folder without node logs is a one-line error.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from dreamp2p.cli import main
from dreamp2p.devtools import report
from dreamp2p.schedule.cost import LayerCost, LinkModel
from dreamp2p.schedule.dreamddp import plan_dreamddp
from dreamp2p.service.metrics import NodeMetrics, RecordKind

pytest.importorskip("matplotlib")

ALL_PLOTS = [report.LOSS_PNG, report.LINK_PNG, report.GANTT_PNG]


def _plan_json(version: int) -> dict[str, Any]:
    costs = [LayerCost(f"layer{i}", 0.004, 0.008, 1_000_000) for i in range(4)]
    link = LinkModel(2.5e6, 0.08, 3)
    return {
        "plan": plan_dreamddp(costs, link, 4, version=version).to_dict(),
        "costs": [dataclasses.asdict(c) for c in costs],
        "link": {"bandwidth_Bps": link.bandwidth_Bps, "rtt_s": link.rtt_s, "world": link.world, "codec_ratio": 1.0},
    }


def _node(
    run: Path, name: str, peers: list[str], *, evals: bool, links: bool, plan: int | None, joins: int = 0
) -> None:
    """One daemon's run log as `run_node` writes it: lifecycle, steps, evals, peer status (and links), stop."""
    metrics = NodeMetrics(name, run)
    metrics.record(RecordKind.START, step=0, digest="d0", nodes=len(peers) + 1)
    for step in range(30):
        if joins and step == 15:
            metrics.record(RecordKind.JOIN, step=step, digest="d1", resumed=False)
        metrics.record(RecordKind.STEP, step=step, loss=4.0 - step / 10, tokens_per_s=1000.0, bytes_sent=100)
        if evals and step % 10 == 9:
            metrics.record(RecordKind.EVAL, step=step, eval_loss=4.0 - step / 12)
        if step % 5 == 0:
            metrics.record(RecordKind.PEER, rounds_completed=step, rounds_failed=0, live=peers, view_id=1)
            for peer in peers if links else []:
                metrics.record(RecordKind.LINK, peer=peer, goodput_Bps=2.4e6, rtt_s=0.08)
    metrics.record(RecordKind.STOP, step=30, digest="d2")
    if plan is not None:
        metrics.write_json(report.PLAN_FILE, _plan_json(plan))
    metrics.close()


def _demo_folder(tmp_path: Path) -> Path:
    run = tmp_path / "demo-20260101-000000"
    names = ["eu-west", "us-east", "ap-south"]
    for k, name in enumerate(names):
        _node(run, name, [n for n in names if n != name], evals=True, links=True, plan=k + 1)
        (run / f"{name}.toml").write_text("[node]\n")
        (run / f"{name}.log").write_text("a node's log lines\n")
        (run / name / "checkpoints").mkdir()
    (run / "stop_at").write_text("40\n")
    return run


def _summary(out: Path) -> dict[str, Any]:
    summary: dict[str, Any] = json.loads((out / report.SUMMARY_JSON).read_text())
    return summary


def test_report_of_a_demo_folder_draws_every_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = _demo_folder(tmp_path)
    assert main(["report", str(run)]) == 0
    printed = capsys.readouterr().out
    out = run / "report"
    summary = _summary(out)
    assert summary["plots"] == ALL_PLOTS and summary["skipped_plots"] == {}
    assert sorted(summary["nodes"]) == ["ap-south", "eu-west", "us-east"]  # checkpoints/, *.toml, *.log: not nodes
    assert summary["nodes"]["eu-west"]["steps"] == 30 and summary["nodes"]["eu-west"]["evals"] == 3
    assert summary["plan"]["node"] == "ap-south" and summary["plan"]["version"] == 3
    for name in ALL_PLOTS:
        assert (out / name).read_bytes()[:4] == b"\x89PNG"
        assert str(out / name) in printed
    assert "skipped" not in printed and "us-east" in printed


def test_report_of_a_daemons_run_dir_skips_the_gantt_chart(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "runs"  # [metrics] run_dir = "runs": the daemon writes runs/<node_id>/
    _node(run, "eu-west", ["us-east"], evals=True, links=True, plan=None)
    out = tmp_path / "elsewhere"
    assert main(["report", str(run), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    summary = _summary(out)
    assert summary["plots"] == [report.LOSS_PNG, report.LINK_PNG]
    assert list(summary["skipped_plots"]) == [report.GANTT_PNG]
    assert "only DreamDDP writes one" in summary["skipped_plots"][report.GANTT_PNG]
    assert f"skipped {report.GANTT_PNG}: no node has a readable plan.json" in printed
    assert summary["plan"] is None and not (out / report.GANTT_PNG).exists()
    assert not (run / "report").exists()  # --out was taken


def test_report_of_one_nodes_own_folder(tmp_path: Path) -> None:
    run = tmp_path / "runs"
    _node(run, "eu-west", ["us-east"], evals=False, links=True, plan=2)
    assert main(["report", str(run / "eu-west")]) == 0
    summary = _summary(run / "eu-west" / "report")
    assert list(summary["nodes"]) == ["eu-west"] and summary["nodes"]["eu-west"]["evals"] == 0
    assert summary["plots"] == ALL_PLOTS


def test_report_of_a_bench_chaos_run_dir(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "chaos"
    names = [f"n{k}" for k in range(5)]
    for k, name in enumerate(names):
        _node(run, name, [n for n in names if n != name], evals=False, links=False, plan=None, joins=k % 2)
    (run / "report").mkdir(parents=True)
    (run / "report" / report.LINK_PNG).write_bytes(b"an earlier report's plot")
    assert main(["report", str(run)]) == 0
    printed = capsys.readouterr().out
    summary = _summary(run / "report")
    assert summary["plots"] == [report.LOSS_PNG]
    assert set(summary["skipped_plots"]) == {report.LINK_PNG, report.GANTT_PNG}
    assert "no link measurement" in summary["skipped_plots"][report.LINK_PNG]
    assert not (run / "report" / report.LINK_PNG).exists()  # a plot this run cannot draw is not left behind
    assert sorted(summary["nodes"]) == names and all(s["steps"] == 30 for s in summary["nodes"].values())
    assert f"skipped {report.LINK_PNG}" in printed


def test_a_node_with_lifecycle_records_only_skips_every_plot(tmp_path: Path) -> None:
    metrics = NodeMetrics("fresh", tmp_path / "run")
    metrics.record(RecordKind.START, step=0, digest="d0", nodes=2)
    metrics.close()
    written = report.write_report(tmp_path / "run")
    assert [p.name for p in written.written] == [report.SUMMARY_JSON]
    assert list(written.skipped) == ALL_PLOTS


@pytest.mark.parametrize("layout", ["empty", "not-logs", "missing"])
def test_a_folder_without_node_logs_is_a_one_line_error(tmp_path: Path, layout: str) -> None:
    run = tmp_path / "run"
    if layout != "missing":
        run.mkdir()
    if layout == "not-logs":
        (run / "checkpoints").mkdir()
        (run / "eu-west.log").write_text("only a log\n")
    proc = subprocess.run(
        [sys.executable, "-m", "dreamp2p", "report", str(run)], capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    expected = "does not exist" if layout == "missing" else "no node logs in"
    assert lines[0].startswith("dreamp2p: error: ") and expected in lines[0]
    assert proc.stdout == ""


def test_the_demo_prints_its_report_through_the_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from dreamp2p.devtools.demo import _report

    run = _demo_folder(tmp_path)
    assert _report(run, ["eu-west", "us-east", "ap-south"], time.monotonic()) == 0  # every eval loss fell
    printed = capsys.readouterr().out
    assert f"  {run / 'report' / report.GANTT_PNG}" in printed and "eu-west: eval loss" in printed
    assert _summary(run / "report")["plots"] == ALL_PLOTS
