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
from dreamp2p.schedule.dreamddp import IterationTimeline, simulate
from dreamp2p.schedule.plan import Plan
from dreamp2p.service.metrics import RecordKind

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
    RecordKind.STEP: {"t": _is_time, "step": _is_int, "loss": _is_real},
    RecordKind.EVAL: {"t": _is_time, "step": _is_int, "eval_loss": _is_real},
    RecordKind.LINK: {"t": _is_time, "peer": _is_peer, "goodput_Bps": _is_real, "rtt_s": _is_real},
}
_OPTIONAL: dict[str, dict[str, _Check]] = {
    RecordKind.STEP: {
        "tokens_per_s": _is_real,
        "exposed_s": _is_real,
        "comm_s": _is_real,
        "hidden_fraction": _is_real,
        "bytes_sent": _is_real,
        "plan_version": _is_int,
    },
    RecordKind.EVAL: {},
    RecordKind.LINK: {},
}


# Records the daemon writes about its own lifecycle: known, but not plotted.
_LIFECYCLE = frozenset(set(RecordKind) - set(_REQUIRED))


def _parse_record(line: str) -> tuple[str, dict[str, Any] | None, str]:
    """(kind, normalized record or None, why it was refused) of one non-blank line."""
    try:
        raw = json.loads(line)
    except json.JSONDecodeError as exc:
        return "", None, f"not JSON ({exc.msg})"
    except (ValueError, RecursionError) as exc:
        return "", None, f"not JSON ({exc})"
    if not isinstance(raw, dict):
        return "", None, f"a JSON {type(raw).__name__}, not an object"
    kind = raw.get("kind")
    if kind in _LIFECYCLE:
        return "-", None, ""
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
        if name == "t" or (_is_real(value) and not _is_int(value)):
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
            if kind == "-":
                continue
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
            "%s: skipped %d of %d lines (%d malformed, %d of unknown kind); first at %s",
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
            try:
                _read_metrics(metrics, node)
            except OSError as exc:
                log.warning("%s: unreadable, node %s has no records (%s)", metrics, sub.name, exc)
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


def _harmonic_mean(rates: Sequence[float]) -> float | None:
    """Tokens over time for per-step rates of equal-sized steps (an arithmetic mean of rates would let
    the many quick steps outweigh the few that waited on the network)."""
    positive = [r for r in _finite(rates) if r > 0]
    return len(positive) / math.fsum(1.0 / r for r in positive) if positive else None


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
            "mean_tokens_per_s": _json_num(
                _harmonic_mean([r["tokens_per_s"] for r in node.steps if "tokens_per_s" in r])
            ),
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


# ------------------------------------------------------------------------------------------------------ drawing


@contextmanager
def _figure(size: tuple[float, float]) -> Iterator[Figure]:
    """A fresh Agg-backed figure with readable fonts; pyplot and its global figure list are never touched."""
    import sys

    import matplotlib

    if "matplotlib.pyplot" not in sys.modules:  # switching a live pyplot backend would close the user's figures
        matplotlib.use("Agg")
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    with matplotlib.rc_context(
        {
            "font.size": 10,
            "axes.titlesize": 12,
            "axes.labelsize": 11,
            "legend.fontsize": 9,
            "xtick.labelsize": 9,
            "ytick.labelsize": 9,
            "figure.titlesize": 12,
        }
    ):
        fig = Figure(figsize=size, dpi=_DPI, layout="constrained")
        FigureCanvasAgg(fig)
        yield fig


def _save(fig: Figure, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=_DPI, facecolor="white")
    log.info("wrote %s", path)
    return path


def _target(out: Path, name: str) -> Path:
    """``out`` is the report folder; a path ending in .png names the file itself."""
    out = Path(out)
    return out if out.suffix.lower() == ".png" else out / name


def _colors(n: int) -> list[Any]:
    import matplotlib

    if n <= 10:
        cmap = matplotlib.colormaps["tab10"]
        return [cmap(i) for i in range(n)]
    cmap = matplotlib.colormaps["tab20"] if n <= 20 else matplotlib.colormaps["turbo"]
    return [cmap(i) if n <= 20 else cmap(i / max(1, n - 1)) for i in range(n)]


def _no_data(ax: Axes, what: str) -> None:
    ax.text(0.5, 0.5, what, transform=ax.transAxes, ha="center", va="center", color="grey", fontsize=12)


def _utc(t: float) -> str:
    import datetime as dt

    return dt.datetime.fromtimestamp(t, tz=dt.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def plot_loss(logs: Mapping[str, NodeLog], out: Path) -> Path:
    """``loss_vs_time.png``: training loss (running mean, raw faintly behind) and eval loss (markers) per node.

    x is wall-clock seconds since the run's first record (any node, any kind); one colour per node.
    """
    path = _target(out, LOSS_PNG)
    t0 = _run_start(logs)
    with _figure(_SIZE) as fig:
        ax = fig.add_subplot()
        lows: list[float] = []
        highs: list[float] = []
        for color, (node_id, node) in zip(_colors(len(logs)), logs.items(), strict=True):
            pts = [(r["t"] - t0, r["loss"]) for r in node.steps if math.isfinite(r["loss"])]
            if pts:
                xs = [p[0] for p in pts]
                ys = [p[1] for p in pts]
                smooth = running_mean(ys)
                ax.plot(xs, ys, color=color, lw=0.6, alpha=0.18, zorder=1)
                label = f"{node_id} train (mean of {SMOOTH_WINDOW})" if len(ys) > 1 else f"{node_id} train"
                ax.plot(xs, smooth, color=color, lw=1.4, label=label, zorder=2)
                lows.append(min(smooth))
                highs.append(max(smooth))
            evs = [(r["t"] - t0, r["eval_loss"]) for r in node.evals if math.isfinite(r["eval_loss"])]
            if evs:
                ex = [p[0] for p in evs]
                ey = [p[1] for p in evs]
                ax.plot(ex, ey, color=color, ls="--", lw=0.8, marker="o", ms=5, mec="white", mew=0.8, zorder=3)
                ax.plot([], [], color=color, ls="none", marker="o", ms=5, mec="white", label=f"{node_id} eval")
                lows.append(min(ey))
                highs.append(max(ey))
        if lows:
            lo, hi = min(lows), max(highs)
            pad = 0.06 * (hi - lo) if hi > lo else max(0.05, 0.05 * abs(hi))
            ax.set_ylim(lo - pad, hi + pad)  # the raw losses are context: their spikes may leave the frame
            ax.legend(loc="upper right", ncols=2 if len(logs) > 4 else 1, framealpha=0.9)
        else:
            _no_data(ax, "no loss records yet")
        ax.set_xlabel("wall-clock time (s)")
        ax.set_ylabel("loss (nats/byte)")
        start = f" (t = 0 at {_utc(t0)})" if lows else ""
        ax.set_title(f"Training and eval loss per node{start}")
        ax.grid(True, alpha=0.3)
        ax.set_xlim(left=0)
        return _save(fig, path)


def plot_links(logs: Mapping[str, NodeLog], out: Path) -> Path:
    """``link_bandwidth.png``: measured goodput (Mbit/s) and RTT (ms) over time, one line per node -> peer link."""
    path = _target(out, LINK_PNG)
    t0 = _run_start(logs)
    series: list[tuple[str, list[float], list[float], list[float]]] = []
    for node_id, node in logs.items():
        for peer in sorted({r["peer"] for r in node.links}):
            recs = [r for r in node.links if r["peer"] == peer]
            series.append(
                (
                    f"{node_id} → {peer}",
                    [r["t"] - t0 for r in recs],
                    [r["goodput_Bps"] * 8 / 1e6 for r in recs],
                    [r["rtt_s"] * 1e3 for r in recs],
                )
            )
    with _figure((_SIZE[0], 6.5)) as fig:
        ax_bw, ax_rtt = fig.subplots(2, 1, sharex=True, height_ratios=(3, 2))
        marker = "o" if max((len(s[1]) for s in series), default=0) <= 60 else None
        for color, (label, xs, bw, rtt) in zip(_colors(len(series)), series, strict=True):
            ax_bw.plot(xs, bw, color=color, lw=1.3, marker=marker, ms=3, label=label)
            ax_rtt.plot(xs, rtt, color=color, lw=1.3, marker=marker, ms=3)
        if series:
            ax_bw.set_ylim(bottom=0)
            ax_rtt.set_ylim(bottom=0)
            fig.legend(loc="outside right upper", title="link", ncols=1 if len(series) <= 16 else 2)
        else:
            _no_data(ax_bw, "no link measurements yet")
        ax_bw.set_ylabel("goodput (Mbit/s)")
        ax_rtt.set_ylabel("RTT (ms)")
        ax_rtt.set_xlabel("wall-clock time (s)")
        ax_bw.set_title("Measured link goodput" + (f" (t = 0 at {_utc(t0)})" if series else ""))
        ax_rtt.set_title("Round-trip time", fontsize=11)
        for ax in (ax_bw, ax_rtt):
            ax.grid(True, alpha=0.3)
        ax_rtt.set_xlim(left=0)
        return _save(fig, path)


# -------------------------------------------------------------------------------------------------------- gantt


def _plan_inputs(plan_json: Mapping[str, Any]) -> tuple[Plan, list[LayerCost], LinkModel]:
    """Plan, layer costs and link of a plan.json object; ValueError naming what is wrong."""
    if not isinstance(plan_json, Mapping):
        raise ValueError(f"plan.json must be an object, got {type(plan_json).__name__}")
    try:
        plan = Plan.from_dict(plan_json["plan"])
        raw_costs = plan_json["costs"]
        if not isinstance(raw_costs, list):
            raise ValueError("plan.json 'costs' must be a list")
        costs = [LayerCost(c["name"], c["fwd_s"], c["bwd_s"], c["nbytes"]) for c in raw_costs]
        ld = plan_json["link"]
        link = LinkModel(
            bandwidth_Bps=ld["bandwidth_Bps"],
            rtt_s=ld["rtt_s"],
            world=ld["world"],
            codec_ratio=ld.get("codec_ratio", 1.0),
            per_hop_overhead_s=ld.get("per_hop_overhead_s", 0.0),
        )
    except KeyError as exc:
        raise ValueError(f"plan.json lacks field {exc}") from exc
    except (TypeError, AttributeError) as exc:
        raise ValueError(f"malformed plan.json: {exc}") from exc
    return plan, costs, link


def _fmt_s(seconds: float) -> str:
    if seconds == 0:
        return "0 s"
    return f"{seconds * 1e3:.1f} ms" if seconds < 1 else f"{seconds:.2f} s"


def _layer_range(layers: Sequence[int]) -> tuple[str, str]:
    """Long and short label of a sync's layers (forward indices)."""
    a, b = layers[0], layers[-1]
    if len(layers) == 1:
        return f"L{a}", f"{a}"
    if b - a + 1 == len(layers):
        return f"L{a}–{b}", f"{a}–{b}"
    return f"L{a}…{b} ({len(layers)})", f"{a}…{b}"


_Label = tuple[float, float, float, list[str], bool]


def _fit_labels(fig: Figure, ax: Axes, labels: list[_Label]) -> None:
    """Place each label (x0, x1, y, candidates longest first, on a hatched bar) in its bar: the longest that fits.

    The shortest candidate is tried once more in a smaller font; a bar too narrow for any gets none. Labels on
    hatched bars get a white box so that they stay readable.
    """
    fig.draw_without_rendering()  # runs the layout so that data -> pixel transforms are final
    renderer = fig.canvas.get_renderer()  # type: ignore[attr-defined]
    box = {"boxstyle": "round,pad=0.15", "facecolor": "white", "edgecolor": "none", "alpha": 0.8}
    for x0, x1, y, candidates, hatched in labels:
        px0, _ = ax.transData.transform((x0, y))
        px1, _ = ax.transData.transform((x1, y))
        room = abs(px1 - px0) - 4
        tries = [(text, 8.0) for text in candidates] + [(candidates[-1], 6.5)]
        for text, size in tries:
            artist = ax.text((x0 + x1) / 2, y, text, ha="center", va="center", fontsize=size, clip_on=True)
            if hatched:
                artist.set_bbox(box)
            artist.set_in_layout(False)
            if artist.get_window_extent(renderer).width <= room:
                break
            artist.remove()


def plot_gantt(plan_json: dict[str, Any], out: Path) -> Path:
    """``schedule_gantt.png``: one steady-state period of the plan in ``plan_json`` (plan.json), from ``simulate``.

    Per iteration a band of two lanes: "compute" (forward light, backward dark, exposed wait hatched red) and
    "link" (syncs launched in that iteration, labelled with their layer range and delay; bubble-filling repeats
    hatched; the iteration's backward window shaded). Raises ValueError for a malformed plan.json.
    """
    from matplotlib.patches import Patch

    plan, costs, link = _plan_inputs(plan_json)
    timeline: list[IterationTimeline] = simulate(plan, costs, link)
    path = _target(out, GANTT_PNG)
    H, L = plan.period, len(costs)
    period_end = timeline[-1].end_s
    comm_end = max((c.end_s for it in timeline for c in it.comm), default=0.0)
    x_max = max(period_end, comm_end)
    x_max = x_max if x_max > 0 else 1.0
    total_wait = math.fsum(it.exposed_s for it in timeline)
    no_traffic = all(c.end_s <= c.start_s for it in timeline for c in it.comm)
    lanes = 2 * H
    height = min(18.0, max(4.5, 2.2 + 0.36 * lanes))
    edge = 0.5 if L <= 24 else 0.0  # white borders between layers; with many layers they would look like noise
    bar = 0.7
    with _figure((_SIZE[0], height)) as fig:
        ax = fig.add_subplot()
        labels: list[_Label] = []
        for h, it in enumerate(timeline):
            yc, yl = 2 * h, 2 * h + 1
            if h % 2 == 0:
                ax.axhspan(yc - 0.5, yl + 0.5, color="#f3f3f3", zorder=0, lw=0)
            ax.axvline(it.start_s, color="grey", ls=":", lw=0.8, zorder=1)
            fwd = [(b.start_s, b.end_s - b.start_s) for b in it.compute if b.phase == "fwd"]
            bwd = [(b.start_s, b.end_s - b.start_s) for b in it.compute if b.phase == "bwd"]
            box = (yc - bar / 2, bar)
            ax.broken_barh(fwd, box, facecolors=_FWD_COLOR, edgecolors="white", linewidth=edge, zorder=2)
            ax.broken_barh(bwd, box, facecolors=_BWD_COLOR, edgecolors="white", linewidth=edge, zorder=2)
            if it.exposed_s > 0:
                ax.broken_barh(
                    [(it.backward_end_s, it.exposed_s)],
                    box,
                    facecolors=_WAIT_COLOR,
                    edgecolors=_WAIT_EDGE,
                    hatch="xx",
                    linewidth=0.8,
                    zorder=2,
                )
                wait = _fmt_s(it.exposed_s)
                labels.append((it.backward_end_s, it.end_s, yc, [f"wait {wait}", wait], True))
            window = it.backward_end_s - it.backward_start_s
            ax.broken_barh(
                [(it.backward_start_s, window)],
                (yl - 0.45, 0.9),
                facecolors=_WINDOW_COLOR,
                alpha=0.1,
                linewidth=0,
                zorder=1,
            )
            for c in it.comm:
                delay = (c.due_iteration - c.launch_iteration) % H
                long, short = _layer_range(c.layers)
                if c.end_s <= c.start_s:
                    ax.vlines(c.start_s, yl - bar / 2, yl + bar / 2, colors=_SYNC_COLOR, linewidth=1.5, zorder=3)
                    continue
                ax.broken_barh(
                    [(c.start_s, c.end_s - c.start_s)],
                    (yl - bar / 2, bar),
                    facecolors=_REPEAT_COLOR if c.repeat else _SYNC_COLOR,
                    edgecolors=_REPEAT_EDGE if c.repeat else "#8c4a06",
                    hatch="///" if c.repeat else None,
                    linewidth=0.6,
                    zorder=3,
                )
                tail, tail_short = (f", delay {delay}", f" +{delay}") if delay else ("", "")
                layers_word = "layers " + long[1:] if len(c.layers) > 1 else "layer " + long[1:]
                candidates = [layers_word + tail, long + tail_short, short + tail_short]
                labels.append((c.start_s, c.end_s, yl, candidates, c.repeat))
            if not it.comm:
                ax.text(it.backward_start_s, yl, " no sync", ha="left", va="center", fontsize=8, color="grey", zorder=3)
        ax.axvline(period_end, color="grey", ls=":", lw=0.8, zorder=1)
        ax.set_yticks(
            range(lanes), [f"iter {h // 2} {'compute' if h % 2 == 0 else 'link'}" for h in range(lanes)], fontsize=9
        )
        ax.set_ylim(lanes - 0.5, -0.5)
        ax.set_xlim(0, x_max * 1.02)
        ax.set_xlabel("time within period (s)")
        ax.grid(True, axis="x", alpha=0.3)
        ax.set_axisbelow(True)
        if total_wait > 0:
            wait_text = f"predicted exposed wait {_fmt_s(total_wait)} per period ({_fmt_s(total_wait / H)} per step)"
        else:
            wait_text = "predicted exposed wait 0: all syncs hidden"
        if no_traffic:
            link_text = f"no link traffic (world {link.world}: comm time 0)"
        else:
            link_text = (
                f"link {link.bandwidth_Bps * 8 / 1e6:.1f} Mbit/s, RTT {link.rtt_s * 1e3:.0f} ms, "
                f"world {link.world}, codec ratio {link.codec_ratio:g}"
            )
        ax.set_title(
            f"DreamDDP schedule: plan v{plan.version}, period H = {H}, {L} layers\n{wait_text}\n"
            f"compute {_fmt_s(plan.compute_s)} per iteration; {link_text}",
            fontsize=11,
        )
        handles = [
            Patch(facecolor=_FWD_COLOR, label="forward"),
            Patch(facecolor=_BWD_COLOR, label="backward"),
            Patch(facecolor=_WAIT_COLOR, edgecolor=_WAIT_EDGE, hatch="xx", label="exposed wait"),
            Patch(facecolor=_WINDOW_COLOR, alpha=0.1, label="backward window"),
            Patch(facecolor=_SYNC_COLOR, edgecolor="#8c4a06", label="sync (ring all-reduce)"),
            Patch(facecolor=_REPEAT_COLOR, edgecolor=_REPEAT_EDGE, hatch="///", label="repeat sync (bubble fill)"),
        ]
        fig.legend(handles=handles, loc="outside lower center", ncols=6, fontsize=8.5, frameon=False)
        _fit_labels(fig, ax, labels)
        return _save(fig, path)


# ------------------------------------------------------------------------------------------------------- report


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
    newest = _newest_plan(logs)
    gantt = out / GANTT_PNG
    if newest is not None:
        node_id, plan_json = newest
        try:
            written.append(plot_gantt(plan_json, out))
            plan, costs, link = _plan_inputs(plan_json)
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
    t0, t1 = _run_start(logs), _run_end(logs)
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
