"""Hands the heap's free memory back to the operating system now and then, for a daemon that runs for days.

A member that lives through churn serves state snapshots to joiners, fails rounds when members die and
writes checkpoints; that leaves cyclic garbage (a census in `bench chaos` found 3-6 times more unreachable
objects per collection while members were killed than before; which objects, it did not identify).
Python frees cycles only in a full collection, which a process holding a few hundred thousand long-lived
objects runs rarely, and glibc keeps freed blocks of its per-thread arenas mapped. So every interval the
daemon runs one full ``gc.collect()`` (~0.1 s with ~400k objects) and then ``malloc_trim(0)``, which
releases the free pages of every arena; docs/BENCHMARKS.md (Chaos) gives what this does to a survivor's
resident size. Where the C library has no ``malloc_trim`` (musl, macOS) only the collection runs.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import logging
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

# How often a daemon collects and trims: rarely enough to cost little (a full collection every 30 s is
# ~0.3% of the time), often enough that a burst of kills and joins does not stay resident for long.
TRIM_EVERY_S = 30.0


def _load_malloc_trim() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim


class HeapTrimmer:
    """Every ``every_s`` seconds at most (0: never), a full garbage collection, then ``malloc_trim(0)``."""

    def __init__(
        self,
        every_s: float = TRIM_EVERY_S,
        clock: Callable[[], float] = time.monotonic,
        collect: Callable[[], int] = gc.collect,
    ) -> None:
        if every_s < 0:
            raise ValueError(f"every_s must be >= 0 (0 disables), got {every_s}")
        self.every_s = every_s
        self._clock = clock
        self._collect = collect
        self._trim = _load_malloc_trim() if every_s > 0 else None
        self._last = clock()
        self.trims = 0

    @property
    def available(self) -> bool:
        """Whether this C library can trim its heap (glibc)."""
        return self._trim is not None

    def maybe_trim(self) -> bool:
        """Collect and trim if the interval has passed since the last time (or since creation); whether it ran."""
        if self.every_s <= 0:
            return False
        now = self._clock()
        if now - self._last < self.every_s:
            return False
        self._last = now
        t0 = time.perf_counter()
        found = self._collect()
        released = self._trim(0) if self._trim is not None else 0
        self.trims += 1
        log.debug(
            "heap: %d unreachable objects collected, %s, in %.3f s",
            found,
            "free pages released" if released else "no pages to release",
            time.perf_counter() - t0,
        )
        return True
