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
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dreamp2p.schedule.cost import LayerCost, LinkModel
from dreamp2p.schedule.dreamddp import IterationTimeline, Plan, simulate

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = [
    "EMPTY_RUN_MESSAGE",
    "GANTT_PNG",
    "LINK_PNG",
    "LOSS_PNG",
    "SMOOTH_WINDOW",
    "SUMMARY_JSON",
    "NodeLog",
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

METRICS_FILE = "metrics.jsonl"
PLAN_FILE = "plan.json"
LOSS_PNG = "loss_vs_time.png"
LINK_PNG = "link_bandwidth.png"
GANTT_PNG = "schedule_gantt.png"
SUMMARY_JSON = "summary.json"
EMPTY_RUN_MESSAGE = "no node logs in {run}: expected one sub-directory per node holding metrics.jsonl or plan.json"
# Trailing running mean over this many step records: the plotted training loss and the summary's first/last loss.
SMOOTH_WINDOW = 25

_DPI = 110
_SIZE = (10.0, 5.0)
_RC = {
    "font.size": 10,
    "axes.titlesize": 12,
    "axes.labelsize": 11,
    "legend.fontsize": 9,
    "xtick.labelsize": 9,
    "ytick.labelsize": 9,
    "figure.titlesize": 12,
}
_FWD_COLOR = "#a6cee3"
_BWD_COLOR = "#1f78b4"
_WAIT_COLOR = "#fbb4ae"
_WAIT_EDGE = "#d62728"
_SYNC_COLOR = "#ff7f0e"
_REPEAT_COLOR = "#fdd0a2"
_REPEAT_EDGE = "#d95f02"
_WINDOW_COLOR = "#1f78b4"


# ------------------------------------------------------------------------------------------------------ reading


@dataclass
class NodeLog:
    """Parsed records of one node, each list sorted by ``t``; ``plan`` is plan.json as read (None if absent)."""

    steps: list[dict[str, Any]] = field(default_factory=list)
    evals: list[dict[str, Any]] = field(default_factory=list)
    links: list[dict[str, Any]] = field(default_factory=list)
    plan: dict[str, Any] | None = None


def _is_real(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_time(value: object) -> bool:
    return _is_real(value) and math.isfinite(value)  # type: ignore[arg-type]


def _is_peer(value: object) -> bool:
    return isinstance(value, str) and bool(value)


_Check = Callable[[object], bool]
# Fields each kind must have, then fields it may have; numbers are stored as float, ints as int.
_REQUIRED: dict[str, dict[str, _Check]] = {
    "step": {"t": _is_time, "step": _is_int, "loss": _is_real},
    "eval": {"t": _is_time, "step": _is_int, "eval_loss": _is_real},
    "link": {"t": _is_time, "peer": _is_peer, "goodput_Bps": _is_real, "rtt_s": _is_real},
}
_OPTIONAL: dict[str, dict[str, _Check]] = {
    "step": {
        "tokens_per_s": _is_real,
        "exposed_s": _is_real,
        "comm_s": _is_real,
        "hidden_fraction": _is_real,
        "bytes_sent": _is_real,
        "plan_version": _is_int,
    },
    "eval": {},
    "link": {},
}


def _parse_record(line: str) -> tuple[str, dict[str, Any] | None, str]:
    """(kind, normalized record or None, why it was refused) of one non-blank line."""
    try:
        raw = json.loads(line)
    except ValueError as exc:
        return "", None, f"not JSON ({exc.msg})"
    if not isinstance(raw, dict):
        return "", None, f"a JSON {type(raw).__name__}, not an object"
    kind = raw.get("kind")
    if not isinstance(kind, str) or kind not in _REQUIRED:
        return "?", None, f"unknown kind {kind!r}"
    rec: dict[str, Any] = {"kind": kind}
    for name, check in _REQUIRED[kind].items():
        if name not in raw:
            return kind, None, f"{kind} record lacks {name!r}"
        if not check(raw[name]):
            return kind, None, f"{kind} record has a bad {name!r}: {raw[name]!r}"
        rec[name] = raw[name]
    for name, check in _OPTIONAL[kind].items():
        if name in raw and raw[name] is not None:
            if not check(raw[name]):
                return kind, None, f"{kind} record has a bad {name!r}: {raw[name]!r}"
            rec[name] = raw[name]
    for name, value in rec.items():
        if _is_real(value) and not _is_int(value):
            rec[name] = float(value)
        elif name == "t":
            rec[name] = float(value)
    return kind, rec, ""


def _read_metrics(path: Path, node: NodeLog) -> None:
    malformed = unknown = total = 0
    first_problem = ""
    with path.open("r", encoding="utf-8", errors="replace") as fh:
        for lineno, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            total += 1
            kind, rec, why = _parse_record(line)
            if rec is None:
                if kind == "?":
                    unknown += 1
                else:
                    malformed += 1
                if not first_problem:
                    first_problem = f"line {lineno}: {why}"
                continue
            {"step": node.steps, "eval": node.evals, "link": node.links}[kind].append(rec)
    if malformed or unknown:
        log.warning(
            "%s: skipped %d of %d records (%d malformed, %d of unknown kind); first at %s",
            path,
            malformed + unknown,
            total,
            malformed,
            unknown,
            first_problem,
        )
    for records in (node.steps, node.evals, node.links):
        records.sort(key=lambda r: r["t"])  # stable: equal times keep file order


def _read_plan(path: Path) -> dict[str, Any] | None:
    try:
        raw = json.loads(path.read_text(encoding="utf-8", errors="replace"))
    except (OSError, ValueError) as exc:
        log.warning("%s: unreadable plan, ignored (%s)", path, exc)
        return None
    if not isinstance(raw, dict) or not isinstance(raw.get("plan"), dict):
        log.warning("%s: not a plan file (expected an object with a 'plan' object), ignored", path)
        return None
    return raw


def load_run(run_dir: str | Path) -> dict[str, NodeLog]:
    """Parse every ``RUN/<node_id>/metrics.jsonl`` and ``plan.json``; node ids sorted, records sorted by ``t``.

    Raises ValueError when ``run_dir`` is not a directory or holds no node sub-directory.
    """
    run = Path(run_dir)
    if not run.is_dir():
        raise ValueError(f"run directory {run} does not exist or is not a directory")
    logs: dict[str, NodeLog] = {}
    for sub in sorted(p for p in run.iterdir() if p.is_dir()):
        metrics, plan = sub / METRICS_FILE, sub / PLAN_FILE
        if not metrics.is_file() and not plan.is_file():
            continue
        node = NodeLog()
        if metrics.is_file():
            _read_metrics(metrics, node)
        if plan.is_file():
            node.plan = _read_plan(plan)
        logs[sub.name] = node
    if not logs:
        raise ValueError(EMPTY_RUN_MESSAGE.format(run=run))
    return logs


# ---------------------------------------------------------------------------------------------------- summaries


def running_mean(values: Sequence[float], window: int = SMOOTH_WINDOW) -> list[float]:
    """Trailing mean over the last ``window`` values (fewer at the start); non-finite values are not averaged.

    An entry is NaN only when its window holds no finite value.
    """
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    out: list[float] = []
    total, count = 0.0, 0
    for i, v in enumerate(values):
        if math.isfinite(v):
            total, count = total + v, count + 1
        if i >= window:
            old = values[i - window]
            if math.isfinite(old):
                total, count = total - old, count - 1
        # re-sum now and then so that float drift of the sliding sum stays bounded
        if i % 4096 == 4095:
            tail = [x for x in values[max(0, i - window + 1) : i + 1] if math.isfinite(x)]
            total, count = math.fsum(tail), len(tail)
        out.append(total / count if count else math.nan)
    return out


def _finite(values: Sequence[float]) -> list[float]:
    return [v for v in values if math.isfinite(v)]


def _mean(values: Sequence[float]) -> float | None:
    good = _finite(values)
    return math.fsum(good) / len(good) if good else None


def _json_num(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None


def _run_start(logs: Mapping[str, NodeLog]) -> float:
    """Time of the run's first record (0.0 when there are none)."""
    times = [r["t"] for node in logs.values() for recs in (node.steps, node.evals, node.links) for r in recs[:1]]
    return min(times) if times else 0.0


def _run_end(logs: Mapping[str, NodeLog]) -> float:
    times = [r["t"] for node in logs.values() for recs in (node.steps, node.evals, node.links) for r in recs[-1:]]
    return max(times) if times else 0.0


def _plan_version(node: NodeLog) -> int | None:
    if node.plan is None:
        return None
    version = node.plan["plan"].get("version")
    return version if _is_int(version) else None


def _newest_plan(logs: Mapping[str, NodeLog]) -> tuple[str, dict[str, Any]] | None:
    """(node id, plan.json) of the node with the highest plan version; ties keep the first node id."""
    best: tuple[int, str, dict[str, Any]] | None = None
    for node_id, node in logs.items():
        if node.plan is None:
            continue
        version = _plan_version(node)
        key = -1 if version is None else version
        if best is None or key > best[0]:
            best = (key, node_id, node.plan)
    return None if best is None else (best[1], best[2])


def summarize(logs: Mapping[str, NodeLog]) -> dict[str, dict[str, Any]]:
    """Per node: step count, first/last smoothed training loss, first/last eval loss, means and bytes sent.

    The first (last) smoothed loss is the mean of the first (last) ``SMOOTH_WINDOW`` finite training losses.
    Means skip records without the field; values that do not exist are None. JSON-safe (no NaN).
    """
    out: dict[str, dict[str, Any]] = {}
    for node_id, node in logs.items():
        losses = _finite([r["loss"] for r in node.steps])
        evals = _finite([r["eval_loss"] for r in node.evals])
        sent = [r["bytes_sent"] for r in node.steps if "bytes_sent" in r]
        out[node_id] = {
            "steps": len(node.steps),
            "last_step": max((r["step"] for r in node.steps), default=None),
            "loss_first": _mean(losses[:SMOOTH_WINDOW]),
            "loss_last": _mean(losses[-SMOOTH_WINDOW:]),
            "eval_loss_first": evals[0] if evals else None,
            "eval_loss_last": evals[-1] if evals else None,
            "evals": len(node.evals),
            "mean_tokens_per_s": _json_num(_mean([r["tokens_per_s"] for r in node.steps if "tokens_per_s" in r])),
            "mean_hidden_fraction": _json_num(
                _mean([r["hidden_fraction"] for r in node.steps if "hidden_fraction" in r])
            ),
            "mean_exposed_s": _json_num(_mean([r["exposed_s"] for r in node.steps if "exposed_s" in r])),
            "bytes_sent": int(math.fsum(_finite(sent))) if sent else 0,
            "plan_version": _plan_version(node),
        }
    return out


def _fmt_bytes(n: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def summary_table(logs: Mapping[str, NodeLog]) -> str:
    """Fixed-width text table of ``summarize(logs)``, one row per node, for printing by the CLI."""
    rows = summarize(logs)
    header = ("node", "steps", "loss first", "loss last", "eval first", "eval last", "tokens/s", "hidden", "sent")
    cells = [header]
    for node_id, s in rows.items():
        cells.append(
            (
                node_id,
                str(s["steps"]),
                _num(s["loss_first"], ".4f"),
                _num(s["loss_last"], ".4f"),
                _num(s["eval_loss_first"], ".4f"),
                _num(s["eval_loss_last"], ".4f"),
                _num(s["mean_tokens_per_s"], ",.0f"),
                _num(s["mean_hidden_fraction"], ".1%"),
                _fmt_bytes(s["bytes_sent"]),
            )
        )
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    lines = []
    for k, row in enumerate(cells):
        text = "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True)))
        lines.append(text.rstrip())
        if k == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _num(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)
