"""Report folder of a run: parsing the nodes' metric logs, the summary, and that every plot gets written.

The run directories are synthetic: losses and other values are planted so that the summary can be checked exactly.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from dreamp2p.devtools import report
from dreamp2p.schedule.cost import LayerCost, LinkModel
from dreamp2p.schedule.dreamddp import plan_dreamddp

pytest.importorskip("matplotlib")

T0 = 1_700_000_000.0
STEPS = 300
W = report.SMOOTH_WINDOW
NODES = ("node-a", "node-b", "node-c")

# ----------------------------------------------------------------------------------------------------- helpers


def _costs(n: int = 8) -> list[LayerCost]:
    return [LayerCost(f"layer{i}", 0.004, 0.008, 1_000_000 + 50_000 * i) for i in range(n)]


def _plan_json(costs: list[LayerCost], link: LinkModel, H: int, version: int, max_delay: int = 0) -> dict[str, Any]:
    plan = plan_dreamddp(costs, link, H, version=version, max_delay=max_delay)
    return {
        "plan": plan.to_dict(),
        "costs": [dataclasses.asdict(c) for c in costs],
        "link": {
            "bandwidth_Bps": link.bandwidth_Bps,
            "rtt_s": link.rtt_s,
            "world": link.world,
            "codec_ratio": link.codec_ratio,
        },
    }


def _planted_loss(s: int, k: int) -> float:
    """4.0 + k over the first window, 1.5 + k over the last one, a noisy ramp between."""
    if s < W:
        return 4.0 + k
    if s >= STEPS - W:
        return 1.5 + k
    return 1.5 + k + 2.5 * (STEPS - W - s) / (STEPS - 2 * W) + (0.05 if s % 2 else -0.05)


def _records(k: int) -> list[dict[str, Any]]:
    recs: list[dict[str, Any]] = []
    peers = [p for p in NODES if p != NODES[k]]
    for s in range(STEPS):
        t = T0 + k * 2.0 + 0.5 * s
        recs.append(
            {
                "kind": "step",
                "t": t,
                "step": s,
                "loss": _planted_loss(s, k),
                "tokens_per_s": 1000.0 * (k + 1),
                "exposed_s": 0.01,
                "comm_s": 0.2,
                "hidden_fraction": 0.5 + 0.1 * k,
                "bytes_sent": 1000,
                "plan_version": 1,
            }
        )
        if s % 60 == 59:
            recs.append({"kind": "eval", "t": t + 0.1, "step": s, "eval_loss": 3.0 + k - s / 100})
        if s % 20 == 0:
            for j, peer in enumerate(peers):
                recs.append({"kind": "link", "t": t, "peer": peer, "goodput_Bps": 1e7 * (j + 1), "rtt_s": 0.05})
    return recs


def _write_metrics(path: Path, recs: list[dict[str, Any]], extra: Sequence[str] = ()) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps(r) for r in recs] + list(extra)
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    """Three nodes; node-a has plan v1, node-b plan v3 (the newest), node-c no plan; node-c's lines are reversed."""
    run = tmp_path / "run"
    costs, link = _costs(), LinkModel(25e6, 0.08, 3)
    for k, node in enumerate(NODES):
        recs = _records(k)
        _write_metrics(run / node / "metrics.jsonl", recs[::-1] if node == "node-c" else recs)
    for node, version in (("node-a", 1), ("node-b", 3)):
        (run / node / "plan.json").write_text(json.dumps(_plan_json(costs, link, 3, version)), encoding="utf-8")
    return run


def _is_png(path: Path) -> bool:
    return path.read_bytes()[:4] == b"\x89PNG" and path.stat().st_size > 10_000


# ------------------------------------------------------------------------------------------------------- tests


def test_make_report_writes_plots_and_summary(run_dir: Path) -> None:
    paths = report.make_report(run_dir)
    out = run_dir / "report"
    assert [p.name for p in paths] == [report.LOSS_PNG, report.LINK_PNG, report.GANTT_PNG, report.SUMMARY_JSON]
    assert all(p.parent == out and p.is_file() for p in paths)
    for p in paths[:3]:
        assert _is_png(p), p
    # the report folder is not taken for a node the next time round
    again = report.make_report(run_dir)
    assert [p.name for p in again] == [p.name for p in paths]
    assert sorted(report.load_run(run_dir)) == list(NODES)


def test_summary_values(run_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "elsewhere"
    report.make_report(run_dir, out)
    summary = json.loads((out / report.SUMMARY_JSON).read_text())
    assert summary["smooth_window"] == W
    assert summary["start_t"] == T0
    assert set(summary["nodes"]) == set(NODES)
    for k, node in enumerate(NODES):
        s = summary["nodes"][node]
        assert s["steps"] == STEPS
        assert s["last_step"] == STEPS - 1
        assert s["loss_first"] == pytest.approx(4.0 + k)
        assert s["loss_last"] == pytest.approx(1.5 + k)
        assert s["evals"] == STEPS // 60
        assert s["eval_loss_first"] == pytest.approx(3.0 + k - 0.59)
        assert s["eval_loss_last"] == pytest.approx(3.0 + k - 2.99)
        assert s["mean_tokens_per_s"] == pytest.approx(1000.0 * (k + 1))
        assert s["mean_hidden_fraction"] == pytest.approx(0.5 + 0.1 * k)
        assert s["bytes_sent"] == STEPS * 1000
    assert summary["nodes"]["node-a"]["plan_version"] == 1
    assert summary["nodes"]["node-c"]["plan_version"] is None
    plan = summary["plan"]
    assert plan["node"] == "node-b" and plan["version"] == 3 and plan["period"] == 3
    assert plan["predicted_exposed_s_per_period"] >= 0.0


def test_load_run_sorts_by_time_and_splits_kinds(run_dir: Path) -> None:
    logs = report.load_run(run_dir)
    c = logs["node-c"]  # written newest first
    assert [r["step"] for r in c.steps] == list(range(STEPS))
    assert all(a["t"] <= b["t"] for a, b in zip(c.links, c.links[1:], strict=False))
    assert len(c.evals) == STEPS // 60
    assert {r["peer"] for r in c.links} == {"node-a", "node-b"}
    assert c.plan is None and logs["node-b"].plan is not None
    assert isinstance(c.steps[0]["t"], float) and isinstance(c.steps[0]["step"], int)


def test_malformed_lines_skipped_one_warning_per_file(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    run = tmp_path / "run"
    good = _records(0)[:50]
    bad = [
        "this is not json",
        "[1, 2, 3]",
        '{"kind": "step", "t": 5.0, "loss": 1.0}',  # no step
        '{"kind": "step", "t": "soon", "step": 1, "loss": 1.0}',  # t not a number
        '{"kind": "step", "t": 5.0, "step": true, "loss": 1.0}',  # bool is not an int
        '{"kind": "step", "t": 5.0, "step": 1, "loss": 1.0, "tokens_per_s": "fast"}',
        '{"kind": "link", "t": 5.0, "peer": "", "goodput_Bps": 1.0, "rtt_s": 0.1}',
        '{"kind": "eval", "t": Infinity, "step": 1, "eval_loss": 1.0}',
        '{"kind": "mystery", "t": 5.0}',
        '{"t": 5.0}',
        '{"kind": "step", "t": 9',  # a line being appended
        "",
    ]
    _write_metrics(run / "n0" / "metrics.jsonl", good, bad)
    _write_metrics(run / "n1" / "metrics.jsonl", good, ["garbage", "more garbage"])
    _write_metrics(run / "n2" / "metrics.jsonl", good)
    with caplog.at_level(logging.WARNING, logger="dreamp2p.devtools.report"):
        logs = report.load_run(run)
    n0 = logs["n0"]
    assert len(n0.steps) == sum(r["kind"] == "step" for r in good)
    assert len(n0.links) == sum(r["kind"] == "link" for r in good)
    assert n0.evals == []
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2
    assert "n0" in warnings[0].getMessage()
    assert "9 malformed, 2 of unknown kind" in warnings[0].getMessage()
    assert "n1" in warnings[1].getMessage()
    paths = report.make_report(run)
    assert report.GANTT_PNG not in [p.name for p in paths]


def test_missing_plan_skips_gantt_and_removes_a_stale_one(run_dir: Path) -> None:
    report.make_report(run_dir)
    assert (run_dir / "report" / report.GANTT_PNG).exists()
    for node in NODES:
        (run_dir / node / "plan.json").unlink(missing_ok=True)
    paths = report.make_report(run_dir)
    assert [p.name for p in paths] == [report.LOSS_PNG, report.LINK_PNG, report.SUMMARY_JSON]
    assert not (run_dir / "report" / report.GANTT_PNG).exists()
    assert json.loads((run_dir / "report" / report.SUMMARY_JSON).read_text())["plan"] is None


def test_bad_plan_is_logged_and_skipped(run_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    plan = json.loads((run_dir / "node-b" / "plan.json").read_text())
    del plan["costs"]
    (run_dir / "node-b" / "plan.json").write_text(json.dumps(plan))
    (run_dir / "node-a" / "plan.json").write_text("{not json")
    with caplog.at_level(logging.WARNING, logger="dreamp2p.devtools.report"):
        paths = report.make_report(run_dir)
    assert report.GANTT_PNG not in [p.name for p in paths]
    assert any("cannot be drawn" in r.getMessage() for r in caplog.records)
    assert any("unreadable plan" in r.getMessage() for r in caplog.records)
    with pytest.raises(ValueError, match="lacks field 'costs'"):
        report.plot_gantt(plan, run_dir)


def test_empty_run_dir_raises(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"no node logs in .*metrics\.jsonl"):
        report.make_report(tmp_path)
    (tmp_path / "not-a-node").mkdir()
    (tmp_path / "not-a-node" / "notes.txt").write_text("hello")
    with pytest.raises(ValueError, match="no node logs"):
        report.load_run(tmp_path)
    with pytest.raises(ValueError, match="does not exist"):
        report.make_report(tmp_path / "missing")


def test_nodes_without_records_still_get_a_report(tmp_path: Path) -> None:
    run = tmp_path / "run"
    (run / "fresh").mkdir(parents=True)
    (run / "fresh" / "metrics.jsonl").write_text("")
    paths = report.make_report(run)
    assert all(_is_png(p) for p in paths if p.suffix == ".png")
    s = json.loads((run / "report" / report.SUMMARY_JSON).read_text())["nodes"]["fresh"]
    assert s["steps"] == 0 and s["loss_first"] is None and s["eval_loss_last"] is None and s["bytes_sent"] == 0
    assert "fresh" in report.summary_table(report.load_run(run))


@pytest.mark.parametrize(
    ("link", "H", "max_delay"),
    [
        (LinkModel(25e6, 0.08, 1), 3, 0),  # world 1: every comm block is empty
        (LinkModel(25e6, 0.08, 3), 12, 0),  # more iterations than layers: empty iterations
        (LinkModel(5e6, 0.08, 4, codec_ratio=0.5), 4, 3),  # delayed syncs
    ],
)
def test_plot_gantt_edge_cases(tmp_path: Path, link: LinkModel, H: int, max_delay: int) -> None:
    path = report.plot_gantt(_plan_json(_costs(6), link, H, 7, max_delay), tmp_path / "g")
    assert path == tmp_path / "g" / report.GANTT_PNG
    assert _is_png(path)
    named = report.plot_gantt(_plan_json(_costs(6), link, H, 7, max_delay), tmp_path / "x.png")
    assert named == tmp_path / "x.png" and _is_png(named)


def test_summary_table(run_dir: Path) -> None:
    table = report.summary_table(report.load_run(run_dir))
    lines = table.splitlines()
    assert lines[0].split()[:3] == ["node", "steps", "loss"]
    assert set(lines[1]) <= {"-", " "}
    assert len(lines) == 2 + len(NODES)
    assert lines[2].split()[:4] == ["node-a", str(STEPS), "4.0000", "1.5000"]
    assert "300.00 kB" in lines[2]
    # columns line up: every row has its step count ending at the same offset as the header's "steps"
    end = lines[0].index("steps") + len("steps")
    assert all(line[:end].endswith(str(STEPS)) for line in lines[2:])


def test_running_mean() -> None:
    assert report.running_mean([1.0, 2.0, 3.0, 4.0], 2) == [1.0, 1.5, 2.5, 3.5]
    out = report.running_mean([math.nan, 2.0, math.nan, 4.0], 2)
    assert math.isnan(out[0]) and out[1:] == [2.0, 2.0, 4.0]
    values = [float(i % 7) for i in range(10_000)]
    smooth = report.running_mean(values, 50)
    assert smooth[-1] == pytest.approx(sum(values[-50:]) / 50)
    with pytest.raises(ValueError):
        report.running_mean([1.0], 0)


def test_import_does_not_load_matplotlib() -> None:
    code = "import sys, dreamp2p.devtools.report; assert 'matplotlib' not in sys.modules, 'matplotlib imported eagerly'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


@pytest.mark.parametrize(
    ("rates", "want"),
    [
        ([100.0, 100.0], 100.0),
        ([1000.0, 1000.0, 1000.0, 10.0], 4 / (3 / 1000 + 1 / 10)),  # one slow step weighs its time
        ([], None),
        ([0.0, float("nan")], None),
    ],
)
def test_mean_tokens_per_second_is_tokens_over_time(rates: list[float], want: float | None) -> None:
    from dreamp2p.devtools.report import _harmonic_mean

    got = _harmonic_mean(rates)
    assert got == pytest.approx(want) if want is not None else got is None
