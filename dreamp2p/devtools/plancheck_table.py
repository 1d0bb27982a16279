"""`bench plancheck`'s pure part: the grid, the planner's predictions for a measured point, the comparison table.

A grid point is (model size, link rate, RTT, regions). Its measurement is one `bench lm` report (dreamddp at
its defaults, the ceiling measured in the same run). Two predictions are compared with it:

* **plan** (the one users see): what ``dreamp2p plan`` predicts for dreamddp from what a user would give it:
  the measured ceiling step time as ``--step-time``, the parameter count, the layers dreamp2p schedules
  (``sync.model.layers.discover_layers``: 28 for the default model), ``--peers`` = regions, ``--link`` = the rate,
  ``--rtt``, ``--period``, and dreamddp's defaults as ``--max-delay period-1 --codec int4`` (``delay_cap``
  and ``delta_codec``, the pseudo-gradients' codec the run's planner prices its syncs at). It is
  `schedule.whatif.what_if`, the function behind the command;
* **adopted**: the plan dreamddp itself adopted in the run, replayed by `schedule.dreamddp.simulate` on the
  profile and link it was made from (``plan_report`` in the bench report), with its syncs' codec's bytes.
  Its compute time is the in-run profile, not the ceiling, so it shows how much of the error is compute.

Both are compared on step time (1 / measured steps/s) and compute utilization (measured steps/s / ceiling
steps/s in the same run); the relative error is |predicted - measured| / measured, within tolerance when
both errors are at most ``TOLERANCE``. Pure: no I/O, no clock; the runner is `devtools.bench.plancheck`.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from dreamp2p.config import parse_duration, parse_rate
from dreamp2p.config.sync import SyncConfig
from dreamp2p.schedule.cost import LayerCost, LinkModel
from dreamp2p.schedule.dreamddp import rounds_per_step, simulate
from dreamp2p.schedule.linkcodec import wire_ratio
from dreamp2p.schedule.plan import Plan
from dreamp2p.schedule.whatif import what_if

TOLERANCE = 0.15
RUN_DEFAULTS = SyncConfig()  # the planner settings of a dreamddp run with defaults
# the codec a dreamddp run's layer syncs are priced at: its pseudo-gradients' (anchors follow only a failed check)
DEFAULT_CODEC = RUN_DEFAULTS.delta_codec or RUN_DEFAULTS.plan_codecs[0]


@dataclass(frozen=True)
class ModelSize:
    width: int
    layers: int  # transformer blocks
    heads: int = 4
    context: int = 128


# small: the judged workload's model (3.32M parameters); large: 10.9M; tiny: for smoke tests only
SIZES: dict[str, ModelSize] = {
    "small": ModelSize(256, 4),
    "large": ModelSize(384, 6),
    "tiny": ModelSize(32, 1, 4, 16),
}


@dataclass(frozen=True)
class GridPoint:
    size: str
    rate: str
    rtt_ms: float
    regions: int

    def __post_init__(self) -> None:
        if self.size not in SIZES:
            raise ValueError(f"unknown model size {self.size!r}; known: {', '.join(SIZES)}")
        parse_rate(self.rate)  # raises ValueError with the reason
        if not math.isfinite(self.rtt_ms) or self.rtt_ms < 0:
            raise ValueError(f"rtt_ms must be finite and >= 0, got {self.rtt_ms!r}")
        if isinstance(self.regions, bool) or not isinstance(self.regions, int) or self.regions < 2:
            raise ValueError(f"regions must be an int >= 2 (a sync needs a peer), got {self.regions!r}")

    @property
    def label(self) -> str:
        return f"{self.size} {self.rate} rtt {self.rtt_ms:g}ms x{self.regions}"


def grid(sizes: Sequence[str], rates: Sequence[str], rtts: Sequence[str], regions: Sequence[int]) -> list[GridPoint]:
    """Every combination, in the order given (sizes outermost, regions innermost); duplicates refused."""
    points = [
        GridPoint(size, rate, parse_duration(rtt) * 1e3, n)
        for size, rate, rtt, n in itertools.product(sizes, rates, rtts, regions)
    ]
    if not points:
        raise ValueError("empty grid: give at least one size, rate, RTT and region count")
    if len(set(points)) != len(points):
        raise ValueError("the grid repeats a point")
    return points


@dataclass(frozen=True)
class Prediction:
    step_s: float
    utilization: float


@dataclass(frozen=True)
class Measured:
    ceiling_step_s: float
    step_s: float
    utilization: float
    # the ceiling measured again right after the strategy (``ceiling.after_steps_per_s``, set by the runner):
    # on a host shared with other work, how far the hardware's pace moved during the point
    ceiling_after_s: float | None = None
    exposed_step_s: float | None = None  # the strategy's own exposed wait per step (mean over regions)

    @property
    def drift(self) -> float | None:
        """ceiling step time after / before - 1 (None when not measured again)."""
        return None if self.ceiling_after_s is None else self.ceiling_after_s / self.ceiling_step_s - 1.0

    @property
    def bracketed_utilization(self) -> float | None:
        """Against the mean of the ceilings before and after: less sensitive to a host whose load moved."""
        if self.ceiling_after_s is None:
            return None
        return (self.ceiling_step_s + self.ceiling_after_s) / 2.0 / self.step_s

    @property
    def own_utilization(self) -> float | None:
        """1 - exposed wait / step time, on the strategy's own clock: what the planner's CU means
        (compute / (compute + exposed)), blind to compute slowed by the host or by dreamp2p's own CPU."""
        return None if self.exposed_step_s is None else 1.0 - self.exposed_step_s / self.step_s


def measured(report: Mapping[str, Any], strategy: str = "dreamddp") -> Measured:
    """The measured step time and utilization of ``strategy`` in a `bench lm` report."""
    row = report["strategies"].get(strategy)
    if row is None:
        raise ValueError(f"the bench lm report has no {strategy!r} row (ran: {', '.join(report['strategies'])})")
    ceiling, sps = float(report["ceiling"]["steps_per_s"]), float(row["steps_per_s"])
    if not ceiling > 0 or not sps > 0:
        raise ValueError(f"steps/s must be > 0 (ceiling {ceiling}, {strategy} {sps})")
    after = report["ceiling"].get("after_steps_per_s")
    if after is not None and not float(after) > 0:
        raise ValueError(f"ceiling.after_steps_per_s must be > 0, got {after!r}")
    exposed = row.get("exposed_s")
    per_step = None if exposed is None or "steps" not in report else float(exposed) / int(report["steps"])
    return Measured(1.0 / ceiling, 1.0 / sps, sps / ceiling, None if after is None else 1.0 / float(after), per_step)


def plan_args(report: Mapping[str, Any], layers: int, codec: str = DEFAULT_CODEC) -> dict[str, Any]:
    """What a user would give ``dreamp2p plan`` for this run (flag name without dashes -> value)."""
    period = int(report["period"])
    return {
        "params": int(report["params"]),
        "layers": layers,
        "step-time": round(measured(report).ceiling_step_s, 6),
        "peers": int(report["regions"]),
        "link": str(report["rate"]),
        "rtt": f"{float(report['rtt_ms']):g}ms",
        "period": period,
        "max-delay": period - 1,
        "codec": codec,
    }


def plan_command(args: Mapping[str, Any]) -> str:
    return "dreamp2p plan " + " ".join(f"--{k} {v}" for k, v in args.items()) + " --json"


def user_prediction(args: Mapping[str, Any]) -> Prediction:
    """``dreamp2p plan``'s dreamddp prediction for ``plan_args`` (the function behind the command)."""
    result = what_if(
        params=float(args["params"]),
        layers=int(args["layers"]),
        step_time_s=float(args["step-time"]),
        peers=int(args["peers"]),
        bandwidth_Bps=parse_rate(str(args["link"])),
        rtt_s=parse_duration(str(args["rtt"])),
        period=int(args["period"]),
        codec_ratio=wire_ratio(str(args["codec"])),
        max_delay=int(args["max-delay"]),
        margin=RUN_DEFAULTS.link_margin,  # what `dreamp2p plan` passes: a DreamDDP run's own planner settings
        round_cost_s=RUN_DEFAULTS.round_cost_s,
    )
    p = result["predictions"]["dreamddp"]
    return Prediction(float(p["step_time_s"]), float(p["compute_utilization"]))


def adopted_prediction(plan_report: Mapping[str, Any]) -> tuple[Prediction, dict[str, Any]]:
    """The adopted plan replayed on the profile and link it was made from; plus those inputs, for the report.

    The link's codec ratio is that of the plan's codec (the runtime's report carries the base codec's).
    """
    plan = Plan.from_dict(plan_report["plan"])
    costs = [
        LayerCost(str(c["name"]), float(c["fwd_s"]), float(c["bwd_s"]), int(c["nbytes"])) for c in plan_report["costs"]
    ]
    lk = plan_report["link"]
    codec = str(plan_report.get("codec", DEFAULT_CODEC))
    link = LinkModel(float(lk["bandwidth_Bps"]), float(lk["rtt_s"]), int(lk["world"]), wire_ratio(codec))
    timeline = simulate(plan, costs, link)
    compute = math.fsum(c.fwd_s + c.bwd_s for c in costs)
    exposed = math.fsum(it.exposed_s for it in timeline) / plan.period
    step = compute + exposed + rounds_per_step(plan) * float(plan_report.get("round_cost_s", 0.0))
    inputs = {
        "plan_version": plan.version,
        "codec": codec,
        "groups": sum(1 for s in plan.syncs if not s.repeat),
        "max_delay": max((s.delay for s in plan.syncs), default=0),
        "profile_compute_s": round(compute, 5),
        "link_mbit_s": round(link.bandwidth_Bps * 8 / 1e6, 3),
        "link_rtt_ms": round(link.rtt_s * 1e3, 3),
    }
    return Prediction(step, compute / step if step > 0 else 1.0), inputs


def rel_error(predicted: float, actual: float) -> float:
    if not actual > 0:
        raise ValueError(f"the measured value must be > 0, got {actual!r}")
    return abs(predicted - actual) / actual


@dataclass(frozen=True)
class Check:
    """One grid point: measured against the user-facing plan's prediction (and the adopted plan's, if known)."""

    point: GridPoint
    measured: Measured
    plan: Prediction
    adopted: Prediction | None
    command: str

    @property
    def step_error(self) -> float:
        return rel_error(self.plan.step_s, self.measured.step_s)

    @property
    def cu_error(self) -> float:
        return rel_error(self.plan.utilization, self.measured.utilization)

    def within(self, tolerance: float = TOLERANCE) -> bool:
        return self.step_error <= tolerance and self.cu_error <= tolerance

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "point": {
                "size": self.point.size,
                "rate": self.point.rate,
                "rtt_ms": self.point.rtt_ms,
                "regions": self.point.regions,
            },
            "ceiling_step_s": round(self.measured.ceiling_step_s, 6),
            "measured_step_s": round(self.measured.step_s, 6),
            "measured_cu": round(self.measured.utilization, 4),
            "plan_step_s": round(self.plan.step_s, 6),
            "plan_cu": round(self.plan.utilization, 4),
            "step_error": round(self.step_error, 4),
            "cu_error": round(self.cu_error, 4),
            "within": self.within(),
            "plan_command": self.command,
        }
        m = self.measured
        if m.drift is not None and m.bracketed_utilization is not None:
            out["ceiling_drift"] = round(m.drift, 4)
            out["bracketed_cu"] = round(m.bracketed_utilization, 4)
            out["bracketed_cu_error"] = round(rel_error(self.plan.utilization, m.bracketed_utilization), 4)
        if m.own_utilization is not None:
            out["own_cu"] = round(m.own_utilization, 4)
            out["own_cu_error"] = round(rel_error(self.plan.utilization, m.own_utilization), 4)
        if self.adopted is not None:
            out["adopted_step_s"] = round(self.adopted.step_s, 5)
            out["adopted_cu"] = round(self.adopted.utilization, 4)
            out["adopted_step_error"] = round(rel_error(self.adopted.step_s, self.measured.step_s), 4)
        return out


def check_point(point: GridPoint, report: Mapping[str, Any], layers: int) -> tuple[Check, dict[str, Any] | None]:
    """Compare one `bench lm` report with the predictions; the adopted plan's inputs too, when reported."""
    args = plan_args(report, layers)
    adopted, inputs = None, None
    pr = report["strategies"]["dreamddp"].get("plan_report")
    if pr is not None:
        adopted, inputs = adopted_prediction(pr)
    return Check(point, measured(report), user_prediction(args), adopted, plan_command(args)), inputs


def check_from_row(row: Mapping[str, Any]) -> Check:
    """A check rebuilt from a saved row of ``Check.to_dict`` (plus ``exposed_s`` and ``steps``), as it was."""
    base = float(row["ceiling_step_s"])
    drift = row.get("ceiling_drift")
    exposed, steps = row.get("exposed_s"), row.get("steps")
    m = Measured(
        base,
        float(row["measured_step_s"]),
        float(row["measured_cu"]),
        None if drift is None else base * (1.0 + float(drift)),
        None if exposed is None or not steps else float(exposed) / int(steps),
    )
    adopted = None
    if "adopted_step_s" in row:
        adopted = Prediction(float(row["adopted_step_s"]), float(row["adopted_cu"]))
    plan = Prediction(float(row["plan_step_s"]), float(row["plan_cu"]))
    return Check(GridPoint(**row["point"]), m, plan, adopted, str(row["plan_command"]))


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def _against(value: float | None, predicted: float) -> str:
    return "-" if value is None else f"{value:.3f} ({_pct(rel_error(predicted, value))})"


def markdown_table(checks: Sequence[Check], tolerance: float = TOLERANCE) -> str:
    """One row per point: measured vs predicted step time and utilization, errors, the within flag.

    The flag is on the acceptance's definitions (step time; CU against the ceiling measured before the
    strategy); the columns after it are diagnostics: CU against the ceilings before and after, CU on the
    strategy's own clock, and the adopted plan's own prediction.
    """
    head = (
        "| model | rate | RTT | regions | ceiling s/step (after) | measured s/step | plan s/step | err | "
        f"measured CU | plan CU | err | within {tolerance:.0%} | CU bracketed (err) | CU own clock (err) | "
        "adopted plan s/step (err) |"
    )
    lines = [head, "|---|---|---:|---:|" + "---:|" * 7 + ":---:|---:|---:|---:|"]
    for c in checks:
        p, m = c.point, c.measured
        ceiling = f"{m.ceiling_step_s:.3f}" + ("" if m.ceiling_after_s is None else f" ({m.ceiling_after_s:.3f})")
        adopted = "-"
        if c.adopted is not None:
            adopted = f"{c.adopted.step_s:.3f} ({_pct(rel_error(c.adopted.step_s, m.step_s))})"
        lines.append(
            f"| {p.size} | {p.rate} | {p.rtt_ms:g} ms | {p.regions} | {ceiling} | "
            f"{m.step_s:.3f} | {c.plan.step_s:.3f} | {_pct(c.step_error)} | {m.utilization:.3f} | "
            f"{c.plan.utilization:.3f} | {_pct(c.cu_error)} | {'yes' if c.within(tolerance) else '**no**'} | "
            f"{_against(m.bracketed_utilization, c.plan.utilization)} | "
            f"{_against(m.own_utilization, c.plan.utilization)} | {adopted} |"
        )
    return "\n".join(lines)


def summary(checks: Sequence[Check], tolerance: float = TOLERANCE) -> dict[str, Any]:
    return {
        "points": len(checks),
        "within": sum(c.within(tolerance) for c in checks),
        "tolerance": tolerance,
        "worst_step_error": round(max((c.step_error for c in checks), default=0.0), 4),
        "worst_cu_error": round(max((c.cu_error for c in checks), default=0.0), 4),
        "outside": [c.point.label for c in checks if not c.within(tolerance)],
    }


def target_check(target: float, measured_cu: float, slack: float = 0.05) -> bool:
    """The acceptance rule for a ``plan --target-cu`` recommendation: measured >= target - slack."""
    if not 0.0 < target < 1.0:
        raise ValueError(f"target must be in (0, 1), got {target!r}")
    return measured_cu >= target - slack
