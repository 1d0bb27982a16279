"""The run summary: per-node losses, throughput and bytes (`summarize`) and its text table (`summary_table`)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from dreamp2p.devtools.report.runlog import NodeLog, plan_version

SMOOTH_WINDOW = 25


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


def run_start(logs: Mapping[str, NodeLog]) -> float:
    """Time of the run's first record (0.0 when there are none)."""
    times = [r["t"] for node in logs.values() for recs in (node.steps, node.evals, node.links) for r in recs[:1]]
    return min(times) if times else 0.0


def run_end(logs: Mapping[str, NodeLog]) -> float:
    times = [r["t"] for node in logs.values() for recs in (node.steps, node.evals, node.links) for r in recs[-1:]]
    return max(times) if times else 0.0


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
            "plan_version": plan_version(node),
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
