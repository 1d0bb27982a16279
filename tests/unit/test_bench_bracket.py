"""`bench lm --bracket`: a strategy's utilization against the mean of the ceilings run just before and after it."""

from __future__ import annotations

import pytest

from dreamp2p.devtools.bench.lm.report import bracketed


@pytest.mark.parametrize(
    ("sps", "before", "after", "cu"),
    [
        (3.0, 3.0, 3.0, 1.0),  # a steady host
        (3.0, 3.5, 2.5, 1.0),  # the host slowed during the run: the mean, not the first ceiling (0.857)
        (3.0, 2.5, 3.5, 1.0),  # or sped up (1.2 against the first)
        (2.7, 3.0, 3.0, 0.9),
        (1.0, 4.0, 2.0, 0.333),
    ],
)
def test_utilization_is_against_the_mean_of_the_two_ceilings(
    sps: float, before: float, after: float, cu: float
) -> None:
    row = bracketed(sps, before, after)
    assert row["compute_utilization"] == pytest.approx(cu, abs=5e-4)
    assert row["ceiling_steps_per_s"] == [before, after]


@pytest.mark.parametrize(("before", "after"), [(0.0, 3.0), (3.0, 0.0), (-1.0, 3.0), (float("nan"), 3.0)])
def test_a_ceiling_without_steps_is_refused(before: float, after: float) -> None:
    with pytest.raises(ValueError, match="ceilings must be > 0"):
        bracketed(3.0, before, after)
