"""The pace filter: a windowed maximum of delivery-rate samples that ignores what says nothing."""

from __future__ import annotations

import math

import pytest

from dreamp2p.schedule.pace import PaceFilter


@pytest.mark.parametrize(
    ("samples", "window", "want"),
    [
        ([], 4, math.nan),
        ([5.0], 4, 5.0),
        ([8.0, 3.6, 3.9, 4.3], 4, 8.0),  # slow rounds under CPU load do not pull the estimate down
        ([8.0, 3.6, 3.9, 4.3, 4.0], 4, 4.3),  # a slowdown shows once the window holds only later samples
        ([1.0, 2.0, 3.0], 1, 3.0),
        ([2.0, math.nan, math.inf, -1.0, 0.0], 4, 2.0),  # not samples of a link
        ([math.nan], 4, math.nan),
    ],
)
def test_pace_is_the_best_of_the_last_window_samples(samples: list[float], window: int, want: float) -> None:
    f = PaceFilter(window)
    for s in samples:
        f.add(s)
    assert (math.isnan(f.rate) and math.isnan(want)) or f.rate == want


def test_pace_window_must_hold_a_sample() -> None:
    with pytest.raises(ValueError, match="pace window must be >= 1"):
        PaceFilter(0)
