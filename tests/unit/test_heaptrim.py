"""The daemon's heap trimmer: a full collection and a trim at most once per interval, never when disabled."""

from __future__ import annotations

import gc
import platform
import weakref

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


class Node:
    def __init__(self) -> None:
        self.other: Node | None = None


def test_a_trim_collects_cyclic_garbage_first() -> None:
    # churn leaves garbage in reference cycles: refcounting never frees it, a collection does
    clock = Clock()
    heap = HeapTrimmer(30.0, clock)
    was_enabled = gc.isenabled()
    gc.disable()  # so only the trimmer's own collection can free the cycle
    try:
        a, b = Node(), Node()
        a.other, b.other = b, a
        alive = weakref.ref(a)
        del a, b
        clock.now += 10.0
        assert not heap.maybe_trim()
        assert alive() is not None  # not yet due: nothing collected
        clock.now += 20.0
        assert heap.maybe_trim()
        assert alive() is None
    finally:
        if was_enabled:
            gc.enable()


def test_each_trim_runs_exactly_one_collection() -> None:
    calls: list[float] = []
    clock = Clock()

    def collect() -> int:
        calls.append(clock.now)
        return 0

    heap = HeapTrimmer(5.0, clock, collect)
    for _ in range(4):
        clock.now += 3.0
        heap.maybe_trim()
    assert calls == [106.0, 112.0]
