"""A link's goodput estimate from full and shared samples (`dreamp2p.transport.linkrate.linkstats`), pure."""

from __future__ import annotations

import math

import pytest

from dreamp2p.transport.linkrate.linkstats import LinkEstimator

MB = 1_000_000


def estimate(samples: list[tuple[float, bool]]) -> LinkEstimator:
    """An estimator fed one-second transfers at each (MB/s, shared) in turn."""
    est = LinkEstimator()
    for rate, shared in samples:
        est.observe_transfer(int(rate * MB), 1.0, shared=shared)
    return est


@pytest.mark.parametrize(
    ("samples", "goodput", "floor"),
    [
        ([], math.nan, False),
        ([(0.6, False)], 0.6, False),
        # a burst beside a sync, the link's only sample: kept, but as a floor
        ([(0.25, True)], 0.25, True),
        # the latest shared reading is the floor, lower or higher: a link that slowed shows through it
        ([(0.25, True), (0.4, True)], 0.4, True),
        ([(0.4, True), (0.25, True)], 0.25, True),
        # the first sample of the link alone replaces a floor outright, higher or lower
        ([(0.25, True), (0.62, False)], 0.62, False),
        ([(0.4, True), (0.1, False)], 0.1, False),
        # once measured alone, a shared reading is an ordinary sample (it may be the only news of a slowdown)
        ([(0.6, False), (0.1, True)], 0.7 * 0.6 + 0.3 * 0.1, False),
        ([(0.6, False), (1.0, False)], 0.7 * 0.6 + 0.3 * 1.0, False),
    ],
)
def test_goodput_from_full_and_shared_samples(samples: list[tuple[float, bool]], goodput: float, floor: bool) -> None:
    est = estimate(samples)
    assert est.samples == len(samples)
    assert est.floor is floor
    if math.isnan(goodput):
        assert math.isnan(est.goodput_Bps)
    else:
        assert est.goodput_Bps == pytest.approx(goodput * MB)


@pytest.mark.parametrize(("nbytes", "seconds"), [(0, 1.0), (100, 0.0), (100, -1.0), (100, math.inf), (100, math.nan)])
def test_empty_or_timeless_transfers_say_nothing(nbytes: int, seconds: float) -> None:
    est = estimate([(0.25, True)])
    est.observe_transfer(nbytes, seconds)
    assert (est.samples, est.floor, est.goodput_Bps) == (1, True, pytest.approx(0.25 * MB))
