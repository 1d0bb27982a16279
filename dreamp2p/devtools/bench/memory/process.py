"""Process-level memory for `bench memory`: the resident set, its high-water mark, freed memory handed back
to the kernel at once, and CUDA's allocated bytes. Linux only (/proc); what is missing is reported, not guessed.

tracemalloc does not see torch's allocations, and torch keeps no statistics of its CPU allocator, so the
host figures come from the kernel: RSS from /proc/self/statm, its peak from VmHWM in /proc/self/status,
reset by writing 5 to /proc/self/clear_refs. glibc would keep freed blocks for reuse (and raise its mmap
threshold after each free of a large one), so a temporary would stay resident after it is freed: with
`return_freed_memory` every block of 64 KiB or more is mapped on its own and unmapped when freed.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import logging
import os
from pathlib import Path

import torch

log = logging.getLogger(__name__)

PAGE = os.sysconf("SC_PAGE_SIZE")
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_FREED_BLOCK = 64 << 10  # blocks at least this large go straight back to the kernel


def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
    except OSError:
        return None
    return libc if libc is not None and hasattr(libc, "mallopt") else None


def return_freed_memory() -> bool:
    """Make glibc hand freed blocks of 64 KiB or more back to the kernel at once (a fixed mmap threshold also
    stops glibc from raising it); whether it did (False: not glibc)."""
    libc = _libc()
    if libc is None:
        return False
    ok = libc.mallopt(_M_MMAP_THRESHOLD, _FREED_BLOCK) == 1 and libc.mallopt(_M_TRIM_THRESHOLD, _FREED_BLOCK) == 1
    if not ok:
        log.warning("mallopt refused: freed memory may stay resident, and RSS deltas read high")
    return ok


def settle() -> None:
    """Collect garbage and hand the heap's free top back (glibc), so RSS holds what is live."""
    gc.collect()
    libc = _libc()
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)


def rss_bytes() -> int:
    """This process's resident set now."""
    return int(Path("/proc/self/statm").read_text().split()[1]) * PAGE


def peak_rss_bytes() -> int | None:
    """The resident set's high-water mark since the last `reset_peak` (None where the kernel does not say)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) << 10
    return None


def reset_peak() -> bool:
    """Set the high-water mark to the resident set now; whether the kernel took it."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


class DeviceMemory:
    """CUDA's allocated bytes on the current device (every figure 0 on a CPU run)."""

    def __init__(self, device: str) -> None:
        self.cuda = device == "cuda" and torch.cuda.is_available()

    def allocated(self) -> int:
        return torch.cuda.memory_allocated() if self.cuda else 0

    def peak(self) -> int:
        """The most allocated at once since `reset_peak`."""
        return torch.cuda.max_memory_allocated() if self.cuda else 0

    def reset_peak(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
