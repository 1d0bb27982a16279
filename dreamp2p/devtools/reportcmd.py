"""`dreamp2p report RUN_DIR [--out DIR]`: the report folder of a run (plots and summary), printed as the demo does.

RUN_DIR is any folder with node logs: the demo's, `bench chaos --run-dir`'s, a daemon's ``[metrics] run_dir``
(one sub-directory per node), or one node's own sub-directory. The console script finds the subcommand
through the ``dreamp2p.commands`` entry points (pyproject.toml); the demo prints its report with `show_report`.
Importing this module is cheap: the report (and matplotlib) load only when it runs.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dreamp2p.devtools.report import Report


def show_report(run_dir: Path, out: Path | None = None) -> Report:
    """Write the run's report folder, then print the summary table, the plots skipped and why, the files."""
    from dreamp2p.devtools.report import summary_table, write_report

    report = write_report(run_dir, out)
    print(summary_table(report.logs))
    for name, why in report.skipped.items():
        print(f"skipped {name}: {why}")
    print("report:")
    for path in report.written:
        print(f"  {path}")
    return report


def _report(args: argparse.Namespace) -> int:
    show_report(args.run_dir, args.out)
    return 0


def add_report_parser(sub: Any) -> None:
    r = sub.add_parser(
        "report",
        help="plots (loss, link bandwidth, the schedule's Gantt chart) and a summary of a run's node logs",
        description="Write the report folder of a run: loss_vs_time.png, link_bandwidth.png, schedule_gantt.png "
        "(each when the logs hold its inputs) and summary.json, then print the summary.",
    )
    r.add_argument(
        "run_dir",
        type=Path,
        metavar="RUN_DIR",
        help="a folder with node logs: one sub-directory per node holding metrics.jsonl / plan.json (the demo's, "
        "bench chaos --run-dir, a daemon's [metrics] run_dir), or one node's sub-directory",
    )
    r.add_argument("--out", type=Path, default=None, help="where to write the report (default RUN_DIR/report)")
    r.set_defaults(func=_report)
