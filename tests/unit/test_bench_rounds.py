"""`bench lm --rounds`: rotated orders, combined rows, paired differences and their 95% intervals."""

from __future__ import annotations

import math

import pytest

from dreamp2p.devtools.bench.lm.rounds import combine_rows, mean_curve, paired, round_order, t95


@pytest.mark.parametrize(
    ("k", "order"),
    [
        (0, ["a", "b", "c"]),
        (1, ["b", "c", "a"]),
        (2, ["c", "a", "b"]),
        (3, ["a", "b", "c"]),  # the rotation repeats after len(names) rounds
        (7, ["b", "c", "a"]),
    ],
)
def test_round_order_rotates(k: int, order: list[str]) -> None:
    assert round_order(["a", "b", "c"], k) == order


def test_every_strategy_runs_at_every_position_once_per_cycle() -> None:
    names = ["none", "dreamddp", "streaming", "diloco"]
    for pos in range(len(names)):
        assert sorted(round_order(names, k)[pos] for k in range(len(names))) == sorted(names)


@pytest.mark.parametrize(("df", "q"), [(1, 12.706), (2, 4.303), (4, 2.776), (9, 2.262), (30, 2.042), (31, 1.96)])
def test_t95(df: int, q: float) -> None:
    assert t95(df) == q


@pytest.mark.parametrize("df", [0, -1])
def test_t95_refuses_no_degrees_of_freedom(df: int) -> None:
    with pytest.raises(ValueError, match="degrees of freedom"):
        t95(df)


@pytest.mark.parametrize(
    ("a", "b", "verdict", "ahead_in"),
    [
        ([0.98, 0.97, 0.99], [0.95, 0.94, 0.955], "ahead", 3),  # a steady 3-point lead
        ([0.95, 0.94, 0.955], [0.98, 0.97, 0.99], "behind", 0),
        ([0.98, 0.95, 0.97, 0.96], [0.96, 0.97, 0.96, 0.97], "tie", 2),  # leads that swap
        ([0.99, 0.90], [0.95, 0.94], "tie", 1),  # 2 rounds: t with 1 df is wide
    ],
)
def test_paired_verdict(a: list[float], b: list[float], verdict: str, ahead_in: int) -> None:
    d = paired(a, b)
    assert d["verdict"] == verdict
    assert d["ahead_in"] == ahead_in
    assert d["rounds"] == len(a)
    diffs = [x - y for x, y in zip(a, b, strict=True)]
    assert d["mean"] == pytest.approx(sum(diffs) / len(diffs))
    lo, hi = d["ci95"]
    assert lo < d["mean"] < hi
    assert hi - d["mean"] == pytest.approx(t95(len(a) - 1) * d["stderr"])


def test_paired_interval_by_hand() -> None:
    # diffs 1, 2, 3: mean 2, sd 1, se 1/sqrt(3), t(2) = 4.303
    d = paired([2.0, 4.0, 6.0], [1.0, 2.0, 3.0])
    assert d["stderr"] == pytest.approx(1 / math.sqrt(3))
    assert d["ci95"] == pytest.approx([2 - 4.303 / math.sqrt(3), 2 + 4.303 / math.sqrt(3)])
    assert d["verdict"] == "tie"  # the lower end is -0.48: three rounds cannot tell


def test_one_round_has_no_interval() -> None:
    d = paired([0.98], [0.95])
    assert d["verdict"] == "one round"
    assert d["ci95"] is None and d["stderr"] is None
    assert d["mean"] == pytest.approx(0.03)


@pytest.mark.parametrize(
    ("a", "b", "match"),
    [
        ([], [], "same number of rounds"),
        ([1.0, 2.0], [1.0], "same number of rounds"),
        ([1.0, float("nan")], [1.0, 1.0], "finite"),
    ],
)
def test_paired_refuses_bad_input(a: list[float], b: list[float], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        paired(a, b)


def test_mean_curve_is_pointwise() -> None:
    c1 = [[10, 1.0, 3.0], [20, 2.0, 2.0]]
    c2 = [[10, 3.0, 2.0], [20, 4.0, 1.0]]
    assert mean_curve([c1, c2]) == [[10, 2.0, 2.5], [20, 3.0, 1.5]]


@pytest.mark.parametrize(
    ("curves", "match"),
    [
        ([], "no curves"),
        ([[[10, 1.0, 3.0]], [[11, 1.0, 3.0]]], "same steps"),
        ([[[10, 1.0, 3.0]], [[10, 1.0, 3.0], [20, 2.0, 2.0]]], "shorter|longer"),
    ],
)
def test_mean_curve_refuses_curves_that_do_not_line_up(curves: list[list[list[float]]], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        mean_curve(curves)


def test_combine_rows_averages_the_figures_and_keeps_each_round() -> None:
    r1 = {"steps_per_s": 3.0, "compute_utilization": 0.9, "heldout_loss": 2.5, "mb_sent": 10.0, "plan": "p1"}
    r2 = {"steps_per_s": 4.0, "compute_utilization": 1.0, "heldout_loss": 2.3, "mb_sent": 12.0, "plan": "p2"}
    row = combine_rows([r1, r2])
    assert row["steps_per_s"] == pytest.approx(3.5)
    assert row["compute_utilization"] == pytest.approx(0.95)
    assert row["heldout_loss"] == pytest.approx(2.4)
    assert row["mb_sent"] == pytest.approx(11.0)
    assert row["plan"] == "p1"  # not a figure: the first round's
    assert row["runs"] == [
        {"steps_per_s": 3.0, "compute_utilization": 0.9, "heldout_loss": 2.5, "mb_sent": 10.0},
        {"steps_per_s": 4.0, "compute_utilization": 1.0, "heldout_loss": 2.3, "mb_sent": 12.0},
    ]


def test_combine_rows_skips_missing_figures() -> None:
    row = combine_rows([{"steps_per_s": 3.0, "exposed_s": None}, {"steps_per_s": 5.0, "exposed_s": 1.0}])
    assert row["steps_per_s"] == pytest.approx(4.0)
    assert row["exposed_s"] == 1.0  # the one round that had it


def test_combine_rows_refuses_nothing() -> None:
    with pytest.raises(ValueError, match="no rows"):
        combine_rows([])
