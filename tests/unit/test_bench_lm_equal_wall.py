"""`bench lm`'s held-out loss at equal wall time (each strategy's curve read at the time the quickest took) and at
equal tokens (read after as many tokens as the run that trained on the fewest)."""

from __future__ import annotations

from typing import Any

import pytest

from dreamp2p.devtools.bench.lm.report import at_equal_tokens, at_equal_wall, loss_at_tokens, tokens_curve


@pytest.mark.parametrize(
    ("curves", "want"),
    [
        # the quicker run ends at 10 s; the slower one is read at its last point no later than that
        (
            {"a": [[10, 5.0, 3.0], [20, 10.0, 2.5]], "b": [[10, 8.0, 3.1], [20, 16.0, 2.4]]},
            {"a": [10.0, 2.5], "b": [10.0, 3.1]},
        ),
        # a run with no point that early has no loss at that time
        ({"a": [[10, 2.0, 3.0]], "b": [[10, 4.0, 2.9]]}, {"a": [2.0, 3.0], "b": [2.0, None]}),
    ],
)
def test_each_strategy_is_read_at_the_quickest_ones_end(
    curves: dict[str, list[list[float]]], want: dict[str, list[float | None]]
) -> None:
    rows: dict[str, dict[str, Any]] = {name: {} for name in curves}
    at_equal_wall(rows, curves, list(curves))
    assert {name: row["heldout_loss_at_equal_wall"] for name, row in rows.items()} == want


def test_the_reference_time_comes_only_from_the_named_strategies() -> None:
    curves = {"none": [[10, 1.0, 3.5]], "a": [[10, 5.0, 3.0]]}
    rows: dict[str, dict[str, Any]] = {"none": {}, "a": {}}
    at_equal_wall(rows, curves, ["a"])  # the compute-only run is not a strategy to compare at
    assert rows["a"]["heldout_loss_at_equal_wall"] == [5.0, 3.0]
    assert rows["none"]["heldout_loss_at_equal_wall"] == [5.0, 3.5]


@pytest.mark.parametrize(
    ("tokens", "want"),
    [
        (100, 3.0),  # a point
        (150, 2.75),  # halfway between two points
        (300, 2.0),  # the last point
        (350, None),  # past the curve's end
        (50, None),  # before its first point
        (200, 2.5),  # a repeated point (a region that passed clock steps without training) reads as itself
    ],
)
def test_a_curve_is_read_at_a_token_count_between_its_points(tokens: float, want: float | None) -> None:
    curve = [[100, 3.0], [200, 2.5], [200, 2.5], [300, 2.0]]
    got = loss_at_tokens(curve, tokens)
    assert got == (pytest.approx(want) if want is not None else None)


def test_a_curve_by_tokens_sums_each_regions_local_steps() -> None:
    """A fast region of 4 steps per clock step's 2 and a slow one that trained at every other clock step."""
    res = [
        {"curve": [[2, 1.0, 3.0], [4, 2.0, 2.0]], "curve_local_steps": [2, 4], "tokens": 400, "local_steps": 4},
        {"curve": [[2, 1.0, 3.2], [4, 2.0, 2.2]], "curve_local_steps": [1, 2], "tokens": 200, "local_steps": 2},
    ]
    assert tokens_curve(res) == [[300, pytest.approx(3.1)], [600, pytest.approx(2.1)]]
    assert tokens_curve([{k: v for k, v in r.items() if k != "curve_local_steps"} for r in res]) is None


def test_every_row_is_read_at_the_fewest_tokens_a_run_trained_on() -> None:
    rows: dict[str, dict[str, Any]] = {
        "lockstep": {"curve_tokens": [[200, 3.0], [400, 2.6], [800, 2.2]]},
        "timed": {"curve_tokens": [[300, 2.9], [600, 2.4]]},
        "old": {},  # a row without the curve (results of another harness) is left alone
    }
    at_equal_tokens(rows, ["lockstep", "timed", "old"])
    assert rows["lockstep"]["heldout_loss_at_equal_tokens"] == [600, pytest.approx(2.4)]
    assert rows["timed"]["heldout_loss_at_equal_tokens"] == [600, 2.4]
    assert "heldout_loss_at_equal_tokens" not in rows["old"]
