"""The packet-level WAN path model: given packets' arrival times and sizes, when each leaves or why it is dropped.

Pure and deterministic (a seeded SplitMix64 stream, no I/O): the C forwarder (``wanemu.c``) implements
the same arithmetic and the same draws in the same order, and `--simulate` lets a test compare the two.
One :class:`PathState` is one direction of one link:

1. **Queue** (tail drop): bytes still waiting to be serialized when a packet arrives, plus the packet,
   must fit ``queue_limit``; otherwise the packet is dropped (``Fate.QUEUE_DROP``) and consumes nothing.
2. **Serialization** at ``rate_bps``: one packet at a time, ``size * 8 / rate`` seconds each.
3. **Loss**: independent with probability ``loss`` (``loss_burst == 1``), or bursty by the Gilbert model
   (a good state that loses nothing, a bad state that loses everything; mean burst ``loss_burst`` packets,
   long-run fraction ``loss``). A lost packet used its serialization time (it was on the wire).
4. **Propagation**: ``delay_s`` plus ``jitter_s`` times a standard normal draw, never below zero. Without
   ``reorder`` a packet never leaves before the one ahead of it on the path (the jitter then delays it
   instead), as a single path of routers does; with ``reorder`` packets may pass each other.

Per packet the draws are: one for the loss (when ``loss > 0``), then two for the jitter's Box-Muller
normal (when ``jitter_s > 0``), whatever the loss decided.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable
from dataclasses import dataclass

from dreamp2p.config.parse import parse_duration, parse_rate

_MASK = (1 << 64) - 1
DEFAULT_QUEUE_S = 0.1  # the default queue holds this long at the rate (as the tbf links' `latency 100ms`)
MIN_QUEUE_BYTES = 64 << 10


class SplitMix64:
    """SplitMix64 (Steele, Lea, Flood 2014): the same 64-bit stream in Python and in ``wanemu.c``."""

    def __init__(self, seed: int) -> None:
        self.state = seed & _MASK

    def next_u64(self) -> int:
        self.state = (self.state + 0x9E3779B97F4A7C15) & _MASK
        z = self.state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
        return z ^ (z >> 31)

    def uniform(self) -> float:
        """A float in [0, 1) with 53 random bits."""
        return (self.next_u64() >> 11) * (1.0 / 9007199254740992.0)


def path_seed(seed: int, src: int, dst: int) -> int:
    """The seed of the path from port ``src`` to port ``dst`` (as the forwarder derives it)."""
    return (seed + 256 * src + dst) & _MASK


def parse_loss(text: str | float) -> float:
    """A loss fraction: ``0.001``, ``"0.1%"`` or ``"0.001"``; in [0, 1)."""
    if isinstance(text, str):
        t = text.strip()
        try:
            value = float(t[:-1]) / 100.0 if t.endswith("%") else float(t)
        except ValueError:
            raise ValueError(f"cannot parse loss {text!r}: use e.g. '0.1%' or 0.001") from None
    else:
        value = float(text)
    if not 0.0 <= value < 1.0:  # also refuses NaN
        raise ValueError(f"loss must be a fraction in [0, 1), got {text!r}")
    return value


@dataclass(frozen=True)
class WanPath:
    """One direction of an emulated internet path (every direction of an emulated network gets the same).

    ``rate_bps``: bits/s of IP packets (headers included, no link-layer framing); ``delay_s``: one-way
    propagation delay (half the round-trip time); ``jitter_s``: standard deviation of each packet's
    delay around it; ``loss``: long-run fraction of packets lost; ``loss_burst``: mean packets per loss
    burst (1: independent losses); ``queue_bytes``: the bottleneck's queue (0: ``DEFAULT_QUEUE_S`` at the
    rate, at least ``MIN_QUEUE_BYTES``); ``reorder``: let jitter reorder packets; ``seed``: the RNG's.
    """

    rate_bps: float
    delay_s: float = 0.0
    jitter_s: float = 0.0
    loss: float = 0.0
    loss_burst: float = 1.0
    queue_bytes: int = 0
    reorder: bool = False
    seed: int = 1

    def __post_init__(self) -> None:
        if not (math.isfinite(self.rate_bps) and self.rate_bps > 0):
            raise ValueError(f"WanPath.rate_bps must be a finite rate > 0 bits/s, got {self.rate_bps}")
        if not (math.isfinite(self.delay_s) and self.delay_s >= 0):
            raise ValueError(f"WanPath.delay_s must be >= 0 seconds, got {self.delay_s}")
        if not (math.isfinite(self.jitter_s) and self.jitter_s >= 0):
            raise ValueError(f"WanPath.jitter_s must be >= 0 seconds, got {self.jitter_s}")
        if not 0.0 <= self.loss < 1.0:
            raise ValueError(f"WanPath.loss must be a fraction in [0, 1), got {self.loss}")
        if not (math.isfinite(self.loss_burst) and self.loss_burst >= 1.0):
            raise ValueError(f"WanPath.loss_burst must be >= 1 packet (1: independent losses), got {self.loss_burst}")
        if self.loss_burst > 1.0 and self.loss / (1.0 - self.loss) > self.loss_burst:
            raise ValueError(f"WanPath: loss {self.loss} cannot come in bursts of {self.loss_burst} (too few gaps)")
        if self.queue_bytes < 0:
            raise ValueError(f"WanPath.queue_bytes must be >= 0 (0: the default), got {self.queue_bytes}")
        if not 0 <= self.seed < 1 << 63:
            raise ValueError(f"WanPath.seed must be in [0, 2**63), got {self.seed}")

    @classmethod
    def parse(
        cls,
        rate: str | float,
        rtt: str | float = 0.0,
        jitter: str | float = 0.0,
        loss: str | float = 0.0,
        loss_burst: float = 1.0,
        queue_bytes: int = 0,
        reorder: bool = False,
        seed: int = 1,
    ) -> WanPath:
        """From the units people write: ``rate="100mbit"`` (or bits/s), ``rtt="100ms"`` (both directions
        together: each gets half), ``jitter="5ms"`` (per direction), ``loss="0.1%"`` (per direction)."""
        return cls(
            rate_bps=parse_rate(rate) * 8.0,
            delay_s=parse_duration(rtt) / 2.0,
            jitter_s=parse_duration(jitter),
            loss=parse_loss(loss),
            loss_burst=float(loss_burst),
            queue_bytes=int(queue_bytes),
            reorder=reorder,
            seed=seed,
        )

    @property
    def queue_limit(self) -> int:
        """The queue in bytes, the default resolved."""
        if self.queue_bytes:
            return self.queue_bytes
        return max(MIN_QUEUE_BYTES, int(self.rate_bps / 8.0 * DEFAULT_QUEUE_S))

    @property
    def gilbert(self) -> tuple[float, float]:
        """(p, r): per-packet chances good -> bad and bad -> good of the bursty loss model."""
        r = 1.0 / self.loss_burst
        return self.loss * r / (1.0 - self.loss), r


class Fate(enum.IntEnum):
    """What became of a packet (the forwarder prints the same numbers in `--simulate`)."""

    DELIVERED = 0
    QUEUE_DROP = 1
    LOST = 2


class PathState:
    """One direction's state: the link's busy-until time, the last departure, the loss state, the RNG."""

    def __init__(self, path: WanPath, seed: int | None = None) -> None:
        self.path = path
        self.rng = SplitMix64(path.seed if seed is None else seed)
        self.link_free = 0.0
        self.last_departure = 0.0
        self.bad = False
        self._byte_s = 8.0 / path.rate_bps
        self._limit = path.queue_limit
        self._p, self._r = path.gilbert

    def admit(self, now: float, size: int) -> tuple[Fate, float]:
        """A packet of ``size`` bytes arrives at ``now`` (seconds): its fate and, if delivered, departure time."""
        p = self.path
        waiting = self.link_free - now
        backlog = waiting / self._byte_s if waiting > 0.0 else 0.0
        if backlog + size > self._limit + 1e-6:  # a millionth of a byte: the float sum's rounding
            return Fate.QUEUE_DROP, 0.0
        start = self.link_free if self.link_free > now else now
        self.link_free = start + size * self._byte_s
        lost = False
        if p.loss > 0.0:
            u = self.rng.uniform()
            if p.loss_burst == 1.0:
                lost = u < p.loss
            else:
                self.bad = u >= self._r if self.bad else u < self._p
                lost = self.bad
        delay = p.delay_s
        if p.jitter_s > 0.0:
            u1, u2 = self.rng.uniform(), self.rng.uniform()
            delay += p.jitter_s * math.sqrt(-2.0 * math.log(1.0 - u1)) * math.cos(2.0 * math.pi * u2)
            delay = max(delay, 0.0)
        if lost:
            return Fate.LOST, 0.0
        departure = self.link_free + delay
        if not p.reorder:
            departure = max(departure, self.last_departure)
            self.last_departure = departure
        return Fate.DELIVERED, departure


def simulate(path: WanPath, packets: Iterable[tuple[float, int]]) -> list[tuple[Fate, float]]:
    """The fate (and departure time, 0.0 unless delivered) of each (arrival time, size) in order of arrival."""
    state = PathState(path)
    return [state.admit(t, size) for t, size in packets]
