"""Cost model for DreamDDP scheduling: per-layer compute costs and the time of one ring all-reduce on a link.

DreamDDP ("DreamDDP: Accelerating Data Parallel Distributed LLM Training with Layer-wise Scheduled Partial
Synchronization", arXiv 2502.11058) schedules from two profiles: per-layer forward/backward time and per-layer
all-reduce time. The authors measure the latter; here it is derived from measured link statistics (goodput of the
slowest ring link, largest RTT) so that the plan can be recomputed whenever the bandwidth probe reports a change.

A ring all-reduce of ``n`` fp32 bytes among ``N`` peers sends ``2(N-1)/N * n`` bytes per peer (reduce-scatter and
all-gather), scaled by the codec's wire ratio. Chunk pipelining hides most of the per-hop transfer time behind the
next hop, but not the latency chain: each of the ``2(N-1)`` steps waits for its predecessor's data, which costs
about half an RTT plus a fixed software overhead. Pure arithmetic, no I/O.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# Wire bytes per fp32 byte above this make no sense for any codec (fp32 itself is 1.0; framing adds little).
MAX_CODEC_RATIO = 4.0


def _finite_nonneg(name: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be finite and >= 0, got {value!r}")


def _nonneg_int(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int, got {value!r}")
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")


@dataclass(frozen=True)
class LayerCost:
    """Profiled cost of one layer (a parameter group that is synchronized as a unit)."""

    name: str
    fwd_s: float  # forward time of this layer
    bwd_s: float  # backward time of this layer
    nbytes: int  # parameter bytes (fp32)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"layer name must be a non-empty str, got {self.name!r}")
        _finite_nonneg(f"fwd_s of layer {self.name!r}", self.fwd_s)
        _finite_nonneg(f"bwd_s of layer {self.name!r}", self.bwd_s)
        _nonneg_int(f"nbytes of layer {self.name!r}", self.nbytes)


@dataclass(frozen=True)
class LinkModel:
    """What the planner needs to know about the ring: its slowest link, its worst RTT and its size."""

    bandwidth_Bps: float  # goodput of the SLOWEST link in the ring (bytes/s)
    rtt_s: float  # largest RTT in the ring
    world: int  # peers in the ring
    codec_ratio: float = 1.0  # wire bytes / fp32 bytes for the codec in use (e.g. 0.266 for int8)
    per_hop_overhead_s: float = 0.0  # fixed software cost per ring hop
    margin: float = 1.0  # plan against comm times this much longer than measured (noise, CPU contention)

    def __post_init__(self) -> None:
        bw = self.bandwidth_Bps
        if isinstance(bw, bool) or not isinstance(bw, int | float) or not math.isfinite(bw) or bw <= 0:
            raise ValueError(f"bandwidth_Bps must be finite and > 0, got {bw!r}")
        _finite_nonneg("rtt_s", self.rtt_s)
        if isinstance(self.world, bool) or not isinstance(self.world, int) or self.world < 1:
            raise ValueError(f"world must be an int >= 1, got {self.world!r}")
        ratio = self.codec_ratio
        if isinstance(ratio, bool) or not isinstance(ratio, int | float) or not 0 < ratio <= MAX_CODEC_RATIO:
            raise ValueError(f"codec_ratio must be in (0, {MAX_CODEC_RATIO}], got {ratio!r}")
        _finite_nonneg("per_hop_overhead_s", self.per_hop_overhead_s)
        m = self.margin
        if isinstance(m, bool) or not isinstance(m, int | float) or not math.isfinite(m) or not 1.0 <= m <= 10.0:
            raise ValueError(f"margin must be in [1, 10], got {m!r}")

    @property
    def hops(self) -> int:
        """Sequential steps of one ring all-reduce: N-1 of reduce-scatter plus N-1 of all-gather."""
        return 2 * (self.world - 1)


def ring_wire_bytes(nbytes: int, link: LinkModel) -> float:
    """Bytes one peer puts on the wire for a ring all-reduce of ``nbytes`` fp32 bytes (0 when alone)."""
    _nonneg_int("nbytes", nbytes)
    if link.world == 1:
        return 0.0
    return nbytes * link.codec_ratio * (2.0 * (link.world - 1) / link.world)


def ring_comm_time(nbytes: int, link: LinkModel) -> float:
    """Predicted seconds for one ring all-reduce of ``nbytes`` fp32 parameter bytes on ``link``.

    ``world == 1`` and ``nbytes == 0`` cost nothing: no collective is started at all.
    """
    wire = ring_wire_bytes(nbytes, link)
    if wire == 0.0:
        return 0.0
    return link.margin * (wire / link.bandwidth_Bps + link.hops * (link.rtt_s / 2.0 + link.per_hop_overhead_s))
