"""Pure partitioning of a flat buffer into ring segments and wire chunks, and the ring's step schedule.

No I/O, no torch: everything here is integer arithmetic so every peer derives the same layout from the
same inputs (element count, peer count, chunk size, codec block). Compare hivemind's
``averaging/partition.py``: the protocol code only asks this module which bytes go where.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Segment:
    index: int
    start: int
    stop: int

    @property
    def length(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class Chunk:
    segment: int
    start: int  # absolute element offset in the flat buffer
    length: int

    @property
    def stop(self) -> int:
        return self.start + self.length


def split_segments(n: int, parts: int, align: int = 1) -> list[Segment]:
    """Cut ``n`` elements into ``parts`` contiguous segments of near-equal size.

    Interior boundaries fall on multiples of ``align`` (a codec's block) so no block straddles two
    segments; segments may be empty when ``n`` is small. Sizes differ by at most ``align`` elements.
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if parts < 1:
        raise ValueError(f"parts must be >= 1, got {parts}")
    if align < 1:
        raise ValueError(f"align must be >= 1, got {align}")
    blocks = -(-n // align)
    base, extra = divmod(blocks, parts)
    out = []
    start = 0
    for i in range(parts):
        nblocks = base + (1 if i < extra else 0)
        stop = min(n, start + nblocks * align)
        out.append(Segment(i, start, stop))
        start = stop
    return out


def split_chunks(segment: Segment, chunk_elems: int, align: int = 1) -> list[Chunk]:
    """Cut a segment into chunks of at most ``chunk_elems`` elements (rounded down to ``align``, >= align)."""
    if chunk_elems < 1:
        raise ValueError(f"chunk_elems must be >= 1, got {chunk_elems}")
    step = max(align, (chunk_elems // align) * align)
    return [Chunk(segment.index, s, min(step, segment.stop - s)) for s in range(segment.start, segment.stop, step)]


def reduce_scatter_send(rank: int, world: int, step: int) -> int:
    """Segment that ``rank`` sends at reduce-scatter ``step`` (0-based)."""
    return (rank - step) % world


def reduce_scatter_recv(rank: int, world: int, step: int) -> int:
    return (rank - step - 1) % world


def owned_segment(rank: int, world: int) -> int:
    """Segment fully reduced at ``rank`` after the reduce-scatter phase."""
    return (rank + 1) % world


def all_gather_send(rank: int, world: int, step: int) -> int:
    return (rank + 1 - step) % world


def all_gather_recv(rank: int, world: int, step: int) -> int:
    return (rank - step) % world
