"""Hands the C heap's free pages back to the operating system now and then, for a daemon that runs for days.

A member that lives through churn serves state snapshots to joiners, opens and drops gRPC connections to
members that die and return, and writes checkpoints: each leaves freed blocks scattered over glibc's
per-thread arenas, which malloc keeps mapped; Python and torch do not hand that memory back themselves.
In `bench chaos` a member's resident size climbs in steps around the joins it serves (docs/BENCHMARKS.md;
how much of it is such free memory is not measured yet). ``malloc_trim(0)`` releases the free pages of
every arena; it is cheap next to a training step and runs at most once per interval. Where the C library
has no ``malloc_trim`` (musl, macOS) this does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

# How often a daemon trims: rarely enough to cost nothing measurable, often enough that a burst of
# joins does not stay resident for long.
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
    """Calls ``malloc_trim(0)`` at most once every ``every_s`` seconds (0: never)."""

    def __init__(self, every_s: float = TRIM_EVERY_S, clock: Callable[[], float] = time.monotonic) -> None:
        if every_s < 0:
            raise ValueError(f"every_s must be >= 0 (0 disables), got {every_s}")
        self.every_s = every_s
        self._clock = clock
        self._trim = _load_malloc_trim() if every_s > 0 else None
        self._last = clock()
        self.trims = 0

    @property
    def available(self) -> bool:
        """Whether this C library can trim its heap (glibc)."""
        return self._trim is not None

    def maybe_trim(self) -> bool:
        """Trim if the interval has passed since the last trim (or since creation); whether it trimmed."""
        if self._trim is None:
            return False
        now = self._clock()
        if now - self._last < self.every_s:
            return False
        self._last = now
        released = self._trim(0)
        self.trims += 1
        log.debug("malloc_trim: %s", "released memory" if released else "nothing to release")
        return True
