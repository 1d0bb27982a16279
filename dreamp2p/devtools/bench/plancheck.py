"""`bench plancheck`: validate ``dreamp2p plan`` against `bench lm` measurements over a grid of WAN settings.

For every grid point (model size, rate, RTT, regions) it runs `bench lm` with dreamddp at its defaults
(the ceiling measured in the same run), measures the ceiling once more after it (on a shared host, how far
the hardware's pace moved meanwhile), then compares the measured step time and compute utilization with
what ``dreamp2p plan`` predicts from what a user would give it, and with the plan dreamddp adopted (see
`devtools.plancheck_table`, which holds everything but the running). Points run one after another, never
two at once; with ``out`` each finished point (with its `bench lm` report) is appended to a JSON-lines
file at once, so a long grid that is stopped keeps what it measured; ``reports`` compares saved `bench lm`
outputs or such rows again without running anything.

``target_cu`` mode checks ``dreamp2p plan --target-cu``: per point a short ceiling run measures the step
time a user would give, the recommendation is run through `bench lm` as dreamddp with exactly the ``[sync]``
settings ``plan --target-cu`` prints for it (`dreamddp_settings`: the period, the default delay cap, and the
codec as the pseudo-gradients' ``delta_codec``, or as ``plan_codecs`` with parameter averaging for a wide
codec), and the measured utilization is held against the target (>= target - 0.05).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from dreamp2p.config import parse_rate
from dreamp2p.config.sync import dreamddp_settings
from dreamp2p.devtools import plancheck_table as pt
from dreamp2p.devtools.bench.lm.run import bench_lm
from dreamp2p.devtools.bench.lm.work import make_model, run_ceiling
from dreamp2p.schedule.cost import LinkModel
from dreamp2p.schedule.linkcodec import wire_ratio
from dreamp2p.schedule.recommend import SEARCH_PERIODS, recommend
from dreamp2p.schedule.whatif import uniform_costs
from dreamp2p.sync.model.layers import discover_layers

log = logging.getLogger(__name__)

CALIBRATION_STEPS = 40  # ceiling steps measured before asking `plan --target-cu` (target mode)
MIN_PERIODS = 5  # target mode runs at least this many periods of the recommended H


def scheduled_layers(size: str) -> int:
    """How many layers dreamddp schedules for this model size (what a user passes as ``plan --layers``)."""
    m = pt.SIZES[size]
    return len(discover_layers(make_model(m.width, m.layers, m.heads, m.context, "cpu")))


def _lm(point: pt.GridPoint, steps: int, period: int, netns: bool | None, **kw: Any) -> dict[str, Any]:
    m = pt.SIZES[point.size]
    return bench_lm(
        strategies=["dreamddp"],
        regions=point.regions,
        rate=point.rate,
        rtt_ms=point.rtt_ms,
        steps=steps,
        period=period,
        width=m.width,
        layers=m.layers,
        heads=m.heads,
        context=m.context,
        netns=netns,
        **kw,
    )


def _ceiling_step_s(point: pt.GridPoint, steps: int) -> float:
    """Mean seconds per step of ``point.regions`` plain training processes started together (no dreamp2p)."""
    m = pt.SIZES[point.size]
    workload = {
        "steps": steps,
        "width": m.width,
        "layers": m.layers,
        "heads": m.heads,
        "context": m.context,
        "batch": 8,
        "lr": 3e-4,
        "eval_batches": 1,
        "device": "cpu",
    }
    res = run_ceiling(point.regions, workload, timeout=600.0 + 10.0 * steps)
    return sum(r["wall_s"] for r in res) / len(res) / steps


def _measure(point: pt.GridPoint, steps: int, period: int, netns: bool | None) -> dict[str, Any]:
    """`bench lm` (its ceiling, then dreamddp), then the ceiling once more: how much the host's pace drifted."""
    report = _lm(point, steps, period, netns)
    report["ceiling"]["after_steps_per_s"] = round(1.0 / _ceiling_step_s(point, steps), 4)
    return report


def _point_of(report: dict[str, Any]) -> pt.GridPoint:
    model = report["model"]
    size = next((n for n, s in pt.SIZES.items() if (s.width, s.layers) == (model["width"], model["layers"])), None)
    if size is None:
        raise ValueError(f"bench lm report of a model not in the grid sizes: {model}")
    return pt.GridPoint(size, report["rate"], float(report["rtt_ms"]), int(report["regions"]))


def _row(point: pt.GridPoint, report: dict[str, Any], layers: dict[str, int]) -> tuple[pt.Check, dict[str, Any]]:
    if point.size not in layers:
        layers[point.size] = scheduled_layers(point.size)
    check, inputs = pt.check_point(point, report, layers[point.size])
    row = check.to_dict()
    dd = report["strategies"]["dreamddp"]
    row.update(
        adopted_inputs=inputs,
        shaping=report["shaping"],
        steps=report["steps"],
        hidden_fraction=dd["hidden_fraction"],
        exposed_s=dd["exposed_s"],
        mb_sent=dd["mb_sent"],
        comm_cpu_s=dd["comm_cpu_s"],
        plans=dd.get("plan_history"),
    )
    log.info(
        "%s: measured %.3f s/step (CU %.3f), plan %.3f s/step (CU %.3f): errors %.1f%% / %.1f%%%s",
        point.label,
        check.measured.step_s,
        check.measured.utilization,
        check.plan.step_s,
        check.plan.utilization,
        100 * check.step_error,
        100 * check.cu_error,
        "" if check.within() else " OUTSIDE",
    )
    return check, row


def _saved(name: str) -> list[dict[str, Any]]:
    """The JSON objects of a saved file: a `bench lm` output (its last line) or plancheck's JSON-lines rows."""
    objs = []
    for line in Path(name).read_text().splitlines():
        if line.startswith("{"):
            obj = json.loads(line)
            if obj.get("bench") == "lm" or "plan_command" in obj:
                obj.setdefault("source", name)
                objs.append(obj)
    if not objs:
        raise ValueError(f"{name}: no bench lm report or plancheck row in it")
    return objs


def _append(out: Path | None, row: dict[str, Any]) -> None:
    if out is not None:
        with out.open("a") as fh:
            fh.write(json.dumps(row) + "\n")


def bench_plancheck(
    sizes: Sequence[str] = ("small", "large"),
    rates: Sequence[str] = ("10mbit", "20mbit", "100mbit"),
    rtts: Sequence[str] = ("0ms", "80ms"),
    regions: Sequence[int] = (2, 3),
    steps: int = 100,
    period: int = 20,
    netns: bool | None = None,
    out: str | None = None,
    reports: Sequence[str] = (),
    target_cu: float | None = None,
) -> dict[str, Any]:
    """Measure the grid (or read ``reports``) and compare with the planner; a JSON-serialisable result."""
    if target_cu is not None:
        return _target_mode(pt.grid(sizes, rates, rtts, regions), target_cu, steps, netns, out)
    t0 = time.perf_counter()
    path = Path(out) if out else None
    layers: dict[str, int] = {}
    checks, rows = [], []
    saved_rows = [row for name in reports for row in _saved(name)]
    for point in [] if reports else pt.grid(sizes, rates, rtts, regions):
        fresh = _measure(point, steps, period, netns)
        check, row = _row(point, fresh, layers)
        row["source"] = "measured"
        _append(path, {**row, "report": fresh})  # the report too: --reports can compare it again
        checks.append(check)
        rows.append(row)
    for saved in saved_rows:  # a bench lm report (or a row holding one) is compared again; a bare row as it was
        report: dict[str, Any] | None = saved.get("report") if "plan_command" in saved else saved
        if report is not None:
            check, row = _row(_point_of(report), report, layers)
            row["source"] = saved["source"]
        else:
            check = pt.check_from_row(saved)
            row = {**saved, **check.to_dict()}
        _append(path, row if report is None else {**row, "report": report})
        checks.append(check)
        rows.append(row)
    return {
        "bench": "plancheck",
        "steps": steps if not reports else sorted({r["steps"] for r in rows if "steps" in r}),
        "period": period,
        "tolerance": pt.TOLERANCE,
        "rows": rows,
        "summary": pt.summary(checks),
        "table": pt.markdown_table(checks),
        "total_s": round(time.perf_counter() - t0, 1),
    }


def _recommendation(point: pt.GridPoint, target: float, layers: int) -> dict[str, Any]:
    """`plan --target-cu` for this point, from a short ceiling run's step time (what a user would measure)."""
    m = pt.SIZES[point.size]
    step_s = _ceiling_step_s(point, CALIBRATION_STEPS)
    params = sum(p.numel() for p in make_model(m.width, m.layers, m.heads, m.context, "cpu").parameters())
    costs = uniform_costs(params, layers, step_s)
    run = pt.RUN_DEFAULTS  # what `dreamp2p plan --target-cu` passes: a dreamddp run's own headroom
    link = LinkModel(parse_rate(point.rate), point.rtt_ms / 1e3, point.regions, margin=run.link_margin)
    codecs = [(run.delta_codec, wire_ratio(run.delta_codec))]  # what plan --target-cu searches unpinned
    rec = recommend(
        costs,
        link,
        target,
        codecs,
        SEARCH_PERIODS,
        round_cost_s=run.round_cost_s,
        link_budget=run.codec_link_budget,
    )
    command = (
        f"dreamp2p plan --params {params} --layers {layers} --step-time {step_s:.6f} --peers {point.regions} "
        f"--link {point.rate} --rtt {point.rtt_ms:g}ms --target-cu {target} --json"
    )
    return {"command": command, "best": asdict(rec.best) if rec.best else None, "message": rec.message}


def _target_mode(
    points: Sequence[pt.GridPoint], target: float, steps: int, netns: bool | None, out: str | None
) -> dict[str, Any]:
    path = Path(out) if out else None
    rows = []
    for point in points:
        rec = _recommendation(point, target, scheduled_layers(point.size))
        row: dict[str, Any] = {"point": asdict(point), "target_cu": target, "recommendation": rec}
        best = rec["best"]
        if best is None:
            row["met"] = None  # nothing to run: the planner says the target is out of reach here
        else:
            H = int(best["period"])
            settings = dreamddp_settings(best["codec"], H)  # as plan --target-cu prints it: the default delay cap
            extra = {k: v for k, v in settings.items() if k not in ("strategy", "period")}  # bench lm's own args
            n = max(steps, MIN_PERIODS * H)
            report = _lm(point, n, H, netns, extra_sync=extra)
            report["ceiling"]["after_steps_per_s"] = round(1.0 / _ceiling_step_s(point, n), 4)
            dd, m = report["strategies"]["dreamddp"], pt.measured(report)
            bracketed, own = m.bracketed_utilization, m.own_utilization
            row.update(
                sync=settings,
                steps=n,
                ceiling_steps_per_s=report["ceiling"]["steps_per_s"],
                ceiling_after_steps_per_s=report["ceiling"]["after_steps_per_s"],
                steps_per_s=dd["steps_per_s"],
                measured_cu=dd["compute_utilization"],
                bracketed_cu=None if bracketed is None else round(bracketed, 4),
                own_cu=None if own is None else round(own, 4),
                predicted_cu=best["utilization"],
                met=pt.target_check(target, float(dd["compute_utilization"])),
                met_bracketed=None if bracketed is None else pt.target_check(target, bracketed),
                met_own_clock=None if own is None else pt.target_check(target, own),
                exposed_s=dd["exposed_s"],
                mb_sent=dd["mb_sent"],
                plan=dd.get("plan"),
                shaping=report["shaping"],
            )
            log.info("%s: target %.2f, measured %.3f (%s)", point.label, target, row["measured_cu"], row["met"])
        _append(path, row)
        rows.append(row)
    return {"bench": "plancheck", "target_cu": target, "slack": 0.05, "rows": rows}
