"""`bench lm --rounds N`: run orders, per-round rows combined, and paired differences with 95% intervals.

Pure (no I/O, no clocks). Two strategies a few percent apart on a shared host cannot be told apart by one
run each: the host's pace drifts by more than that within a run. Running every strategy in each of N rounds,
with the order rotated from round to round (so each strategy runs first, second, ... equally often), and
comparing them within a round (the two ran minutes apart) gives a paired difference per round; its mean
and Student's t 95% interval over the rounds say whether one is faster or the runs cannot tell.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

# two-sided 95% quantiles of Student's t by degrees of freedom (1..30); above 30 the normal's 1.96 is
# within 4% of the exact value, and the rounds a benchmark can afford never get near it
_T95 = (
    12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228,
    2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086,
    2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042,
)  # fmt: skip

# per-round figures of a strategy's row that the combined row reports as their mean over rounds
AVERAGED = (
    "steps_per_s",
    "compute_utilization",
    "heldout_loss",
    "train_loss_last10",
    "hidden_fraction",
    "exposed_s",
    "comm_s",
    "mb_sent",
    "payload_mb_sent",
    "comm_cpu_s",
    "train_cpu_s",
)
# what each round's entry in a combined row's ``runs`` keeps
PER_ROUND = ("steps_per_s", "compute_utilization", "heldout_loss", "mb_sent", "ceiling_steps_per_s")


def round_order(names: Sequence[str], k: int) -> list[str]:
    """The order of round ``k`` (0-based): ``names`` rotated left by k, so over len(names) rounds every
    strategy runs at every position once (a host that slows down as it warms does not favour one)."""
    if not names:
        return []
    k %= len(names)
    return [*names[k:], *names[:k]]


def t95(df: int) -> float:
    """The two-sided 95% quantile of Student's t with ``df`` >= 1 degrees of freedom."""
    if df < 1:
        raise ValueError(f"degrees of freedom must be >= 1, got {df}")
    return _T95[df - 1] if df <= len(_T95) else 1.96


def paired(a: Sequence[float], b: Sequence[float]) -> dict[str, Any]:
    """``a - b`` round by round: its mean, standard error, 95% interval, and the rounds in which a > b.

    With one round there is no spread to estimate: the interval is None and the verdict "one round".
    Verdict: "ahead" (the interval lies above 0), "behind" (below 0) or "tie" (it contains 0).
    """
    if len(a) != len(b) or not a:
        raise ValueError(f"need the same number of rounds (>= 1) on both sides, got {len(a)} and {len(b)}")
    diffs = [x - y for x, y in zip(a, b, strict=True)]
    if not all(math.isfinite(d) for d in diffs):
        raise ValueError(f"paired figures must be finite, got differences {diffs}")
    n = len(diffs)
    mean = sum(diffs) / n
    out: dict[str, Any] = {"rounds": n, "mean": mean, "ahead_in": sum(d > 0 for d in diffs), "diffs": diffs}
    if n < 2:
        return {**out, "stderr": None, "ci95": None, "verdict": "one round"}
    sd = math.sqrt(sum((d - mean) ** 2 for d in diffs) / (n - 1))
    se = sd / math.sqrt(n)
    half = t95(n - 1) * se
    lo, hi = mean - half, mean + half
    verdict = "ahead" if lo > 0 else "behind" if hi < 0 else "tie"
    return {**out, "stderr": se, "ci95": [lo, hi], "verdict": verdict}


def mean_curve(curves: Sequence[Sequence[Sequence[float]]]) -> list[list[float]]:
    """Pointwise mean of [[step, loop time, loss], ...] curves taken at the same steps."""
    if not curves:
        raise ValueError("no curves to combine")
    out = []
    for points in zip(*curves, strict=True):
        steps = {p[0] for p in points}
        if len(steps) != 1:
            raise ValueError(f"curves are not taken at the same steps: {sorted(steps)}")
        n = len(points)
        out.append([points[0][0], sum(p[1] for p in points) / n, sum(p[2] for p in points) / n])
    return out


def combine_rows(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One strategy's rows of several rounds as one: the :data:`AVERAGED` figures are their means, ``runs``
    lists each round's :data:`PER_ROUND` figures, and everything else (per-region lists, plans, the curve)
    is the first round's; the caller replaces the curve by the rounds' :func:`mean_curve`."""
    if not rows:
        raise ValueError("no rows to combine")
    out = dict(rows[0])
    for key in AVERAGED:
        values = [r[key] for r in rows if r.get(key) is not None]
        if values:
            out[key] = sum(values) / len(values)
    out["runs"] = [{key: r[key] for key in PER_ROUND if key in r} for r in rows]
    return out
