"""Token-bucket rate limiter: the in-process WAN emulation used when netns + tbf are not available."""

from __future__ import annotations

import asyncio
import time


class TokenBucket:
    """Paces a sender to ``rate_Bps`` with bursts of at most ``burst_bytes``.

    Tokens may go negative (a frame larger than the burst is let through and paid for afterwards), so
    frames of any size pass at the configured long-run rate without splitting them.
    """

    def __init__(self, rate_Bps: float, burst_bytes: int | None = None) -> None:
        if rate_Bps <= 0:
            raise ValueError(f"rate must be > 0 bytes/s, got {rate_Bps}")
        self.rate = float(rate_Bps)
        self.burst = float(burst_bytes if burst_bytes is not None else max(16 << 10, rate_Bps * 0.005))
        self._tokens = self.burst
        self._t = time.monotonic()
        self.granted = 0  # bytes let through, in all
        self.waits = 0  # acquisitions that had to wait for the rate (the link was paced)

    def _refill(self) -> None:
        now = time.monotonic()
        self._tokens = min(self.burst, self._tokens + (now - self._t) * self.rate)
        self._t = now

    async def acquire(self, nbytes: int) -> None:
        self._refill()
        self._tokens -= nbytes
        self.granted += nbytes
        if self._tokens < 0:
            self.waits += 1
            await asyncio.sleep(-self._tokens / self.rate)
