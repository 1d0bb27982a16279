"""Tests of the sparse ``topk`` codec: selection, levels, the wire format, and refusal of malformed payloads.

A reference writer builds payloads from the documented format (levels, then Elias-Fano low and high bit
planes, then 2-bit codes) with plain Python bit lists; the codec's own bytes must equal it, and crafted
variants of it must be refused with a precise error.
"""

from __future__ import annotations

import math
import struct

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import dreamp2p.v1.peer_pb2 as pb
from dreamp2p.collective.partition import split_chunks, split_segments
from dreamp2p.compression import CodecError, ErrorFeedback, NonFiniteError, codec_names, get_codec
from dreamp2p.schedule.linkcodec import wire_ratio

TOPK = get_codec("topk")
FLT_MAX = float(np.finfo(np.float32).max)
B = 4096
SIZES = [1, 2, 49, 50, 51, 99, 100, 1000, 4095, 4096, 4097, 8192, 10_000, (1 << 18) + 5]


def shape(w: int) -> tuple[int, int, int]:
    """(kept, low bits per index, high bitmap bits) of a block of ``w`` elements, from the format's text."""
    k = math.ceil(w / 50)
    low = math.floor(math.log2(w // k))
    return k, low, k + ((w - 1) >> low) + 1


def widths(n: int) -> list[int]:
    return [min(B, n - s) for s in range(0, n, B)]


def pack_bits(bits: list[int]) -> bytes:
    out = bytearray(-(-len(bits) // 8))
    for i, bit in enumerate(bits):
        out[i // 8] |= bit << (i % 8)
    return bytes(out)


def write(
    n: int,
    levels: list[tuple[float, float]],
    kept: list[list[tuple[int, int]]],
    bitmaps: dict[int, list[int]] | None = None,
) -> bytes:
    """A payload for ``n`` elements: per block its ``(lo, hi)`` and ``(index, code)`` pairs in order.

    ``bitmaps`` replaces a block's high bitmap (for crafting bad ones).
    """
    low_bits: list[int] = []
    high_bits: list[int] = []
    code_bits: list[int] = []
    for b, (w, pairs) in enumerate(zip(widths(n), kept, strict=True)):
        k, low, high = shape(w)
        assert len(pairs) == k
        bitmap = [0] * high
        for i, (x, code) in enumerate(pairs):
            low_bits += [(x >> j) & 1 for j in range(low)]
            bitmap[(x >> low) + i] = 1
            code_bits += [code & 1, (code >> 1) & 1]
        high_bits += (bitmaps or {}).get(b, bitmap)
    head = b"".join(struct.pack("<2f", lo, hi) for lo, hi in levels)
    return head + pack_bits(low_bits) + pack_bits(high_bits) + pack_bits(code_bits)


def reference(x: torch.Tensor) -> tuple[list[tuple[float, float]], list[list[tuple[int, int]]]]:
    """What the format's text says the encoder keeps: top-k per block (ties to the lower index), two levels."""
    levels, kept = [], []
    xs = x.double().tolist()
    for s in range(0, len(xs), B):
        blk = xs[s : s + B]
        k = shape(len(blk))[0]
        top = sorted(sorted(range(len(blk)), key=lambda i: (-abs(blk[i]), i))[:k])
        mags = [abs(blk[i]) for i in top]
        t, big = min(mags), max(mags)
        upper = [a >= (t + big) / 2 if t > 0 else a > 0 for a in mags]
        his = [a for a, u in zip(mags, upper, strict=True) if u]
        los = [a for a, u in zip(mags, upper, strict=True) if not u]
        hi = sum(his) / len(his) if his else 0.0
        lo = sum(los) / len(los) if los else hi
        levels.append((lo, hi))
        kept.append([(i, int(u) | (2 if blk[i] < 0 else 0)) for i, u in zip(top, upper, strict=True)])
    return levels, kept


def sample(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g) * 0.01


# ---------------------------------------------------------------- registry and sizes


def test_registered_as_a_sparse_lossy_codec() -> None:
    assert "topk" in codec_names()
    assert get_codec(7) is TOPK
    assert (TOPK.wire_id, TOPK.lossless, TOPK.sparse, TOPK.block, TOPK.itemsize) == (7, False, True, 4096, 1)
    assert not any(get_codec(c).sparse for c in codec_names() if c != "topk")


def test_wire_ids_mirror_the_proto_codec_enum() -> None:
    for name in codec_names():
        assert pb.Codec.Value(f"CODEC_{name.upper()}") == get_codec(name).wire_id
    assert len(pb.Codec.keys()) == len(codec_names()) + 1  # and CODEC_UNSPECIFIED


@pytest.mark.parametrize("n", [0, *SIZES])
def test_size_follows_from_n_as_documented(n: int) -> None:
    kept = [shape(w) for w in widths(n)]
    low = sum(k * lb for k, lb, _ in kept)
    high = sum(h for _, _, h in kept)
    count = sum(k for k, _, _ in kept)
    expect = 8 * len(kept) + -(-low // 8) + -(-high // 8) + -(-2 * count // 8)
    assert TOPK.encoded_nbytes(n) == expect
    assert TOPK.encode(sample(n, n)).numel() == expect


def test_bytes_per_element_as_promised() -> None:
    assert shape(B) == (82, 5, 210)
    assert TOPK.encoded_nbytes(B) == 108  # one block alone: each plane rounded up to a byte
    assert TOPK.encoded_nbytes(16 * B) == 16 * 106
    # what the planner and the per-link codec choice price it at: ~1/155 of fp32, ~1/22 of int4
    assert wire_ratio("topk") == pytest.approx(106 / (4 * B))
    assert TOPK.wire_ratio() == pytest.approx(106 / (4 * B))
    assert wire_ratio("int4") / wire_ratio("topk") > 20


# ---------------------------------------------------------------- what it keeps


@pytest.mark.parametrize("n", SIZES)
def test_bytes_equal_the_format_written_from_its_description(n: int) -> None:
    x = sample(n, n)
    levels, kept = reference(x)
    assert bytes(TOPK.encode(x).numpy()) == write(n, levels, kept)


@pytest.mark.parametrize("n", SIZES)
def test_round_trip_keeps_the_top_of_each_block(n: int) -> None:
    x = sample(n, 7 + n)
    y = TOPK.decode(TOPK.encode(x), n)
    assert y.dtype == torch.float32 and y.shape == (n,)
    for s in range(0, n, B):
        xb, yb = x[s : s + B], y[s : s + B]
        k = shape(xb.numel())[0]
        kept = torch.nonzero(yb).view(-1)
        assert kept.numel() == k
        assert set(kept.tolist()) == set(torch.topk(xb.abs(), k).indices.tolist())
        assert torch.equal(torch.sign(yb[kept]), torch.sign(xb[kept]))
        a, d = xb[kept].abs(), yb[kept].abs()
        # every kept value decodes to one of two levels that lie within the kept magnitudes
        assert len(set(d.tolist())) <= 2
        assert float(d.min()) >= float(a.min()) and float(d.max()) <= float(a.max())
        assert float((d - a).abs().max()) <= float(a.max() - a.min())
        # whatever was left out is no larger than the smallest kept value
        dropped = torch.ones(xb.numel(), dtype=torch.bool)
        dropped[kept] = False
        assert float(torch.cat([xb[dropped].abs(), torch.zeros(1)]).max()) <= float(a.min())


@pytest.mark.parametrize("n", [1, 2, 17, 49, 50])
def test_a_chunk_smaller_than_one_over_the_fraction_sends_its_largest_element_exactly(n: int) -> None:
    x = sample(n, n) + 0.5 * (torch.arange(n) % 3 - 1)
    y = TOPK.decode(TOPK.encode(x), n)
    i = int(torch.argmax(x.abs()))
    assert y[i] == x[i]
    assert int(torch.count_nonzero(y)) == 1


@pytest.mark.parametrize("n", [1, 100, 4096, 9000])
def test_all_zero_input_decodes_to_zeros(n: int) -> None:
    enc = TOPK.encode(torch.zeros(n))
    assert torch.equal(TOPK.decode(enc, n), torch.zeros(n))
    assert not bool(torch.signbit(TOPK.decode(enc, n)).any())


def test_ties_go_to_the_lower_index_and_equal_magnitudes_are_exact() -> None:
    x = torch.ones(B)
    x[1::2] = -1.0
    y = TOPK.decode(TOPK.encode(x), B)
    assert torch.equal(y[:82], x[:82])
    assert not bool(y[82:].any())
    # a tie at the cut-off: the lower of the equal ones is kept
    z = torch.zeros(B)
    z[100:200] = 0.5
    z[3000] = z[10] = 2.0
    kept = torch.nonzero(TOPK.decode(TOPK.encode(z), B)).view(-1).tolist()
    assert kept == [10, *range(100, 180), 3000]


def test_a_block_with_fewer_non_zeros_than_kept_decodes_its_zeros_as_zeros() -> None:
    x = torch.zeros(B)
    x[[5, 700, 701, 4000]] = torch.tensor([0.25, -1.0, 0.75, -0.5])
    y = TOPK.decode(TOPK.encode(x), B)
    assert set(torch.nonzero(y).view(-1).tolist()) == {5, 700, 701, 4000}
    assert torch.equal(torch.sign(y[[5, 700, 701, 4000]]), torch.tensor([1.0, -1.0, 1.0, -1.0]))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    arr=hnp.arrays(
        np.float32,
        st.integers(1, 2 * B + 300),
        elements=st.floats(-FLT_MAX, FLT_MAX, width=32, allow_nan=False, allow_infinity=False),
    )
)
def test_property_any_finite_input_decodes_finite_within_its_kept_range(arr: np.ndarray) -> None:
    x = torch.from_numpy(arr.copy())
    y = TOPK.decode(TOPK.encode(x), x.numel())
    assert bool(torch.isfinite(y).all())
    for s in range(0, x.numel(), B):
        xb, yb = x[s : s + B], y[s : s + B]
        assert int(torch.count_nonzero(yb)) <= shape(xb.numel())[0]
        kept = yb != 0
        if bool(kept.any()):
            a = xb[kept].abs()
            assert float(yb[kept].abs().min()) >= float(a.min()) and float(yb[kept].abs().max()) <= float(a.max())
            assert torch.equal(torch.sign(yb[kept]), torch.sign(xb[kept]))


@pytest.mark.parametrize("value", [FLT_MAX, -FLT_MAX, 1e-45, -3e-39])
def test_extremes_round_trip_exactly_when_the_kept_values_are_equal(value: float) -> None:
    x = torch.zeros(B + 10)
    x[::37] = value  # 111 of them in the first block, which keeps the lowest 82
    x[B + 4] = value  # the only one of the 10-element last block
    y = TOPK.decode(TOPK.encode(x), x.numel())
    kept = torch.nonzero(y).view(-1)
    assert kept.tolist() == [37 * i for i in range(82)] + [B + 4]
    assert bool((y[kept] == x[kept]).all())


def test_deterministic_and_block_aligned_chunks_decode_as_the_whole() -> None:
    n = 3 * B + 1234
    x = sample(n, 3)
    assert torch.equal(TOPK.encode(x), TOPK.encode(x.clone()))
    whole = TOPK.decode(TOPK.encode(x), n)
    # the ring cuts segments and chunks at multiples of the codec block: each chunk selects as the whole does
    for seg in split_segments(n, 3, TOPK.block):
        for c in split_chunks(seg, B, TOPK.block):
            part = TOPK.decode(TOPK.encode(x[c.start : c.stop].clone()), c.length)
            assert torch.equal(part, whole[c.start : c.stop])


def test_decode_into_out_and_from_every_container() -> None:
    x = sample(5000, 1)
    enc = TOPK.encode(x)
    out = torch.full((5000,), 9.0)
    res = TOPK.decode(enc, 5000, out=out)
    assert res.data_ptr() == out.data_ptr()
    for data in (bytes(enc.numpy()), bytearray(enc.numpy()), memoryview(bytes(enc.numpy()))):
        assert torch.equal(TOPK.decode(data, 5000), out)


# ---------------------------------------------------------------- refused input


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize(("n", "pos"), [(1, 0), (100, 99), (B, 3000), (3 * B + 5, 2 * B + 1), (3 * B + 5, 3 * B + 4)])
def test_non_finite_input_is_refused_naming_the_element(bad: float, n: int, pos: int) -> None:
    x = sample(n, 0)
    x[pos] = bad
    with pytest.raises(NonFiniteError, match=f"topk: input element {pos} is"):
        TOPK.encode(x)


@pytest.mark.parametrize("delta", [-1, 1])
def test_truncated_or_padded_payload_is_refused(delta: int) -> None:
    enc = bytes(TOPK.encode(sample(1000, 0)).numpy())
    data = enc[:delta] if delta < 0 else enc + b"\0"
    with pytest.raises(CodecError, match=f"expected {len(enc)} bytes for 1000 elements"):
        TOPK.decode(data, 1000)


def test_a_payload_for_another_count_is_refused() -> None:
    enc = TOPK.encode(sample(B, 0))
    with pytest.raises(CodecError, match="expected"):
        TOPK.decode(enc, B + 1)


def crafted(n: int = 1000) -> tuple[list[tuple[float, float]], list[list[tuple[int, int]]]]:
    return reference(sample(n, 5))


@pytest.mark.parametrize(
    ("n", "block", "fix", "match"),
    [
        (1000, 0, lambda p: p.__setitem__(-1, (1000, 1)), "block 0 index 1000 .* out of range for its 1000 elements"),
        (B, 0, lambda p: p.__setitem__(-1, (B + 5, 1)), "block 0 index 4101 .* out of range for its 4096 elements"),
        (1000, 0, lambda p: p.__setitem__(3, p[2]), "block 0 indices not strictly increasing: kept element 3"),
        (B + 9, 1, lambda p: p.__setitem__(0, p[0]), None),  # unchanged: the control case decodes
    ],
)
def test_bad_indices_are_refused(n: int, block: int, fix, match: str | None) -> None:  # type: ignore[no-untyped-def]
    levels, kept = crafted(n)
    fix(kept[block])
    data = write(n, levels, kept)
    if match is None:
        TOPK.decode(data, n)
        return
    with pytest.raises(CodecError, match=match):
        TOPK.decode(data, n)


def test_unsorted_indices_in_one_bucket_are_refused() -> None:
    levels, kept = crafted()
    pairs = kept[0]
    # two indices with the same high part in the wrong order: the bitmap is valid, the low bits decrease
    pairs[0], pairs[1] = (33, 1), (32, 1)
    with pytest.raises(CodecError, match="not strictly increasing: kept element 1 is 32 after 33"):
        TOPK.decode(write(1000, levels, kept), 1000)


@pytest.mark.parametrize("extra", [-1, 1])
def test_a_bitmap_with_the_wrong_count_is_refused(extra: int) -> None:
    levels, kept = crafted()
    k, low, high = shape(1000)
    bitmap = [0] * high
    for i, (x, _) in enumerate(kept[0]):
        bitmap[(x >> low) + i] = 1
    if extra < 0:
        bitmap[bitmap.index(1)] = 0
    else:
        bitmap[bitmap.index(0)] = 1
    with pytest.raises(CodecError, match=f"block 0 index bitmap has {k + extra} bits set, expected {k}"):
        TOPK.decode(write(1000, levels, kept, bitmaps={0: bitmap}), 1000)


@pytest.mark.parametrize(
    ("lo", "hi", "error", "match"),
    [
        (float("nan"), 1.0, NonFiniteError, "block 1 has level nan"),
        (0.5, float("inf"), NonFiniteError, "block 1 has level inf"),
        (-0.25, 1.0, CodecError, r"block 1 has levels lo=-0.25 hi=1.0; need 0 <= lo <= hi"),
        (2.0, 1.0, CodecError, r"block 1 has levels lo=2.0 hi=1.0"),
    ],
)
def test_bad_levels_are_refused(lo: float, hi: float, error: type[Exception], match: str) -> None:
    n = 2 * B
    levels, kept = reference(sample(n, 2))
    levels[1] = (lo, hi)
    with pytest.raises(error, match=match):
        TOPK.decode(write(n, levels, kept), n)


@pytest.mark.parametrize("plane", ["low", "high", "code"])
def test_non_zero_padding_bits_are_refused(plane: str) -> None:
    n = 1100  # k 22, 5 low bits: 110 low bits, 57 high bits, 44 code bits: every plane has padding
    data = bytearray(TOPK.encode(sample(n, 4)).numpy())
    ends = {"low": 8 + 14, "high": 8 + 14 + 8, "code": 8 + 14 + 8 + 6}
    assert len(data) == ends["code"]
    data[ends[plane] - 1] |= 0x80
    with pytest.raises(CodecError, match=f"non-zero padding bits after the .* bits of the {plane} plane"):
        TOPK.decode(bytes(data), n)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n=st.integers(1, 3 * B), seed=st.integers(0, 2**32 - 1))
def test_random_bytes_decode_to_finite_sparse_values_or_are_refused(n: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, TOPK.encoded_nbytes(n), dtype=np.uint8)
    # small finite levels, so that most payloads get past the level check to the index checks
    raw[: 8 * len(widths(n))] = (
        np.repeat(np.array([[0.5, 1.0]], dtype=np.float32), len(widths(n)), 0).view(np.uint8).ravel()
    )
    try:
        y = TOPK.decode(raw.tobytes(), n)
    except CodecError:
        return
    assert bool(torch.isfinite(y).all())
    assert int(torch.count_nonzero(y)) <= sum(shape(w)[0] for w in widths(n))


# ---------------------------------------------------------------- with error feedback


def test_error_feedback_carries_what_was_not_sent() -> None:
    """EF-SGD with top-k: the decoded running sum equals the true sum minus the residual at every round,
    and over rounds it stays near the truth while the sum of plain top-k encodes falls further behind."""
    ef = ErrorFeedback(TOPK)
    g = torch.Generator().manual_seed(0)
    sent, plain, true = torch.zeros(B), torch.zeros(B), torch.zeros(B)
    for _ in range(100):
        x = torch.randn(B, generator=g) * 0.01 + 0.003
        true += x
        sent += TOPK.decode(ef.encode("g", x), B)
        plain += TOPK.decode(TOPK.encode(x), B)
        residual = ef.residual("g")
        assert residual is not None
        assert torch.allclose(sent + residual, true, atol=1e-5)
    err_fb = float((sent - true).abs().mean())
    err_plain = float((plain - true).abs().mean())
    assert err_fb < 0.3 * err_plain, (err_fb, err_plain)
