"""The daemon's heap trimmer: at most once per interval, never when disabled."""

from __future__ import annotations

import platform

import pytest

from dreamp2p.service.heaptrim import HeapTrimmer


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_glibc_can_trim() -> None:
    # the daemons this project ships run on glibc Linux (the CI image included): the trim must be real there
    assert HeapTrimmer().available == (platform.system() == "Linux" and platform.libc_ver()[0] == "glibc")


@pytest.mark.skipif(not HeapTrimmer().available, reason="this C library has no malloc_trim")
@pytest.mark.parametrize(
    ("every_s", "advances", "expected"),
    [
        (30.0, [10.0, 10.0, 10.0], [False, False, True]),
        (30.0, [31.0, 1.0, 30.0], [True, False, True]),
        (5.0, [5.0, 5.0, 4.9], [True, True, False]),
    ],
)
def test_trims_at_most_once_per_interval(every_s: float, advances: list[float], expected: list[bool]) -> None:
    clock = Clock()
    heap = HeapTrimmer(every_s, clock)
    got = []
    for dt in advances:
        clock.now += dt
        got.append(heap.maybe_trim())
    assert got == expected
    assert heap.trims == sum(expected)


def test_zero_disables_and_negative_is_refused() -> None:
    clock = Clock()
    heap = HeapTrimmer(0.0, clock)
    clock.now += 1e6
    assert not heap.maybe_trim() and heap.trims == 0
    with pytest.raises(ValueError, match="every_s must be >= 0"):
        HeapTrimmer(-1.0)
