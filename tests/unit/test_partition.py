"""Pure partitioning and chunk-size logic: parametrized cases plus hypothesis properties."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dreamp2p.collective.chunking import choose_chunk, choose_chunk_bytes
from dreamp2p.collective.partition import (
    all_gather_recv,
    all_gather_send,
    owned_segment,
    reduce_scatter_recv,
    reduce_scatter_send,
    split_chunks,
    split_segments,
)


@pytest.mark.parametrize(
    ("n", "parts", "align", "lengths"),
    [
        (0, 3, 1, [0, 0, 0]),
        (1, 3, 1, [1, 0, 0]),
        (10, 3, 1, [4, 3, 3]),
        (10, 3, 4, [4, 4, 2]),
        (130, 2, 64, [128, 2]),
        (7, 1, 64, [7]),
    ],
)
def test_split_segments_cases(n: int, parts: int, align: int, lengths: list[int]) -> None:
    assert [s.length for s in split_segments(n, parts, align)] == lengths


@pytest.mark.parametrize(("n", "parts", "align"), [(-1, 1, 1), (1, 0, 1), (1, 1, 0)])
def test_split_segments_rejects(n: int, parts: int, align: int) -> None:
    with pytest.raises(ValueError):
        split_segments(n, parts, align)


@given(n=st.integers(0, 10**7), parts=st.integers(1, 64), align=st.sampled_from([1, 2, 64, 256]))
@settings(max_examples=300, deadline=None)
def test_segments_cover_exactly(n: int, parts: int, align: int) -> None:
    segs = split_segments(n, parts, align)
    assert len(segs) == parts
    assert segs[0].start == 0 and segs[-1].stop == n
    for a, b in itertools.pairwise(segs):
        assert a.stop == b.start
    for s in segs:
        if s.start < n:
            assert s.start % align == 0
    # block counts differ by at most one
    blocks = [-(-s.length // align) for s in segs]
    assert max(blocks) - min(blocks) <= 1


@given(
    n=st.integers(0, 10**6),
    parts=st.integers(1, 16),
    chunk=st.integers(1, 10**5),
    align=st.sampled_from([1, 64]),
)
@settings(max_examples=300, deadline=None)
def test_chunks_tile_segments(n: int, parts: int, chunk: int, align: int) -> None:
    chunk = max(chunk, n // 4000)  # a million one-element chunks checks nothing 4000 do not, 250x slower
    total = 0
    for seg in split_segments(n, parts, align):
        pos = seg.start
        for c in split_chunks(seg, chunk, align):
            assert c.start == pos and c.length > 0 and c.segment == seg.index
            assert (c.start - seg.start) % align == 0
            assert c.length <= max(align, chunk)
            pos = c.stop
            total += c.length
        assert pos == seg.stop
    assert total == n


def test_split_chunks_rejects_zero() -> None:
    with pytest.raises(ValueError):
        split_chunks(split_segments(10, 1)[0], 0)


@pytest.mark.parametrize("world", [1, 2, 3, 5, 8])
def test_ring_schedule_is_consistent(world: int) -> None:
    for rank in range(world):
        pred = (rank - 1) % world
        rs_recv = set()
        ag_recv = set()
        for step in range(world - 1):
            # what I receive at a step is what my predecessor sends at that step
            assert reduce_scatter_recv(rank, world, step) == reduce_scatter_send(pred, world, step)
            assert all_gather_recv(rank, world, step) == all_gather_send(pred, world, step)
            rs_recv.add(reduce_scatter_recv(rank, world, step))
            ag_recv.add(all_gather_recv(rank, world, step))
            if step + 1 < world - 1:
                # a reduced segment is forwarded at the next step
                assert reduce_scatter_send(rank, world, step + 1) == reduce_scatter_recv(rank, world, step)
        assert owned_segment(rank, world) == (reduce_scatter_recv(rank, world, world - 2) if world > 1 else 0) or (
            world == 1
        )
        assert rank not in rs_recv
        assert owned_segment(rank, world) not in ag_recv or world == 1
        assert len(rs_recv) == len(ag_recv) == world - 1


@pytest.mark.parametrize(
    ("bw", "seg", "world", "lo", "hi"),
    [
        (1e9, 64 << 20, 2, 1 << 20, 4 << 20),  # loopback: large frames amortize per-frame cost
        (2.5e6, 10 << 20, 3, 64 << 10, 512 << 10),  # 20 Mbit/s: small chunks keep the pipeline short
        (float("nan"), 1 << 20, 4, 64 << 10, 4 << 20),  # unknown link
        (1e12, 1 << 10, 2, 4 << 20, 4 << 20),  # absurdly fast link: capped
        (1e3, 0, 1, 64 << 10, 64 << 10),  # tiny: floored
    ],
)
def test_choose_chunk_bytes(bw: float, seg: int, world: int, lo: int, hi: int) -> None:
    size = choose_chunk_bytes(bw, seg, world)
    assert lo <= size <= hi
    assert size % 4096 == 0


@given(bw=st.floats(1e3, 1e11), seg=st.integers(0, 1 << 30), world=st.integers(1, 64))
def test_chunk_bytes_within_bounds(bw: float, seg: int, world: int) -> None:
    size = choose_chunk_bytes(bw, seg, world, min_bytes=64 << 10, max_bytes=4 << 20)
    assert 64 << 10 <= size <= 4 << 20


def test_chunk_bytes_monotone_in_bandwidth() -> None:
    sizes = [choose_chunk_bytes(bw, 1 << 30, 4) for bw in (1e6, 1e7, 1e8, 1e9)]
    assert sizes == sorted(sizes)


@pytest.mark.parametrize("bw", [2.5e6, 12.5e6, 1e9])
@pytest.mark.parametrize("world", [2, 3, 8])
@pytest.mark.parametrize("ratio", [1.0, 0.5, 0.266, 0.1406, 0.0065])
def test_chunks_are_sized_in_wire_bytes(bw: float, world: int, ratio: float) -> None:
    """A chunk's wire bytes are what an fp32 chunk would carry; its elements scale with 1 / ratio."""
    seg = 50_000_000
    elems, wire = choose_chunk(bw, seg, world, ratio)
    assert wire == choose_chunk_bytes(bw, int(seg * 4 * ratio), world)
    assert elems * 4 * ratio <= wire + 4
    assert elems == max(1, int(wire / (4 * ratio)))
    fp32_elems, _ = choose_chunk(bw, seg, world, 1.0)
    # a codec that sends fewer bytes never gets noticeably more frames (the 4 KiB rounding aside)
    assert elems >= 0.95 * fp32_elems


def test_a_slow_link_sends_four_bit_chunks_with_seven_times_the_elements() -> None:
    """At 20 Mbit/s the per-frame cost sets the wire bytes per frame, whatever the codec (one layer's segment)."""
    fp32_elems, fp32_wire = choose_chunk(2.5e6, 1 << 17, 2, 1.0)
    int4_elems, int4_wire = choose_chunk(2.5e6, 1 << 17, 2, 0.1406)
    assert int4_wire == fp32_wire
    assert int4_elems == pytest.approx(fp32_elems / 0.1406, rel=1e-3)


@pytest.mark.parametrize("ratio", [0.0, -1.0, 3.0, float("nan")])
def test_chunk_wire_ratio_out_of_range_is_refused(ratio: float) -> None:
    with pytest.raises(ValueError, match="wire_ratio"):
        choose_chunk(2.5e6, 1000, 2, ratio)
