"""Report folder for a training run: PNG plots and a summary, read from the nodes' metric logs.

A run directory holds one sub-directory per node, written by the node daemons::

    RUN/<node_id>/metrics.jsonl   one JSON object per line, appended over time, by "kind":
        step  t, step, loss [, tokens_per_s, exposed_s, comm_s, hidden_fraction, bytes_sent, plan_version]
        eval  t, step, eval_loss
        link  t, peer, goodput_Bps, rtt_s
    RUN/<node_id>/plan.json       {"plan": Plan.to_dict(), "costs": [LayerCost fields...], "link": {LinkModel fields}}

``t`` is unix seconds. ``bytes_sent`` of a step record counts the bytes sent during that step, so a node's total
is their sum. Lines that are not JSON objects, records lacking a field their kind needs (or holding one of the
wrong type) and records of unknown kinds are skipped with one warning per file: a daemon may be appending a line
while the report is read.

``write_report`` (``make_report``: its paths) writes ``loss_vs_time.png``, ``link_bandwidth.png`` and
``schedule_gantt.png``, each when its inputs are in the logs (a plot without them is skipped and named, with
the reason, in the summary), and ``summary.json``; `dreamp2p report RUN_DIR` runs it (`devtools/reportcmd.py`).
Plots are drawn with matplotlib's Agg backend on ``Figure`` objects (no pyplot state), and matplotlib is
imported only when a plot is drawn.

The package reads the logs (`runlog.py`), summarizes them (`summary.py`) and draws the curves
(`curves.py`) and the schedule's Gantt chart (`gantt.py`) with shared helpers (`draw.py`); `write_report`
(here) writes the folder.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dreamp2p.devtools.report.curves import plot_links, plot_loss
from dreamp2p.devtools.report.gantt import plan_inputs, plot_gantt
from dreamp2p.devtools.report.runlog import (
    EMPTY_RUN_MESSAGE,
    GANTT_PNG,
    LINK_PNG,
    LOSS_PNG,
    METRICS_FILE,
    PLAN_FILE,
    SUMMARY_JSON,
    NodeLog,
    load_run,
    newest_plan,
)
from dreamp2p.devtools.report.summary import (
    SMOOTH_WINDOW,
    _harmonic_mean,
    run_end,
    run_start,
    running_mean,
    summarize,
    summary_table,
)
from dreamp2p.schedule.simulate import simulate

__all__ = [
    "EMPTY_RUN_MESSAGE",
    "GANTT_PNG",
    "LINK_PNG",
    "LOSS_PNG",
    "METRICS_FILE",
    "PLAN_FILE",
    "SMOOTH_WINDOW",
    "SUMMARY_JSON",
    "NodeLog",
    "Report",
    "_harmonic_mean",
    "load_run",
    "make_report",
    "plot_gantt",
    "plot_links",
    "plot_loss",
    "running_mean",
    "summarize",
    "summary_table",
    "write_report",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Report:
    """What `write_report` wrote: the folder, its files, the plots it skipped (file name -> why) and the logs read."""

    out: Path
    written: list[Path]
    skipped: dict[str, str]
    logs: dict[str, NodeLog]


def make_report(run_dir: str | Path, out_dir: str | Path | None = None) -> list[Path]:
    """`write_report`'s files: the paths written."""
    return write_report(run_dir, out_dir).written


def write_report(run_dir: str | Path, out_dir: str | Path | None = None) -> Report:
    """Write the report folder of a run (default ``RUN/report``) from whatever node logs it holds.

    ``loss_vs_time.png`` when some node logged a step or eval record, ``link_bandwidth.png`` when some node
    logged a link measurement, ``schedule_gantt.png`` from the plan.json with the highest plan version when
    some node has one (DreamDDP writes it) and it can be drawn; ``summary.json`` always, naming the plots
    skipped and why. A skipped plot left by an earlier report in the same folder is removed. Raises
    ValueError for a folder without node logs.
    """
    run = Path(run_dir)
    logs = load_run(run)
    out = run / "report" if out_dir is None else Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    skipped: dict[str, str] = {}
    if any(node.steps or node.evals for node in logs.values()):
        written.append(plot_loss(logs, out))
    else:
        skipped[LOSS_PNG] = "no step or eval record in any node's metrics.jsonl"
    if any(node.links for node in logs.values()):
        written.append(plot_links(logs, out))
    else:
        skipped[LINK_PNG] = "no link measurement in any node's metrics.jsonl"
    plan_info, why = _gantt(logs, out)
    if plan_info is None:
        skipped[GANTT_PNG] = why
    else:
        written.append(out / GANTT_PNG)
    for name, reason in skipped.items():
        if (out / name).exists():
            (out / name).unlink()
            log.info("removed stale %s (%s)", out / name, reason)
    t0, t1 = run_start(logs), run_end(logs)
    summary = {
        "run_dir": str(run),
        "start_t": t0,
        "duration_s": t1 - t0,
        "smooth_window": SMOOTH_WINDOW,
        "nodes": summarize(logs),
        "plan": plan_info,
        "plots": [p.name for p in written],
        "skipped_plots": skipped,
    }
    path = out / SUMMARY_JSON
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(summary, indent=2, allow_nan=False) + "\n", encoding="utf-8")
    tmp.replace(path)
    written.append(path)
    return Report(out, written, skipped, logs)


def _gantt(logs: dict[str, NodeLog], out: Path) -> tuple[dict[str, Any] | None, str]:
    """Draw the newest plan's Gantt chart: (what the summary says of the plan, "") or (None, why not)."""
    newest = newest_plan(logs)
    if newest is None:
        return None, "no node has a readable plan.json (only DreamDDP writes one)"
    node_id, plan_json = newest
    try:
        plot_gantt(plan_json, out)
        plan, costs, link = plan_inputs(plan_json)
        wait = math.fsum(it.exposed_s for it in simulate(plan, costs, link))
    except ValueError as exc:
        log.warning("plan.json of node %s cannot be drawn, no gantt chart: %s", node_id, exc)
        return None, f"plan.json of node {node_id} cannot be drawn: {exc}"
    return {
        "node": node_id,
        "version": plan.version,
        "period": plan.period,
        "layers": len(plan.layer_names),
        "syncs": len(plan.syncs),
        "compute_s": plan.compute_s,
        "predicted_exposed_s_per_period": wait,
    }, ""
