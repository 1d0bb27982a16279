"""The bandwidth probe's burst size (pure logic): the least size until the link is measured, then what lasts
the probe's span at the link's estimate, within the peers' limit."""

from __future__ import annotations

import math

import pytest

from dreamp2p.transport.linkrate.probeburst import (
    MAX_PROBE_BYTES,
    PROBE_MIN_SPAN_S,
    burst_again,
    probe_size,
    probe_span,
    repeat_size,
)

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


@pytest.mark.parametrize(
    ("transfer", "rtt", "previous", "current", "again"),
    [
        # a LAN or tbf pair (no RTT known, or a fraction of a ms): one burst, whatever it read
        (0.1, 0.0, None, 2.5e6, False),
        (0.1, math.nan, None, 2.5e6, False),
        (0.1, 0.0003, None, 2.5e6, False),
        # a first burst that crossed in under 8 round trips may have met a closed window: once more (a fresh
        # connection's 256 KiB took 4.1 round trips at 150 ms)
        (0.27, 0.1, None, 0.68e6, True),
        (0.62, 0.15, None, 0.42e6, True),
        (0.79, 0.1, None, 0.33e6, True),
        # ... but not one that lasted longer than that: the link set its pace
        (0.8, 0.1, None, 0.33e6, False),
        # a repeat that read over 10% more than the burst before: the window is still opening
        (0.107, 0.1, 0.68e6, 2.39e6, True),
        # one that did not: the window was open, this is the link's reading
        (0.107, 0.1, 2.39e6, 2.40e6, False),
        (0.107, 0.1, 2.39e6, 2.2e6, False),
    ],
)
def test_a_burst_is_sent_again_while_the_window_it_met_was_still_opening(
    transfer: float, rtt: float, previous: float | None, current: float, again: bool
) -> None:
    assert burst_again(transfer, rtt, previous, current) is again


@pytest.mark.parametrize(
    ("size", "read", "rtt", "expected"),
    [
        # a window-paced burst read little: the repeat doubles it, so slow start runs on
        (FLOOR, 0.42e6, 0.15, 2 * FLOOR),
        (1 << 20, 2.4e6, 0.15, 2 << 20),
        # a reading whose span is longer than twice the burst sets the size
        (FLOOR, 12.5e6, 0.15, 1_875_000),
        # never over the peers' limit
        (3 << 20, 10e6, 0.15, MAX_PROBE_BYTES),
        (FLOOR, 100e6, 0.15, MAX_PROBE_BYTES),
    ],
)
def test_a_repeated_burst_is_at_least_twice_the_one_before(size: int, read: float, rtt: float, expected: int) -> None:
    assert repeat_size(size, read, rtt, FLOOR, MAX_PROBE_BYTES) == expected
