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

``make_report`` writes ``loss_vs_time.png``, ``link_bandwidth.png``, ``schedule_gantt.png`` (when some node has a
plan) and ``summary.json``. Plots are drawn with matplotlib's Agg backend on ``Figure`` objects (no pyplot state),
and matplotlib is imported only when a plot is drawn.

The package reads the logs (`runlog.py`), summarizes them (`summary.py`) and draws the curves
(`curves.py`) and the schedule's Gantt chart (`gantt.py`) with shared helpers (`draw.py`); `make_report`
(here) writes the folder.
"""

from __future__ import annotations

import json
import logging
import math
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
    "_harmonic_mean",
    "load_run",
    "make_report",
    "plot_gantt",
    "plot_links",
    "plot_loss",
    "running_mean",
    "summarize",
    "summary_table",
]

log = logging.getLogger(__name__)


def make_report(run_dir: str | Path, out_dir: str | Path | None = None) -> list[Path]:
    """Write the report folder of a run (default ``RUN/report``); returns the paths written.

    Always ``loss_vs_time.png``, ``link_bandwidth.png`` and ``summary.json``; ``schedule_gantt.png`` from the
    plan.json with the highest plan version, when some node has one (a stale gantt from an earlier report is
    removed otherwise). A plan that cannot be drawn is logged and skipped. Raises ValueError for an empty run.
    """
    run = Path(run_dir)
    logs = load_run(run)
    out = run / "report" if out_dir is None else Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = [plot_loss(logs, out), plot_links(logs, out)]
    plan_info: dict[str, Any] | None = None
    newest = newest_plan(logs)
    gantt = out / GANTT_PNG
    if newest is not None:
        node_id, plan_json = newest
        try:
            written.append(plot_gantt(plan_json, out))
            plan, costs, link = plan_inputs(plan_json)
            wait = math.fsum(it.exposed_s for it in simulate(plan, costs, link))
            plan_info = {
                "node": node_id,
                "version": plan.version,
                "period": plan.period,
                "layers": len(plan.layer_names),
                "syncs": len(plan.syncs),
                "compute_s": plan.compute_s,
                "predicted_exposed_s_per_period": wait,
            }
        except ValueError as exc:
            log.warning("plan.json of node %s cannot be drawn, no gantt chart: %s", node_id, exc)
    if plan_info is None and gantt.exists():
        gantt.unlink()
        log.info("removed stale %s (no drawable plan in this run)", gantt)
    t0, t1 = run_start(logs), run_end(logs)
    summary = {
        "run_dir": str(run),
        "start_t": t0,
        "duration_s": t1 - t0,
        "smooth_window": SMOOTH_WINDOW,
        "nodes": summarize(logs),
        "plan": plan_info,
    }
    path = out / SUMMARY_JSON
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(summary, indent=2, allow_nan=False) + "\n", encoding="utf-8")
    tmp.replace(path)
    written.append(path)
    return written
