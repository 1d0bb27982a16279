"""Bandwidth-aware chunk sizing: how many bytes one wire frame should carry on a given link.

Two forces set the size. Each frame costs a fixed per-frame overhead (headers, a Python round trip
through the gRPC stack, checksums): a frame must carry enough link time to amortize it. And a ring
all-reduce is pipelined chunk by chunk across 2(N-1) hops: the pipeline fills in 2(N-1) chunk times,
so chunks must stay small next to a segment. On a fast local link the first force wins (MBs per
frame); on a slow WAN link the second does (tens of KB). Pure arithmetic.
"""

from __future__ import annotations

import math

# Python + gRPC work per frame, sender and receiver together: ~80 us on an idle core, ~300 us when
# training competes for the cores (measured with `bench strategies`, 2 trainers on 2 cores). The loaded
# figure is the one that matters: overlapped communication runs while training computes.
DEFAULT_FRAME_OVERHEAD_S = 300e-6
# Frames must carry >= 1/AMORTIZE_FRACTION times their overhead in link time (1% overhead). Strict on
# purpose: when communication overlaps training, each frame's CPU time is taken from the training step.
AMORTIZE_FRACTION = 0.01
# The pipeline fill (2(N-1) chunk times) may cost at most this fraction of a segment's transfer time.
FILL_FRACTION = 0.10


def choose_chunk_bytes(
    bandwidth_Bps: float,
    segment_bytes: int,
    world: int,
    *,
    min_bytes: int = 64 << 10,
    max_bytes: int = 4 << 20,
    frame_overhead_s: float = DEFAULT_FRAME_OVERHEAD_S,
) -> int:
    """Bytes per chunk for a link of ``bandwidth_Bps`` carrying ring segments of ``segment_bytes``.

    The result is clamped to ``[min_bytes, max_bytes]`` and rounded to a multiple of 4 KiB.
    """
    if min_bytes <= 0 or max_bytes < min_bytes:
        raise ValueError(f"need 0 < min_bytes <= max_bytes, got {min_bytes}, {max_bytes}")
    if world < 1:
        raise ValueError(f"world must be >= 1, got {world}")
    if not math.isfinite(bandwidth_Bps) or bandwidth_Bps <= 0:
        # unknown link: start in the middle and let measurements take over
        bandwidth_Bps = 100e6
    amortize = bandwidth_Bps * frame_overhead_s / AMORTIZE_FRACTION
    hops = max(1, 2 * (world - 1))
    fill_cap = FILL_FRACTION * max(0, segment_bytes) / hops
    size = max(amortize, min(fill_cap, max_bytes)) if fill_cap > 0 else amortize
    size = min(max(size, min_bytes), max_bytes)
    size = int(size) // 4096 * 4096
    return max(size, min(min_bytes, max_bytes))


def choose_chunk(
    bandwidth_Bps: float,
    segment_elems: int,
    world: int,
    wire_ratio: float,
    *,
    min_bytes: int = 64 << 10,
    max_bytes: int = 4 << 20,
    frame_overhead_s: float = DEFAULT_FRAME_OVERHEAD_S,
) -> tuple[int, int]:
    """(elements, wire bytes) per chunk for segments of ``segment_elems`` fp32 elements sent with a codec
    of ``wire_ratio`` wire bytes per fp32 byte (`Codec.wire_ratio`).

    Sized in wire bytes, since the link carries those and a frame's fixed cost is amortized over them: at
    the same link rate a frame of a 4-bit codec holds ~7x the elements of an fp32 one.
    """
    if not 0 < wire_ratio <= 2:
        raise ValueError(f"wire_ratio must be in (0, 2], got {wire_ratio}")
    wire = choose_chunk_bytes(
        bandwidth_Bps,
        int(segment_elems * 4 * wire_ratio),
        world,
        min_bytes=min_bytes,
        max_bytes=max_bytes,
        frame_overhead_s=frame_overhead_s,
    )
    return max(1, int(wire / (4 * wire_ratio))), wire
