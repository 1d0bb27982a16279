"""The pace filter: a windowed maximum of delivery-rate samples that ignores what says nothing."""

from __future__ import annotations

import math

import pytest

from dreamp2p.schedule.pace import PaceFilter, delivery_rate


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


@pytest.mark.parametrize(
    ("nbytes", "seconds", "world", "rtt", "want"),
    [
        (1_000_000, 1.0, 2, 0.0, 1e6),  # no latency measured: the raw rate
        (1_000_000, 1.0, 2, math.nan, 1e6),
        (1_000_000, 1.0, 1, 0.2, 1e6),  # alone: no ring, no chain
        (1_000_000, 1.0, 2, 0.2, 1e6 / 0.8),  # 2 hops of 0.1 s taken off
        (1_000_000, 1.0, 3, 0.2, 1e6 / 0.6),  # 4 hops of 0.1 s
        (1_000_000, 1.0, 2, 0.8, 2e6),  # a chain beyond half the round: at most twice the raw rate
        (1_000_000, 1.0, 5, 10.0, 2e6),
        (1_000_000, 0.0, 2, 0.1, math.nan),  # no time: says nothing
        (1_000_000, math.inf, 2, 0.1, math.nan),
    ],
)
def test_delivery_rate_takes_the_rings_latency_chain_off(
    nbytes: int, seconds: float, world: int, rtt: float, want: float
) -> None:
    got = delivery_rate(nbytes, seconds, world, rtt)
    assert (math.isnan(got) and math.isnan(want)) or got == pytest.approx(want, rel=1e-12)


def test_a_corrected_rate_prices_a_round_as_long_as_it_took() -> None:
    """Fed back to the planner's cost model (bytes / bandwidth + the chain), the corrected rate predicts the
    round's own time; the raw rate would add the chain a second time."""
    link_bw, rtt, world, nbytes = 1.25e6, 0.08, 2, 930_000
    seconds = nbytes / link_bw + (world - 1) * rtt  # what a round takes on that link
    rate = delivery_rate(nbytes, seconds, world, rtt)
    assert rate == pytest.approx(link_bw)
    raw = nbytes / seconds
    assert nbytes / raw + (world - 1) * rtt > seconds * 1.08  # double-counted: 9% too slow
