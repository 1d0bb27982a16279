"""`bench plancheck`'s pure part: grid, predictions from a bench lm report, comparison and table."""

from __future__ import annotations

import json
import math
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest

from dreamp2p.cli import main
from dreamp2p.devtools import plancheck_table as pt
from dreamp2p.schedule.cost import LayerCost, LinkModel
from dreamp2p.schedule.dreamddp import plan_dreamddp
from dreamp2p.schedule.linkcodec import wire_ratio

PARAMS = 3_323_648
LAYERS = 28


def report(
    ceiling_sps: float = 3.0,
    sps: float = 2.7,
    rate: str = "20mbit",
    rtt_ms: float = 0.0,
    regions: int = 2,
    period: int = 20,
    plan_report: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The fields of a `bench lm` report that plancheck reads."""
    row: dict[str, Any] = {"steps_per_s": sps, "compute_utilization": sps / ceiling_sps}
    if plan_report is not None:
        row["plan_report"] = plan_report
    return {
        "regions": regions,
        "rate": rate,
        "rtt_ms": rtt_ms,
        "period": period,
        "params": PARAMS,
        "ceiling": {"steps_per_s": ceiling_sps},
        "strategies": {"dreamddp": row},
    }


@pytest.mark.parametrize(
    ("size", "rate", "rtt_ms", "regions", "match"),
    [
        ("huge", "20mbit", 0.0, 2, "model size"),
        ("small", "20mb", 0.0, 2, "link rate"),
        ("small", "20mbit", -1.0, 2, "rtt_ms"),
        ("small", "20mbit", math.nan, 2, "rtt_ms"),
        ("small", "20mbit", 0.0, 1, "regions"),
    ],
)
def test_grid_point_refuses_bad_input(size: str, rate: str, rtt_ms: float, regions: int, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        pt.GridPoint(size, rate, rtt_ms, regions)


def test_grid_is_the_product_in_order() -> None:
    points = pt.grid(["small", "large"], ["10mbit", "20mbit"], ["0ms", "80ms"], [2, 3])
    assert len(points) == 16
    assert points[0] == pt.GridPoint("small", "10mbit", 0.0, 2)
    assert points[1] == pt.GridPoint("small", "10mbit", 0.0, 3)
    assert points[2].rtt_ms == pytest.approx(80.0)
    assert points[-1] == pt.GridPoint("large", "20mbit", 80.0, 3)


@pytest.mark.parametrize(
    ("sizes", "rates", "match"),
    [([], ["20mbit"], "empty grid"), (["small"], ["20mbit", "20mbit"], "repeats")],
)
def test_grid_refuses_empty_and_repeated(sizes: list[str], rates: list[str], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        pt.grid(sizes, rates, ["0ms"], [2])


def test_measured_is_read_against_the_same_runs_ceiling() -> None:
    m = pt.measured(report(ceiling_sps=4.0, sps=3.0))
    assert m.ceiling_step_s == pytest.approx(0.25)
    assert m.step_s == pytest.approx(1 / 3)
    assert m.utilization == pytest.approx(0.75)


def test_measured_reads_the_ceiling_measured_again_as_drift() -> None:
    r = report(ceiling_sps=4.0, sps=3.0)
    assert pt.measured(r).drift is None
    r["ceiling"]["after_steps_per_s"] = 3.2
    m = pt.measured(r)
    assert m.ceiling_after_s == pytest.approx(0.3125)
    assert m.drift == pytest.approx(0.25)  # 25% slower after: the host got busier during the point
    assert m.utilization == pytest.approx(0.75)  # still against the ceiling of the same run
    check, _ = pt.check_point(pt.GridPoint("small", "20mbit", 0.0, 2), r, LAYERS)
    row = check.to_dict()
    assert row["ceiling_drift"] == pytest.approx(0.25)
    assert row["bracketed_cu"] == pytest.approx((0.25 + 0.3125) / 2 * 3.0, abs=1e-4)
    assert "| 0.250 (0.312) |" in pt.markdown_table([check]).splitlines()[2]


def test_own_clock_utilization_counts_only_the_exposed_wait() -> None:
    r = report(ceiling_sps=4.0, sps=2.0)  # half the ceiling's pace...
    r["steps"] = 100
    r["strategies"]["dreamddp"]["exposed_s"] = 2.5  # ...but only 25 ms of each 500 ms step waited on the link
    m = pt.measured(r)
    assert m.utilization == pytest.approx(0.5)
    assert m.own_utilization == pytest.approx(0.95)
    check, _ = pt.check_point(pt.GridPoint("small", "20mbit", 0.0, 2), r, LAYERS)
    assert check.to_dict()["own_cu_error"] == pytest.approx(abs(check.plan.utilization - 0.95) / 0.95, abs=1e-4)


def test_measured_refuses_a_missing_row_or_zero_rate() -> None:
    r = report()
    r["strategies"] = {"streaming": r["strategies"]["dreamddp"]}
    with pytest.raises(ValueError, match="no 'dreamddp' row"):
        pt.measured(r)
    with pytest.raises(ValueError, match="> 0"):
        pt.measured(report(sps=0.0))


def test_plan_args_are_what_a_user_gives_for_dreamddp_defaults() -> None:
    args = pt.plan_args(report(ceiling_sps=2.5, rtt_ms=80.0, regions=3, period=20), LAYERS)
    assert args == {
        "params": PARAMS,
        "layers": LAYERS,
        "step-time": 0.4,
        "peers": 3,
        "link": "20mbit",
        "rtt": "80ms",
        "period": 20,
        "max-delay": 19,
        "codec": "int4",  # the pseudo-gradients' codec, which a run's planner prices its syncs at
    }
    assert pt.plan_command(args).startswith("dreamp2p plan --params 3323648 --layers 28 --step-time 0.4 ")


@pytest.mark.parametrize(("rate", "rtt"), [("20mbit", "0ms"), ("10mbit", "80ms"), ("1mbit", "0ms")])
def test_user_prediction_is_what_dreamp2p_plan_prints(rate: str, rtt: str, capsys: pytest.CaptureFixture[str]) -> None:
    args = pt.plan_args(report(rate=rate, rtt_ms=float(rtt[:-2])), LAYERS)
    pred = pt.user_prediction(args)
    flags = [x for k, v in args.items() for x in (f"--{k}", str(v))]
    assert main(["plan", *flags, "--json"]) == 0
    cli = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["predictions"]["dreamddp"]
    assert pred.step_s == pytest.approx(cli["step_time_s"])
    assert pred.utilization == pytest.approx(cli["compute_utilization"])


def test_user_prediction_falls_with_the_link() -> None:
    fast = pt.user_prediction(pt.plan_args(report(rate="10gbit"), LAYERS))
    slow = pt.user_prediction(pt.plan_args(report(rate="1mbit"), LAYERS))
    # nothing exposed on 10 Gbit/s: the step is compute plus the round cost of 2 staggered groups per period
    assert fast.step_s == pytest.approx(1 / 3.0 + pt.RUN_DEFAULTS.round_cost_s * 2 / 20)
    assert fast.utilization > 0.95
    # 1 Mbit/s carries int4's ~1.9 MB of a 20-step period in ~15 s against 6.7 s of compute
    assert slow.utilization < 0.5
    assert slow.step_s > 2 * fast.step_s


def _plan_report(bandwidth_Bps: float, codec: str) -> tuple[dict[str, Any], float]:
    costs = [LayerCost(f"l{i}", 0.003, 0.006, 400_000) for i in range(8)]
    link = LinkModel(bandwidth_Bps, 0.04, 2, wire_ratio(codec))
    plan = plan_dreamddp(costs, link, 10, max_delay=9, bubble_fill=False)
    pr = {
        "plan": plan.to_dict(),
        "costs": [asdict(c) for c in costs],
        "link": {"bandwidth_Bps": bandwidth_Bps, "rtt_s": 0.04, "world": 2, "codec_ratio": 1.0},
        "codec": codec,
    }
    return pr, plan.step_time_s()


@pytest.mark.parametrize(("bandwidth", "codec"), [(2.5e6, "int8"), (1e5, "int8"), (1e5, "fp32")])
def test_adopted_prediction_replays_the_planners_own_figure(bandwidth: float, codec: str) -> None:
    pr, planned = _plan_report(bandwidth, codec)
    pred, inputs = pt.adopted_prediction(pr)
    assert pred.step_s == pytest.approx(planned, rel=1e-9)
    assert pred.utilization == pytest.approx(0.072 / planned, rel=1e-9)
    assert inputs["codec"] == codec
    assert inputs["link_mbit_s"] == pytest.approx(bandwidth * 8 / 1e6)


def test_check_point_uses_the_adopted_plan_when_reported() -> None:
    pr, planned = _plan_report(2.5e6, "int8")
    check, inputs = pt.check_point(pt.GridPoint("small", "20mbit", 0.0, 2), report(plan_report=pr), LAYERS)
    assert check.adopted is not None and check.adopted.step_s == pytest.approx(planned)
    assert inputs is not None and inputs["plan_version"] == 0
    bare, none = pt.check_point(pt.GridPoint("small", "20mbit", 0.0, 2), report(), LAYERS)
    assert bare.adopted is None and none is None
    assert "adopted_step_s" not in bare.to_dict()


@pytest.mark.parametrize(
    ("predicted", "actual", "error"), [(1.0, 1.0, 0.0), (1.15, 1.0, 0.15), (0.8, 1.0, 0.2), (2.0, 0.5, 3.0)]
)
def test_rel_error(predicted: float, actual: float, error: float) -> None:
    assert pt.rel_error(predicted, actual) == pytest.approx(error)


def test_rel_error_refuses_a_zero_measurement() -> None:
    with pytest.raises(ValueError, match="> 0"):
        pt.rel_error(1.0, 0.0)


def _check(measured_step: float, plan_step: float, measured_cu: float, plan_cu: float) -> pt.Check:
    return pt.Check(
        pt.GridPoint("small", "20mbit", 0.0, 2),
        pt.Measured(0.3, measured_step, measured_cu),
        pt.Prediction(plan_step, plan_cu),
        None,
        "dreamp2p plan ...",
    )


@pytest.mark.parametrize(
    ("measured_step", "plan_step", "measured_cu", "plan_cu", "within"),
    [
        (0.33, 0.31, 0.91, 0.97, True),  # both within
        (0.50, 0.31, 0.60, 0.97, False),  # step 38% off
        (0.33, 0.33, 0.80, 0.95, False),  # step right, CU 19% off
        (1.00, 1.14, 0.50, 0.57, True),  # 14% on both
    ],
)
def test_within_needs_both_errors_inside(
    measured_step: float, plan_step: float, measured_cu: float, plan_cu: float, within: bool
) -> None:
    assert _check(measured_step, plan_step, measured_cu, plan_cu).within() is within


def test_table_and_summary_flag_the_points_outside() -> None:
    checks = [_check(0.33, 0.31, 0.91, 0.97), _check(0.50, 0.31, 0.60, 0.97)]
    table = pt.markdown_table(checks).splitlines()
    assert len(table) == 4
    assert all(line.count("|") == 16 for line in table)
    assert "| yes |" in table[2] and "| **no** |" in table[3]
    s = pt.summary(checks)
    assert s["points"] == 2 and s["within"] == 1
    assert s["worst_step_error"] == pytest.approx(0.38)
    assert s["outside"] == ["small 20mbit rtt 0ms x2"]


@pytest.mark.parametrize(("target", "cu", "met"), [(0.9, 0.86, True), (0.9, 0.85, True), (0.9, 0.84, False)])
def test_target_check(target: float, cu: float, met: bool) -> None:
    assert pt.target_check(target, cu) is met


def test_target_check_refuses_a_target_outside_0_1() -> None:
    with pytest.raises(ValueError, match="target"):
        pt.target_check(1.0, 0.9)


def test_cli_rebuilds_the_table_from_saved_reports(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    saved = report(ceiling_sps=3.0, sps=2.9, rate="100mbit")
    saved["bench"] = "lm"
    saved["model"] = {"width": 256, "layers": 4}
    saved["shaping"] = "tbf"
    saved["steps"] = 100
    saved["strategies"]["dreamddp"].update(hidden_fraction=1.0, exposed_s=0.0, mb_sent=13.0, comm_cpu_s=1.0)
    path = tmp_path / "lm.json"
    path.write_text("log line\n" + json.dumps(saved) + "\n")
    assert main(["bench", "plancheck", "--reports", str(path), "--json"]) == 0
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    (row,) = res["rows"]
    assert row["point"] == {"size": "small", "rate": "100mbit", "rtt_ms": 0.0, "regions": 2}
    assert row["plan_command"].startswith(f"dreamp2p plan --params {PARAMS} --layers 28 ")
    assert row["within"] is True and res["summary"]["within"] == 1


def test_a_saved_row_rebuilds_the_same_check() -> None:
    r = report(ceiling_sps=4.0, sps=3.0)
    r["steps"] = 100
    r["ceiling"]["after_steps_per_s"] = 3.5
    r["strategies"]["dreamddp"]["exposed_s"] = 1.0
    check, _ = pt.check_point(pt.GridPoint("small", "20mbit", 0.0, 2), r, LAYERS)
    row = {**check.to_dict(), "exposed_s": 1.0, "steps": 100}
    again = pt.check_from_row(json.loads(json.dumps(row)))
    old, new = check.to_dict(), again.to_dict()
    assert new.keys() == old.keys()
    for key, value in old.items():
        assert new[key] == (pytest.approx(value, abs=2e-4) if isinstance(value, float) else value), key
    assert again.within() == check.within()
    assert pt.markdown_table([again]) == pt.markdown_table([check])
