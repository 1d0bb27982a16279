"""Compute utilization against bandwidth (`dreamp2p plan --table`) and the target search (`--target-cu`)."""

from __future__ import annotations

import itertools
import json
import math
import subprocess
import sys
import tomllib
from typing import Any

import pytest

from dreamp2p.config.sync import SyncConfig
from dreamp2p.schedule.cost import LinkModel
from dreamp2p.schedule.dreamddp import predict
from dreamp2p.schedule.recommend import recommend
from dreamp2p.schedule.utilization import (
    PAPER_TARGETS,
    PAPER_WORKLOADS,
    RATIO_4BIT,
    RATIO_BF16,
    RATIO_FP32,
    Method,
    Network,
    Workload,
    bandwidth_table,
    ceiling,
    needed_bandwidth,
    paper_methods,
    utilization,
)
from dreamp2p.schedule.whatif import uniform_costs

SMALL = Workload("small", 1e8, 8, 0.5)
METHODS = paper_methods()
METHOD_IDS = [m.label for m in METHODS]
CODECS = [("fp32", RATIO_FP32), ("bf16", RATIO_BF16), ("int8", 0.266)]


def _rel_close(a: float, b: float, rel: float = 1e-6) -> bool:
    return abs(a - b) <= rel * max(abs(a), abs(b))


# ------------------------------------------------------------------------------------------------ pure math


@pytest.mark.parametrize("method", METHODS, ids=METHOD_IDS)
@pytest.mark.parametrize("rtt_s", [0.0, 0.05])
@pytest.mark.parametrize("work", [SMALL, *PAPER_WORKLOADS], ids=lambda w: w.name)
def test_more_bandwidth_never_lowers_utilization(method: Method, rtt_s: float, work: Workload) -> None:
    net = Network(3, rtt_s)
    rates = [10.0**e for e in range(5, 14)]  # 100 kB/s .. 10 TB/s
    cus = [utilization(method, work, net, r) for r in rates]
    assert all(0.0 < cu <= 1.0 for cu in cus)
    assert all(b >= a for a, b in itertools.pairwise(cus)), cus
    assert cus[-1] > cus[0]  # and it does matter


@pytest.mark.parametrize("work", PAPER_WORKLOADS, ids=lambda w: w.name)
@pytest.mark.parametrize("target", PAPER_TARGETS)
def test_4bit_streaming_needs_8x_less_bandwidth_than_fp32(work: Workload, target: float) -> None:
    net = Network(2, 0.0)  # latency does not shrink with the payload; without it the ratio is exact
    fp32 = Method("s32", "streaming", RATIO_FP32, 100, overlap=1)
    four = Method("s4", "streaming", RATIO_4BIT, 100, overlap=1)
    b32, b4 = needed_bandwidth(fp32, work, net, target), needed_bandwidth(four, work, net, target)
    assert b32 is not None and b4 is not None
    assert _rel_close(b32, 8 * b4)


@pytest.mark.parametrize("period", [10, 30, 100])
@pytest.mark.parametrize("target", PAPER_TARGETS)
@pytest.mark.parametrize("work", [SMALL, *PAPER_WORKLOADS], ids=lambda w: w.name)
def test_diloco_needs_H_times_less_bandwidth_than_blocking_data_parallel(
    period: int, target: float, work: Workload
) -> None:
    net = Network(4, 0.0)
    blocking = Method("dp", "data-parallel", RATIO_FP32, overlap_backward=False)
    overlapped = Method("dp", "data-parallel", RATIO_FP32)
    diloco = Method("diloco", "diloco", RATIO_FP32, period)
    b_dp, b_ov, b_dl = (needed_bandwidth(m, work, net, target) for m in (blocking, overlapped, diloco))
    assert b_dp is not None and b_ov is not None and b_dl is not None
    assert _rel_close(b_dp, period * b_dl)
    # pipelining gradients over the backward pass helps data-parallel, so DiLoCo's edge is at most H
    assert b_ov < b_dp


@pytest.mark.parametrize("method", METHODS, ids=METHOD_IDS)
@pytest.mark.parametrize("target", [*PAPER_TARGETS, 0.3, 0.999])
@pytest.mark.parametrize("rtt_s", [0.0, 0.02])
@pytest.mark.parametrize("work", [SMALL, PAPER_WORKLOADS[0], PAPER_WORKLOADS[2]], ids=lambda w: w.name)
def test_needed_bandwidth_reaches_the_target_when_fed_back(
    method: Method, target: float, rtt_s: float, work: Workload
) -> None:
    net = Network(2, rtt_s)
    bw = needed_bandwidth(method, work, net, target)
    if bw is None:
        assert ceiling(method, work, net) < target
        return
    assert utilization(method, work, net, bw) >= target
    # and it is the least such bandwidth, up to the bisection's precision
    assert utilization(method, work, net, bw * (1 - 1e-6)) < target


def test_latency_alone_can_make_a_target_unreachable() -> None:
    # every step's all-reduce pays 2(N-1) * RTT/2 = 1 s of latency against 0.1 s of compute
    net = Network(2, 1.0)
    dp = Method("dp", "data-parallel", RATIO_BF16)
    work = PAPER_WORKLOADS[0]
    assert ceiling(dp, work, net) == pytest.approx(0.1 / 1.1, rel=1e-6)
    assert needed_bandwidth(dp, work, net, 0.5) is None
    assert needed_bandwidth(dp, work, net, 0.05) is not None


@pytest.mark.parametrize(
    ("layers", "period", "delay", "rtt_s", "rate_Bps", "ratio"),
    [
        (8, 10, 9, 0.0, 1e7, RATIO_FP32),
        (8, 10, 9, 0.08, 1e7, RATIO_FP32),
        (8, 10, 3, 0.08, 1e8, RATIO_BF16),
        (6, 5, 0, 0.02, 1e8, RATIO_FP32),
        (12, 4, 3, 0.08, 3e6, 0.266),
        (4, 1, 0, 0.0, 1e9, RATIO_FP32),
    ],
)
def test_the_dreamddp_closed_form_is_conservative_against_the_planner(
    layers: int, period: int, delay: int, rtt_s: float, rate_Bps: float, ratio: float
) -> None:
    work, net = Workload("w", 1e8, layers, 0.5), Network(3, rtt_s)
    method = Method("d", "dreamddp", ratio, period, overlap=delay)
    link = net.link(rate_Bps, ratio)
    planned = predict(uniform_costs(1e8, layers, 0.5), link, period, "dreamddp", max_delay=delay, bubble_fill=False)
    assert planned["compute_utilization"] >= utilization(method, work, net, rate_Bps) - 1e-12


@pytest.mark.parametrize("target", [0.5, 0.9, 0.99])
def test_the_needed_dreamddp_bandwidth_is_enough_for_the_planner(target: float) -> None:
    work, net = Workload("w", 1e8, 8, 0.5), Network(4, 0.05)
    method = Method("d", "dreamddp", RATIO_FP32, 10, overlap=9)
    bw = needed_bandwidth(method, work, net, target)
    assert bw is not None
    planned = predict(uniform_costs(1e8, 8, 0.5), net.link(bw, 1.0), 10, "dreamddp", max_delay=9, bubble_fill=False)
    assert planned["compute_utilization"] >= target


def test_the_default_table_uses_the_papers_models_and_fragments() -> None:
    rows = bandwidth_table()
    assert len(rows) == len(PAPER_WORKLOADS) * len(METHODS)
    assert [(w.name, w.layers, w.step_time_s) for w in PAPER_WORKLOADS] == [
        ("1B", 24, 0.1),
        ("10B", 48, 0.8),
        ("100B", 108, 4.9),
    ]
    streaming = {r.model: r.fragments for r in rows if r.kind == "streaming"}
    assert streaming == {"1B": 8, "10B": 16, "100B": 36}  # fragments of 3 layers, as in the paper
    for row in rows:
        assert len(row.gbit_s) == len(PAPER_TARGETS)
        values = [g for g in row.gbit_s if g is not None]
        assert len(values) == len(PAPER_TARGETS)  # no latency in the default table: every target is reachable
        assert all(b >= a for a, b in itertools.pairwise(values)), row
    by = {(r.model, r.method): r for r in rows}
    for model in ("1B", "10B", "100B"):
        # the point of the table: local methods need orders of magnitude less than data-parallel
        dp = by[(model, "data-parallel bf16")].gbit_s[3]
        stream4 = by[(model, "Streaming DiLoCo 4-bit H=100 tau=1")].gbit_s[3]
        assert dp is not None and stream4 is not None and dp > 50 * stream4


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (lambda: needed_bandwidth(METHODS[0], SMALL, Network(), 1.0), "target utilization must be a number in (0, 1)"),
        (lambda: needed_bandwidth(METHODS[0], SMALL, Network(), 0.0), "target utilization must be a number in (0, 1)"),
        (lambda: Method("x", "gossip"), "unknown method kind 'gossip'"),
        (lambda: Method("x", "dreamddp", period=4, overlap=4), "must be less than the period (4)"),
        (lambda: Workload("x", 0, 4, 1.0), "params must be a finite number"),
        (lambda: Network(0), "peers must be an int >= 1"),
    ],
)
def test_bad_inputs_are_refused(bad: Any, message: str) -> None:
    with pytest.raises(ValueError) as info:
        bad()
    assert message in str(info.value)


# ------------------------------------------------------------------------------------------- target search


def _all_settings(costs: list[Any], link: LinkModel, periods: tuple[int, ...]) -> list[tuple[int, int, int, float]]:
    """(period, codec rank, delay, utilization) of every grid setting, planned exhaustively.

    The grid's delays are 0, the powers of two below H - 1, and H - 1 (the search does not try 3, 5, 6, ...).
    """
    out = []
    for rank, (_, ratio) in enumerate(CODECS):
        lk = LinkModel(link.bandwidth_Bps, link.rtt_s, link.world, ratio)
        for H in periods:
            for d in sorted({0, H - 1} | {2**i for i in range(H) if 2**i < H - 1}):
                cu = predict(costs, lk, H, "dreamddp", max_delay=d, bubble_fill=False)["compute_utilization"]
                out.append((H, rank, d, cu))
    return out


@pytest.mark.parametrize(
    ("rate_Bps", "rtt_s", "target"),
    # chosen to land on every codec, several periods and delays: fp32 1/0, fp32 2/1, bf16 1/0, bf16 2/1, int8 2/1,
    # int8 4/1, int8 8/1 (period first: a slower link takes a smaller codec before a longer period)
    [
        (2e9, 0.0, 0.95),
        (3e8, 0.05, 0.9),
        (1e9, 0.0, 0.95),
        (1e8, 0.0, 0.9),
        (1e8, 0.05, 0.9),
        (5e7, 0.05, 0.95),
        (2e7, 0.05, 0.9),
        (1e7, 0.0, 0.6),
    ],
)
def test_recommend_meets_the_target_and_takes_the_preferred_setting(
    rate_Bps: float, rtt_s: float, target: float
) -> None:
    costs = uniform_costs(2e7, 6, 0.3)
    link = LinkModel(rate_Bps, rtt_s, 3)
    periods = (1, 2, 4, 8)
    rec = recommend(costs, link, target, CODECS, periods)
    assert rec.best is not None, rec.message
    best = rec.best
    ratio = dict(CODECS)[best.codec]
    lk = LinkModel(rate_Bps, rtt_s, 3, ratio)
    again = predict(costs, lk, best.period, "dreamddp", max_delay=best.delay, bubble_fill=False)
    assert again["compute_utilization"] >= target
    assert again["compute_utilization"] == pytest.approx(best.utilization, rel=1e-9)
    assert 1 <= best.fragments <= 6 and best.delay < best.period
    # the first setting in preference order (smallest period, codecs in the order given, smallest delay)
    reaching = [s for s in _all_settings(costs, link, periods) if s[3] >= target]
    H, rank, d, _ = min(reaching)
    assert (CODECS[rank][0], H, d) == (best.codec, best.period, best.delay)


def test_recommend_takes_a_smaller_codec_before_a_longer_period() -> None:
    # int8 reaches the target at period 2; fp32 only at 8: the period is what moves the loss
    rec = recommend(uniform_costs(2e7, 6, 0.3), LinkModel(5e7, 0.0, 3), 0.9, CODECS, (1, 2, 4, 8))
    assert rec.best is not None
    assert (rec.best.codec, rec.best.period) == ("int8", 2)
    fp32 = recommend(uniform_costs(2e7, 6, 0.3), LinkModel(5e7, 0.0, 3), 0.9, CODECS[:1], (1, 2, 4, 8))
    assert fp32.best is not None and fp32.best.period > 2


def test_recommend_prefers_a_fast_link_synced_every_step() -> None:
    rec = recommend(uniform_costs(1e6, 4, 0.5), LinkModel(1.25e9, 0.0, 2), 0.95, CODECS)
    assert rec.best is not None
    assert (rec.best.codec, rec.best.period, rec.best.delay) == ("fp32", 1, 0)


def test_recommend_reports_the_bandwidth_it_would_need() -> None:
    costs = uniform_costs(1e9, 8, 0.2)
    link = LinkModel(1.25e6, 0.02, 4)  # 10 Mbit/s for a 4 GB model
    rec = recommend(costs, link, 0.95, CODECS, (1, 10, 20))
    assert rec.best is None
    assert rec.needed_Bps is not None and rec.needed_Bps > link.bandwidth_Bps
    assert "no setting in the grid reaches 0.95" in rec.message
    assert "codec int8, period 20, max delay 19 needs about" in rec.message
    # the closed-form estimate is conservative: the planner does reach the target at that bandwidth
    lk = LinkModel(rec.needed_Bps, 0.02, 4, 0.266)
    assert predict(costs, lk, 20, "dreamddp", max_delay=19, bubble_fill=False)["compute_utilization"] >= 0.95


def test_recommend_says_when_latency_alone_forbids_the_target() -> None:
    rec = recommend(uniform_costs(1e6, 4, 0.01), LinkModel(1.25e8, 5.0, 2), 0.99, CODECS)
    assert rec.best is None and rec.needed_Bps is None
    assert "even unlimited bandwidth cannot reach it at this RTT" in rec.message


def test_recommend_refuses_bad_targets() -> None:
    for target in (0.0, 1.0, 1.2, -0.5, math.nan):
        with pytest.raises(ValueError, match="target utilization must be a number in"):
            recommend(uniform_costs(1e6, 4, 0.5), LinkModel(1e8, 0.0, 2), target, CODECS)


# --------------------------------------------------------------------------------------------------- the CLI


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "dreamp2p.cli", "plan", *args], capture_output=True, text=True, timeout=120, check=False
    )


def test_cli_table_json_is_one_line_with_every_model_and_method() -> None:
    proc = _cli("--table", "--json")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1
    table = json.loads(lines[0])["table"]
    assert table["targets"] == list(PAPER_TARGETS) and table["period"] == 100 and table["peers"] == 2
    assert "arXiv 2501.18512" in table["source"]
    rows = table["rows"]
    assert {r["model"] for r in rows} == {"1B", "10B", "100B"}
    assert len(rows) == 3 * len(METHODS)
    by = {(r["model"], r["method"]): r["gbit_s"] for r in rows}
    # no latency in the default table: Streaming DiLoCo's and DreamDDP's bounds are the link's throughput,
    # so 4 bits need exactly 1/8 of fp32's bandwidth
    pairs = [
        ("Streaming DiLoCo fp32 H=100 tau=1", "Streaming DiLoCo 4-bit H=100 tau=1"),
        ("DreamDDP fp32 H=100 d<=99", "DreamDDP 4-bit H=100 d<=99"),
    ]
    for model in ("1B", "10B", "100B"):
        for fp32, four in pairs:
            assert all(_rel_close(a, 8 * b, 1e-3) for a, b in zip(by[(model, fp32)], by[(model, four)], strict=True))
        for method in METHOD_IDS:
            values = by[(model, method)]
            assert all(b >= a for a, b in itertools.pairwise(values))


def test_cli_table_is_readable_and_ends_with_json() -> None:
    proc = _cli("--table", "--rtt", "80ms", "--peers", "4")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert "Streaming DiLoCo (Douillard et al. 2025, arXiv 2501.18512), Table 4" in proc.stdout
    assert any(line.split()[:4] == ["model", "layers", "step", "s"] for line in lines)
    table = json.loads(lines[-1])["table"]
    assert table["rtt_s"] == pytest.approx(0.08) and table["peers"] == 4
    # 80 ms of latency per hop chain: data-parallel cannot reach 99% on the 1B model at any bandwidth
    dp = next(r for r in table["rows"] if r["model"] == "1B" and r["method"] == "data-parallel fp32")
    assert dp["gbit_s"][-1] is None


def test_cli_target_cu_recommends_a_setting_that_reaches_it() -> None:
    model = ["--params", "1e8", "--layers", "8", "--step-time", "0.5", "--peers", "3", "--rtt", "40ms"]
    proc = _cli(*model, "--link", "1gbit", "--target-cu", "0.9", "--json")
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["reached"] is True and result["target_cu"] == 0.9
    rec = result["recommendation"]
    assert set(rec) == {
        "codec",
        "period",
        "delay",
        "fragments",
        "utilization",
        "step_time_s",
        "bytes_per_step",
        "link_busy",
    }
    assert rec["link_busy"] <= 0.25  # the run's codec_link_budget
    assert rec["utilization"] >= 0.9 and rec["delay"] < rec["period"]
    # unpinned, the search is over what a run sends by default: 4-bit pseudo-gradients, 2-bit or sparse where
    # the link cannot carry 4 (this one can, at the smallest period reached)
    assert result["searched"]["codecs"] == ["int4", "int2", "topk"] and rec["codec"] == "int4"
    # the delay cap stays the run's default: the run's planner takes the delays its measured link needs
    assert result["sync"] == {"strategy": "dreamddp", "period": rec["period"], "delta_codec": "int4"}


def test_cli_target_cu_pins_the_given_dimensions_and_reads_readably() -> None:
    model = ["--params", "1e8", "--layers", "8", "--step-time", "0.5"]
    proc = _cli(*model, "--link", "1gbit", "--target-cu", "0.9", "--codec", "bf16", "--period", "20")
    assert proc.returncode == 0, proc.stderr
    assert "recommended: codec bf16 (parameters), period 20, max delay" in proc.stdout
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["searched"]["codecs"] == ["bf16"] and result["searched"]["periods"] == [20]
    assert result["recommendation"]["utilization"] >= 0.9
    # the settings as a node's TOML: a 16-bit codec averages the parameters, no pseudo-gradients
    lines = proc.stdout.splitlines()
    table = lines[lines.index("[sync]") : -1]
    sync = tomllib.loads("\n".join(table))["sync"]
    assert sync == result["sync"]
    assert sync["delta_codec"] == "" and sync["plan_codecs"] == ["bf16"] and sync["period"] == 20
    assert "max_delay" not in sync and SyncConfig.from_dict(sync).delay_cap == 19 >= result["recommendation"]["delay"]
    # a pinned cap is kept (below the period)
    pinned = _cli(*model, "--link", "1gbit", "--target-cu", "0.9", "--period", "20", "--max-delay", "3", "--json")
    assert pinned.returncode == 0, pinned.stderr
    got = json.loads(pinned.stdout.strip().splitlines()[-1])
    assert got["sync"]["max_delay"] == 3 and got["recommendation"]["delay"] <= 3


def test_cli_target_cu_unreachable_says_what_bandwidth_it_needs() -> None:
    model = ["--params", "1e9", "--layers", "8", "--step-time", "0.2", "--peers", "4"]
    proc = _cli(*model, "--link", "10mbit", "--rtt", "20ms", "--target-cu", "0.95")
    assert proc.returncode == 0, proc.stderr
    assert "no setting in the grid reaches 0.95" in proc.stdout
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["reached"] is False and result["recommendation"] is None
    assert result["needed_gbit_s"] > 0.01  # more than the 10 Mbit/s link has
    assert "period 100, max delay 99" in result["needed_for"]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--target-cu", "1.5"], "argument --target-cu: must be a compute utilization in (0, 1), e.g. 0.95, got 1.5"),
        (["--target-cu", "1"], "argument --target-cu: must be a compute utilization in (0, 1)"),
        (["--target-cu", "0"], "argument --target-cu: must be a compute utilization in (0, 1)"),
        (["--target-cu", "-0.5"], "argument --target-cu: must be a compute utilization in (0, 1)"),
        (["--target-cu", "high"], "argument --target-cu: expected a number, got 'high'"),
        (["--target-cu", "0.9", "--table"], "not allowed with argument"),
    ],
)
def test_cli_refuses_a_bad_target_with_a_usage_error(extra: list[str], message: str) -> None:
    proc = _cli("--params", "1e8", "--layers", "8", "--step-time", "0.5", *extra)
    assert proc.returncode == 2
    assert "dreamp2p plan: error: " in proc.stderr and message in proc.stderr, proc.stderr
    assert proc.stdout == ""


def test_cli_plan_without_a_model_asks_for_one_or_the_table() -> None:
    proc = _cli("--link", "1gbit")
    assert proc.returncode == 2
    assert "the following arguments are required: --params, --layers, --step-time (or use --table)" in proc.stderr


def test_cli_takes_each_regions_step_time_and_plans_for_the_slowest() -> None:
    model = ["--params", "1e8", "--layers", "8", "--link", "1gbit"]
    one = json.loads(_cli(*model, "--step-time", "0.6", "--json").stdout.strip().splitlines()[-1])
    proc = _cli(*model, "--step-time", "0.3,0.6,0.2")
    assert proc.returncode == 0, proc.stderr
    assert "in lockstep every region steps at the slowest's 0.6 s (idle per region: 50%, 0%, 67%" in proc.stdout
    mixed = json.loads(proc.stdout.strip().splitlines()[-1])
    # the plan is the one for three regions at the slowest's pace
    three = json.loads(_cli(*model, "--step-time", "0.6", "--peers", "3", "--json").stdout.strip().splitlines()[-1])
    assert mixed["predictions"] == three["predictions"] != one["predictions"]
    lock = mixed["lockstep"]
    assert lock["region_step_times_s"] == [0.3, 0.6, 0.2] and lock["step_time_s"] == 0.6
    assert lock["idle_fraction"] == pytest.approx([0.5, 0.0, 2 / 3], abs=1e-6)
    # 3 regions at 1/0.6 steps/s each, against 1/0.3 + 1/0.6 + 1/0.2 alone
    assert lock["of_solo_sum"] == pytest.approx((3 / 0.6) / (1 / 0.3 + 1 / 0.6 + 1 / 0.2), abs=1e-6)
    refused = _cli(*model, "--step-time", "0.3,0.6", "--peers", "4")
    assert refused.returncode == 2 and "--step-time gives 2 regions' step times but --peers says 4" in refused.stderr
    bad = _cli(*model, "--step-time", "0.3,-1")
    assert bad.returncode == 2 and "must be a finite number > 0, got -1" in bad.stderr
