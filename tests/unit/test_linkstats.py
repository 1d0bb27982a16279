"""A link's goodput estimate from full and shared samples (`dreamp2p.transport.linkrate.linkstats`), pure."""

from __future__ import annotations

import math

import pytest

from dreamp2p.transport.linkrate.linkstats import LinkEstimator, delivery_checked

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


@pytest.mark.parametrize(
    ("samples", "stream", "kept"),
    [
        # a 2 MB stream acknowledged 0.9 s after its first hand-off on a 100 ms path: it delivered 2.5 MB/s,
        # so a meter reading of 7.3 MB/s (the buffers took the bytes at once) is not the link's pace
        ([(730_000, 0.1)], (2 * MB, 0.9, 0.1), []),
        # readings up to twice the delivered rate stand: the stream's own gaps lower that bound
        ([(240_000, 0.1), (490_000, 0.1)], (2 * MB, 0.9, 0.1), [(240_000, 0.1), (490_000, 0.1)]),
        ([(240_000, 0.1), (510_000, 0.1)], (2 * MB, 0.9, 0.1), [(240_000, 0.1)]),
        # no latency known (NaN, inf): the whole time counts, a stricter bound
        ([(450_000, 0.1)], (2 * MB, 0.9, math.nan), []),
        ([(440_000, 0.1)], (2 * MB, 0.9, math.inf), [(440_000, 0.1)]),
        # a latency over half the time comes off as half of it
        ([(800_000, 0.1)], (2 * MB, 0.9, 0.8), [(800_000, 0.1)]),
        ([(900_000, 0.1)], (2 * MB, 0.9, 0.8), []),
        # a stream that moved nothing, or took no time, confirms nothing
        ([(1, 0.1)], (0, 0.9, 0.1), []),
        ([(1, 0.1)], (MB, 0.0, 0.1), []),
        ([(1, 0.1)], (MB, math.nan, 0.1), []),
        ([(1, 0.0)], (MB, 1.0, 0.0), []),
    ],
)
def test_meter_samples_stand_only_where_the_stream_delivery_confirms_them(
    samples: list[tuple[int, float]], stream: tuple[int, float, float], kept: list[tuple[int, float]]
) -> None:
    assert delivery_checked(samples, *stream) == kept
