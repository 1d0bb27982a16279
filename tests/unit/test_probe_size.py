"""The bandwidth probe's burst size (pure logic): the least size until the link is measured, then what lasts
the probe's span at the link's estimate, within the peers' limit."""

from __future__ import annotations

import math

import pytest

from dreamp2p.transport.linkrate.probeburst import MAX_PROBE_BYTES, PROBE_MIN_SPAN_S, probe_size, probe_span

FLOOR = 256 << 10


@pytest.mark.parametrize(
    ("goodput", "rtt", "expected"),
    [
        # not measured yet (NaN, zero, negative): the least size
        (math.nan, 0.0, FLOOR),
        (0.0, 0.1, FLOOR),
        (-1.0, 0.1, FLOOR),
        # slow links: 50 ms of the rate is under the least size
        (125_000.0, 0.0, FLOOR),  # 1 Mbit/s
        (2_500_000.0, 0.0, FLOOR),  # 20 Mbit/s: 125 KB
        # fast links: 50 ms of the rate, so a bucket of a few ms stays a small share
        (25_000_000.0, 0.0, 1_250_000),  # 200 Mbit/s
        (12_500_000.0, 0.001, 625_000),
        # a long path: a round trip of the rate when that is longer
        (12_500_000.0, 0.1, 1_250_000),
        (2_500_000.0, 0.15, 375_000),
        # an unknown RTT (NaN) counts as none
        (12_500_000.0, math.nan, 625_000),
        # never over the peers' limit on one probe
        (1e12, 0.0, MAX_PROBE_BYTES),
    ],
)
def test_a_probe_lasts_its_span_at_the_links_estimate(goodput: float, rtt: float, expected: int) -> None:
    assert probe_size(goodput, rtt, FLOOR, MAX_PROBE_BYTES) == expected


@pytest.mark.parametrize(("rtt", "expected"), [(0.0, PROBE_MIN_SPAN_S), (0.01, PROBE_MIN_SPAN_S), (0.2, 0.2)])
def test_the_span_is_50_ms_or_a_round_trip(rtt: float, expected: float) -> None:
    assert probe_span(rtt) == pytest.approx(expected)


@pytest.mark.parametrize(("floor", "cap"), [(0, 10), (11, 10), (-5, 10)])
def test_sizes_out_of_order_are_refused(floor: int, cap: int) -> None:
    with pytest.raises(ValueError, match="floor"):
        probe_size(1e6, 0.0, floor, cap)
