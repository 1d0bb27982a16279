"""`bench lm`'s report arithmetic: region results combined into rows and curves, the ceiling, targets, pairs.

Pure (no I/O, no clocks): `dreamp2p.devtools.bench.lm.run` runs the regions and hands their results here; what
each figure means is in its module docstring. Figures are rounded for the JSON report (``rounded``).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Any

from dreamp2p.devtools.bench.lm.rounds import AVERAGED, combine_rows, mean_curve, paired

TARGET_MARGIN = 1.02  # default target: reference final held-out loss times this


def mean(xs: Sequence[float]) -> float:
    """The plain mean of a non-empty sequence."""
    return sum(xs) / len(xs)


def rounded(x: float | None, nd: int = 4) -> float | None:
    """``x`` rounded to ``nd`` digits for the report; None for None, NaN or infinity (not valid JSON)."""
    return None if x is None or not math.isfinite(x) else round(x, nd)


def region_curve(res: list[dict[str, Any]]) -> list[list[float]]:
    """[[step, slowest region's loop time, region-mean held-out loss], ...]."""
    return [
        [pts[0][0], max(p[1] for p in pts), mean([p[2] for p in pts])]
        for pts in zip(*(r["curve"] for r in res), strict=True)
    ]


def tokens_curve(res: list[dict[str, Any]]) -> list[list[float]] | None:
    """[[tokens the regions had trained on together, region-mean held-out loss], ...] at the curve's points: the
    loss against the data consumed, where regions that follow the clock train on less of it per clock step.
    None for results without local step counts per point."""
    if not all("curve_local_steps" in r for r in res):
        return None
    per_step = [r["tokens"] / r["local_steps"] if r["local_steps"] else 0.0 for r in res]
    out = []
    for i, pts in enumerate(zip(*(r["curve"] for r in res), strict=True)):
        tokens = sum(w * r["curve_local_steps"][i] for w, r in zip(per_step, res, strict=True))
        out.append([round(tokens), mean([p[2] for p in pts])])
    return out


def loss_at_tokens(curve: list[list[float]], tokens: float) -> float | None:
    """The held-out loss on a [[tokens, loss], ...] curve at ``tokens``, linear between the points around it;
    None where the curve does not reach that far or starts after it."""
    for (x0, l0), (x1, l1) in itertools.pairwise(curve):
        if x0 <= tokens <= x1:
            return l1 if x1 == x0 else l0 + (l1 - l0) * (tokens - x0) / (x1 - x0)
    return curve[0][1] if curve and curve[0][0] == tokens else None


def at_equal_tokens(rows: dict[str, dict[str, Any]], names: list[str]) -> None:
    """Each row's ``heldout_loss_at_equal_tokens``: [n, loss], its held-out loss after the regions trained on n
    tokens together, the fewest any of ``names`` trained on in its run (lockstep runs of unequal regions train
    on more tokens per second of the slow region; a time-paced run on fewer per clock step)."""
    ends = [rows[n]["curve_tokens"][-1][0] for n in names if rows[n].get("curve_tokens")]
    if not ends:
        return
    n = min(ends)
    for row in rows.values():
        if row.get("curve_tokens"):
            loss = loss_at_tokens(row["curve_tokens"], n)
            row["heldout_loss_at_equal_tokens"] = [n, rounded(loss) if loss is not None else None]


def time_to(curve: list[list[float]], target: float) -> float | None:
    """The first loop time on ``curve`` at which the held-out loss is <= ``target``; None if never."""
    return next((t for _, t, loss in curve if loss <= target), None)


def summarize(res: list[dict[str, Any]], steps: int, wire_run: list[int] | None) -> dict[str, Any]:
    """One strategy's row from its regions' results (``wire_run``: each region's bytes over the whole run)."""
    # local steps: with time-paced periods a slow region takes fewer than the clock's ``steps``
    sps = [r.get("local_steps", steps) / r["wall_s"] for r in res]
    comm, exposed = sum(r["comm_s"] for r in res), sum(r["exposed_s"] for r in res)
    wire = [r["wire_bytes"] if r["wire_bytes"] is not None else r["bytes_sent"] for r in res]
    mb = sum(wire) / 1e6
    cpu = sum(r["comm_cpu_s"] for r in res)
    row: dict[str, Any] = {
        "steps_per_s": rounded(mean(sps)),
        "steps_per_s_regions": [rounded(x) for x in sps],
        "local_steps_regions": [r.get("local_steps", steps) for r in res],
        # the whole cluster's training throughput: every region's tokens over the run's wall time (the slowest
        # region's), each region's own beside it
        "tokens_per_s": rounded(sum(r["tokens"] for r in res) / max(r["wall_s"] for r in res), 1),
        "tokens_per_s_regions": [rounded(r["tokens"] / r["wall_s"], 1) for r in res],
        "hidden_fraction": rounded(max(0.0, 1.0 - exposed / comm) if comm > 0 else 1.0, 3),
        "exposed_s": rounded(exposed / len(res), 3),
        "exposed_s_regions": [rounded(r["exposed_s"], 3) for r in res],
        "comm_s": rounded(comm / len(res), 3),
        "heldout_loss": rounded(mean([r["heldout_loss"] for r in res])),
        "heldout_loss_regions": [rounded(r["heldout_loss"]) for r in res],
        "train_loss_last10": rounded(mean([r["train_loss_last10"] for r in res])),
        "mb_sent": rounded(mb / len(res), 3),
        "payload_mb_sent": rounded(sum(r["bytes_sent"] for r in res) / 1e6 / len(res), 3),
        "comm_cpu_s": rounded(cpu / len(res), 3),
        "train_cpu_s": rounded(mean([r["train_cpu_s"] for r in res]), 3),
        "comm_cpu_s_per_mb": rounded(cpu / mb, 4) if mb >= 0.1 else None,
        "comm": res[0]["comm"],  # where the peer ran: "thread" or "process" ([node] comm)
        "identical_replicas": len({r["digest"] for r in res}) == 1,
        "rounds_skipped": [r["rounds_skipped"] for r in res],
        "exposed_by_plan": {v: [n, rounded(e, 3), rounded(c, 3)] for v, (n, e, c) in res[0]["exposed_by_plan"].items()},
        "curve": [[s, rounded(t, 3), rounded(loss)] for s, t, loss in region_curve(res)],
    }
    if (by_tokens := tokens_curve(res)) is not None:
        row["curve_tokens"] = [[n, rounded(loss)] for n, loss in by_tokens]
    if wire_run is not None:
        row["mb_sent_run"] = rounded(sum(wire_run) / 1e6 / len(res), 3)
    if "heldout_loss_flushed" in res[0]:
        row["heldout_loss_flushed"] = rounded(mean([r["heldout_loss_flushed"] for r in res]))
        row["identical_after_flush"] = len({r["flushed_digest"] for r in res}) == 1
        row["flush_s"] = rounded(max(r["flush_s"] for r in res), 3)
        row["flush_errors"] = [r["flush_error"] for r in res if r.get("flush_error")]
        for key in ("attach", "flush"):
            counted = [r[f"{key}_wire_bytes"] for r in res if r.get(f"{key}_wire_bytes") is not None]
            row[f"{key}_mb"] = rounded(sum(counted) / 1e6 / len(counted), 3) if counted else None
    if "plan_history" in res[0]:
        row["plan_history"] = res[0]["plan_history"]
        row["plan"] = res[0]["plan_summary"]
        row["plan_report"] = res[0]["plan_report"]
        # per control round: [landing step, the planner's MB/s, the slowest link's transport goodput MB/s]
        row["controls"] = res[0]["controls"]
    return row


def ceiling_summary(
    ceiling_res: list[dict[str, Any]],
    ceiling_curve: list[list[float]],
    ceiling_sps: float,
    steps: int,
    target: float,
    rows: dict[str, dict[str, Any]],
) -> dict[str, Any]:
    """The report's ``ceiling`` entry, with the no-sync run's speed beside it when ``none`` ran."""
    ceiling = {
        "steps_per_s": rounded(ceiling_sps),
        "steps_per_s_regions": [rounded(steps / r["wall_s"]) for r in ceiling_res],
        "heldout_loss": rounded(ceiling_curve[-1][2]),
        "heldout_loss_regions": [rounded(r["heldout_loss"]) for r in ceiling_res],
        "train_loss_last10": rounded(mean([r["train_loss_last10"] for r in ceiling_res])),
        "train_cpu_s": rounded(mean([r["train_cpu_s"] for r in ceiling_res]), 3),
        "time_to_target_s": rounded(time_to(ceiling_curve, target), 3),
        "curve": [[s, rounded(t, 3), rounded(loss)] for s, t, loss in ceiling_curve],
    }
    if "none" in rows:
        ceiling["none_steps_per_s"] = rows["none"]["steps_per_s"]
        ceiling["none_utilization"] = rows["none"]["compute_utilization"]
    return ceiling


def combined(done: list[tuple[dict[str, Any], list[list[float]]]]) -> tuple[dict[str, Any], list[list[float]]]:
    """One strategy's rounds as one row (means, each round under ``runs``) and their mean loss curve."""
    curve = mean_curve([c for _, c in done])
    row = combine_rows([r for r, _ in done])
    for key in AVERAGED:
        if row.get(key) is not None:
            row[key] = rounded(row[key], 3 if key in ("compute_utilization", "hidden_fraction") else 4)
    row["curve"] = [[s, rounded(t, 3), rounded(loss)] for s, t, loss in curve]
    return row, curve


def paired_report(rows: dict[str, dict[str, Any]], winner: str) -> dict[str, Any]:
    """The winner's compute utilization against every other syncing strategy's, round by round."""
    others = {}
    mine = [r["compute_utilization"] for r in rows[winner].get("runs", [rows[winner]])]
    for name, row in rows.items():
        if name in ("none", winner):
            continue
        theirs = [r["compute_utilization"] for r in row.get("runs", [row])]
        d = paired(mine, theirs)
        others[name] = {
            **d,
            "mean": rounded(d["mean"], 4),
            "diffs": [rounded(x, 4) for x in d["diffs"]],
            "stderr": rounded(d["stderr"], 4) if d["stderr"] is not None else None,
            "ci95": [rounded(x, 4) for x in d["ci95"]] if d["ci95"] is not None else None,
        }
    return {"figure": "compute_utilization", "winner": winner, "against": others}


def bracketed(steps_per_s: float, before: float, after: float) -> dict[str, Any]:
    """A strategy's utilization against the mean of the ceilings measured just before and after it."""
    if not (before > 0 and after > 0):
        raise ValueError(f"ceilings must be > 0 steps/s, got {before} and {after}")
    return {
        "ceiling_steps_per_s": [rounded(before), rounded(after)],
        "compute_utilization": rounded(2.0 * steps_per_s / (before + after), 3),
    }


def choose_target(
    target_loss: float | None, curves: dict[str, list[list[float]]], ceiling_curve: list[list[float]]
) -> tuple[float, str]:
    """The held-out loss that time_to_target_s measures to, and where it came from."""
    if target_loss is None:
        reference = curves["none"][-1][2] if "none" in curves else ceiling_curve[-1][2]
        target = reference * TARGET_MARGIN
        target_from = "none" if "none" in curves else "ceiling"
    else:
        target, target_from = target_loss, "given"
    return target, target_from


def at_equal_wall(rows: dict[str, dict[str, Any]], curves: dict[str, list[list[float]]], names: list[str]) -> None:
    """Each row's ``heldout_loss_at_equal_wall``: [t, loss], its held-out loss at the latest point of its curve
    no later than t, the loop time the quickest of ``names`` took to the end (None where no point is that early)."""
    t = min(curves[n][-1][1] for n in names)
    for name, curve in curves.items():
        loss = next((p[2] for p in reversed(curve) if p[1] <= t), None)
        rows[name]["heldout_loss_at_equal_wall"] = [rounded(t, 3), rounded(loss) if loss is not None else None]


def results(
    rows: dict[str, dict[str, Any]],
    curves: dict[str, list[list[float]]],
    ceiling_res: list[dict[str, Any]],
    ceiling_curve: list[list[float]],
    ceiling_sps: float,
    ceilings: list[float],
    steps: int,
    target_loss: float | None,
) -> dict[str, Any]:
    """The report's results: the target and each row's time to it, the ceiling, the rows, the winner, the pairs.

    ``ceiling_sps``: the ceiling measured before the first strategy; ``ceilings``: every ceiling measured, in order.
    """
    target, target_from = choose_target(target_loss, curves, ceiling_curve)
    for name, curve in curves.items():
        rows[name]["time_to_target_s"] = rounded(time_to(curve, target), 3)
    syncing = [n for n in rows if n != "none"] or list(rows)
    at_equal_wall(rows, curves, syncing)
    at_equal_tokens(rows, syncing)
    winner = max(syncing, key=lambda n: rows[n]["steps_per_s"])
    ceiling = ceiling_summary(ceiling_res, ceiling_curve, ceiling_sps, steps, target, rows)
    ceiling["steps_per_s_runs"] = [rounded(c) for c in ceilings]
    return {
        "target_loss": rounded(target),
        "target_from": target_from,
        "ceiling": ceiling,
        "strategies": rows,
        "winner_steps_per_s": winner,
        "paired": paired_report(rows, winner),
    }
