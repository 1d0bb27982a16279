"""`bench lm`'s held-out loss at equal wall time: each strategy's curve read at the time the quickest took."""

from __future__ import annotations

from typing import Any

import pytest

from dreamp2p.devtools.bench.lm.report import at_equal_wall


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
