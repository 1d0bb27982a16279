"""Tests of dreamp2p.compression: codec round trips and error bounds, malformed input, zstd stage, EF."""

from __future__ import annotations

import struct
import warnings

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from dreamp2p.compression import (
    Codec,
    CodecError,
    ErrorFeedback,
    NonFiniteError,
    UnknownCodecError,
    ZstdStage,
    codec_names,
    get_codec,
    register_codec,
)

FLT_MAX = float(np.finfo(np.float32).max)
# Blocks whose absmax is below 1 / FLT_MAX (~2.9e-39) encode as zeros; see the codecs module docstring.
TINY = 3e-39
# Relative slack on the analytic bounds for float32 rounding inside the kernels (a few ulps).
SLACK = 1e-3

NAMES = ["fp32", "fp16", "bf16", "int8", "int4", "e3m0", "int2"]
BLOCKWISE = ["int8", "int4", "e3m0", "int2"]
# wire ids: topk (7, sparse) has its own tests in tests/unit/test_sparse_codec.py
WIRE_IDS = {"fp32": 1, "fp16": 2, "bf16": 3, "int8": 4, "int4": 5, "e3m0": 6, "int2": 8}
REGISTERED = ["fp32", "fp16", "bf16", "int8", "int4", "e3m0", "topk", "int2"]
SIZES = [0, 1, 2, 63, 64, 65, 127, 1000, 4099, 1 << 16]
# More than one 2**18-element tile plus a partial block, to cover the tile loop.
BIG = (1 << 18) + 3 * 64 + 5


def block_absmax(x: torch.Tensor) -> torch.Tensor:
    """Per-element absmax of the 64-element block each element lives in."""
    n = x.numel()
    pad = (-n) % 64
    blocks = torch.cat([x.abs(), torch.zeros(pad)]).view(-1, 64)
    return blocks.amax(dim=1).repeat_interleave(64)[:n]


def error_bound(name: str, x: torch.Tensor) -> torch.Tensor:
    """Largest |decoded - x| each codec may produce, per element (x must be representable by the codec)."""
    ax = x.abs().double()
    if name == "fp32":
        return torch.zeros_like(ax)
    if name == "fp16":
        # 11-bit significand: half an ulp is 2**-11 relative; subnormal spacing is 2**-24.
        return ax * 2.0**-11 + 2.0**-25
    if name == "bf16":
        return ax * 2.0**-8 + 2.0**-134
    am = block_absmax(x).double()
    if name == "int8":
        return am / 254 * (1 + SLACK) + TINY
    if name == "int4":
        return am / 14 * (1 + SLACK) + TINY
    if name == "int2":
        # levels +-absmax and +-absmax / 3, no zero: half a step is absmax / 3
        return am / 3 * (1 + SLACK) + TINY
    # e3m0: levels 0 and 2**-6..1 times absmax, rounded to the nearest in the linear domain. Between
    # 2**e and 2**(e+1) the worst case is at the midpoint 1.5 * 2**e, error 2**e / 2 = |x| / 3; below
    # the smallest level the error is at most the midpoint absmax / 128.
    return torch.maximum(ax / 3, am / 128) * (1 + SLACK) + TINY


def assert_within_bound(name: str, x: torch.Tensor, y: torch.Tensor) -> None:
    assert y.dtype == torch.float32
    assert y.shape == x.shape
    assert bool(torch.isfinite(y).all())
    err = (y.double() - x.double()).abs()
    bound = error_bound(name, x)
    worst = int(torch.argmax(err - bound)) if x.numel() else 0
    assert bool((err <= bound).all()), (
        f"{name}: element {worst} x={float(x[worst])!r} y={float(y[worst])!r} "
        f"err={float(err[worst])!r} > bound {float(bound[worst])!r}"
    )


def sample(n: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=gen) * 3
    if n > 10:
        # a zero block-ish region and a few outliers make the per-block scales differ
        x[: min(n, 70)] *= 1e-3
        x[n // 2] = 50.0
    return x


# ---------------------------------------------------------------- registry and attributes


def test_registry_order_and_ids() -> None:
    assert codec_names() == REGISTERED
    for name, wire_id in WIRE_IDS.items():
        assert get_codec(name).wire_id == wire_id
        assert get_codec(wire_id) is get_codec(name)
        assert get_codec(name.upper()) is get_codec(name)


def test_codec_attributes() -> None:
    assert [get_codec(n).lossless for n in NAMES] == [True, False, False, False, False, False, False]
    assert [get_codec(n).block for n in NAMES] == [1, 1, 1, 64, 64, 64, 64]
    assert [get_codec(n).itemsize for n in NAMES] == [4, 2, 2, 1, 1, 1, 1]


@pytest.mark.parametrize("key", ["nope", "", 0, 9, 99, -1, True])
def test_unknown_codec(key: str | int) -> None:
    with pytest.raises(UnknownCodecError) as info:
        get_codec(key)
    for name in NAMES:
        assert name in str(info.value)
    assert isinstance(info.value, CodecError)


def test_register_refuses_duplicates() -> None:
    with pytest.raises(ValueError, match="already registered"):
        register_codec(get_codec("int8"))

    class Clash(Codec):
        name = "int8-clash"
        wire_id = 4
        lossless = False
        block = 1
        itemsize = 1

        def encoded_nbytes(self, n: int) -> int:
            return n

        def encode(self, x: torch.Tensor) -> torch.Tensor:
            return x.to(torch.uint8)

        def decode(
            self, data: torch.Tensor | bytes | bytearray | memoryview, n: int, out: torch.Tensor | None = None
        ) -> torch.Tensor:
            return torch.zeros(n)

    with pytest.raises(ValueError, match="wire id 4"):
        register_codec(Clash())
    assert codec_names() == REGISTERED


# ---------------------------------------------------------------- round trips


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("n", [*SIZES, BIG])
def test_round_trip(name: str, n: int) -> None:
    codec = get_codec(name)
    x = sample(n, seed=n)
    enc = codec.encode(x)
    assert enc.dtype == torch.uint8 and enc.ndim == 1 and enc.is_contiguous()
    assert enc.numel() == codec.encoded_nbytes(n)
    y = codec.decode(enc, n)
    assert_within_bound(name, x, y)
    # the same bytes in every accepted container decode identically
    raw = bytes(enc.numpy())
    assert torch.equal(codec.decode(raw, n), y)
    assert torch.equal(codec.decode(bytearray(raw), n), y)
    assert torch.equal(codec.decode(memoryview(raw), n), y)
    # encoding is deterministic
    assert torch.equal(codec.encode(x), enc)


@pytest.mark.parametrize("name", NAMES)
def test_exact_reference(name: str) -> None:
    x = sample(5000, seed=1)
    y = get_codec(name).decode(get_codec(name).encode(x), x.numel())
    if name == "fp32":
        assert torch.equal(y, x)
    elif name == "fp16":
        assert torch.equal(y, x.half().float())
    elif name == "bf16":
        assert torch.equal(y, x.bfloat16().float())


@pytest.mark.parametrize("name", BLOCKWISE)
def test_quantized_levels(name: str) -> None:
    """Decoded values sit exactly on the codec's grid: integer multiples (int) or powers of two (e3m0)."""
    x = sample(640, seed=2)
    codec = get_codec(name)
    enc = codec.encode(x)
    y = codec.decode(enc, 640).view(-1, 64).double()
    scales = torch.from_numpy(enc[: 4 * 10].numpy().view(np.float32).copy()).double().unsqueeze(1)
    rel = y / scales
    if name == "int8":
        assert torch.allclose(rel, rel.round(), atol=1e-4) and rel.round().abs().max() <= 127
    elif name == "int4":
        assert torch.allclose(rel, rel.round(), atol=1e-5) and rel.round().abs().max() <= 7
    elif name == "int2":
        # half-integers: -1.5, -0.5, 0.5, 1.5
        assert torch.allclose(rel + 0.5, (rel + 0.5).round(), atol=1e-5) and rel.abs().max() <= 1.5 + 1e-5
    else:
        mags = rel.abs()[rel != 0]
        levels = torch.tensor([2.0**-k for k in range(7)], dtype=torch.float64)
        assert bool(torch.isclose(mags.unsqueeze(1), levels, rtol=1e-6).any(dim=1).all())


def test_e3m0_rounding_is_nearest_linear() -> None:
    """Exact thresholds: s/128 between 0 and s/64, 1.5 * 2**e between 2**e and 2**(e+1)."""
    codec = get_codec("e3m0")
    below = np.nextafter(np.float32(1 / 128), np.float32(0))
    vals = [1.0, 1 / 128, float(below), 0.75, 0.7499999, 3 / 128, 0.0234374, -0.75, -0.7499999]
    want = [1.0, 1 / 64, 0.0, 1.0, 0.5, 1 / 32, 1 / 64, -1.0, -0.5]
    y = codec.decode(codec.encode(torch.tensor(vals, dtype=torch.float32)), len(vals))
    assert y.tolist() == pytest.approx(want)


@pytest.mark.parametrize("name", NAMES)
def test_block_aligned_chunks_match_whole(name: str) -> None:
    """Callers cut chunks at multiples of `block`: each chunk must decode exactly as in the whole."""
    codec = get_codec(name)
    x = sample(64 * 40 + 17, seed=3)
    whole = codec.decode(codec.encode(x), x.numel())
    cut = 64 * 13
    parts = [x[:cut], x[cut:]]
    pieces = [codec.decode(codec.encode(p.contiguous()), p.numel()) for p in parts]
    assert torch.equal(torch.cat(pieces), whole)


@pytest.mark.parametrize("name", NAMES)
def test_decode_into_out(name: str) -> None:
    codec = get_codec(name)
    x = sample(300, seed=4)
    enc = codec.encode(x)
    out = torch.full((300,), 7.0)
    res = codec.decode(enc, 300, out=out)
    assert res.data_ptr() == out.data_ptr()
    assert torch.equal(out, codec.decode(enc, 300))
    big = torch.zeros(400)
    codec.decode(enc, 300, out=big[50:350])
    assert torch.equal(big[50:350], out) and not big[:50].any() and not big[350:].any()
    with pytest.raises(CodecError, match="300 elements"):
        codec.decode(enc, 300, out=torch.empty(299))
    with pytest.raises(CodecError, match="float32"):
        codec.decode(enc, 300, out=torch.empty(300, dtype=torch.float64))


@pytest.mark.parametrize("name", NAMES)
def test_decode_misaligned_and_readonly(name: str) -> None:
    codec = get_codec(name)
    x = sample(200, seed=5)
    enc = codec.encode(x)
    shifted = torch.empty(enc.numel() + 1, dtype=torch.uint8)
    shifted[1:] = enc
    want = codec.decode(enc, 200)
    assert torch.equal(codec.decode(shifted[1:], 200), want)
    raw = bytes(enc.numpy())
    assert torch.equal(codec.decode(memoryview(b"\0" + raw)[1:], 200), want)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert torch.equal(codec.decode(raw, 200), want)


@pytest.mark.parametrize("name", NAMES)
def test_decode_does_not_mutate(name: str) -> None:
    codec = get_codec(name)
    x = sample(1000, seed=6)
    enc = codec.encode(x)
    keep = enc.clone()
    codec.decode(enc, 1000)
    assert torch.equal(enc, keep)
    buf = bytearray(enc.numpy().tobytes())
    codec.decode(buf, 1000)
    assert bytes(buf) == bytes(keep.numpy())


@pytest.mark.parametrize("name", NAMES)
def test_encode_does_not_mutate_and_accepts_grad(name: str) -> None:
    codec = get_codec(name)
    x = sample(130, seed=7).requires_grad_(True)
    keep = x.detach().clone()
    enc = codec.encode(x)
    assert torch.equal(x.detach(), keep)
    assert enc.numel() == codec.encoded_nbytes(130)


# ---------------------------------------------------------------- malformed input


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("delta", [-1, 1])
def test_wrong_length(name: str, delta: int) -> None:
    codec = get_codec(name)
    expected = codec.encoded_nbytes(1000)
    data = bytes(expected + delta)
    with pytest.raises(CodecError) as info:
        codec.decode(data, 1000)
    assert str(info.value) == f"{name}: expected {expected} bytes for 1000 elements, got {expected + delta}"


def test_int8_length_message() -> None:
    with pytest.raises(CodecError, match=r"^int8: expected 1064 bytes for 1000 elements, got 1063$"):
        get_codec("int8").decode(bytes(1063), 1000)


@pytest.mark.parametrize("name", NAMES)
def test_bad_arguments(name: str) -> None:
    codec = get_codec(name)
    with pytest.raises(CodecError, match="float32"):
        codec.encode(torch.zeros(8, dtype=torch.float64))
    with pytest.raises(CodecError, match="1-D"):
        codec.encode(torch.zeros(2, 4))
    with pytest.raises(CodecError, match="uint8"):
        codec.decode(torch.zeros(codec.encoded_nbytes(4), dtype=torch.int8), 4)
    with pytest.raises(CodecError):
        codec.decode(b"", -1)
    with pytest.raises(CodecError):
        codec.encoded_nbytes(-1)
    with pytest.raises(CodecError):
        codec.decode("abc", 1)  # type: ignore[arg-type]


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize(("n", "pos"), [(1, 0), (100, 3), (100, 99), (1000, 640), (BIG, BIG - 1)])
def test_nonfinite_input(name: str, bad: float, n: int, pos: int) -> None:
    x = torch.randn(n)
    x[pos] = bad
    with pytest.raises(NonFiniteError, match=rf"element {pos}\b"):
        get_codec(name).encode(x)


@pytest.mark.parametrize(("name", "value"), [("fp16", 70000.0), ("fp16", -65520.0), ("bf16", FLT_MAX)])
def test_cast_overflow_refused(name: str, value: float) -> None:
    x = torch.zeros(10)
    x[4] = value
    with pytest.raises(NonFiniteError, match=r"element 4 .* overflows"):
        get_codec(name).encode(x)


@pytest.mark.parametrize("name", BLOCKWISE)
@pytest.mark.parametrize("scale", [float("nan"), float("inf"), -1.0, -1e-30])
def test_bad_scale(name: str, scale: float) -> None:
    codec = get_codec(name)
    enc = bytearray(codec.encode(torch.randn(200)).numpy().tobytes())
    enc[4 * 2 : 4 * 3] = struct.pack("<f", scale)
    with pytest.raises(NonFiniteError, match="block 2 has scale"):
        codec.decode(enc, 200)


BAD_PATTERNS = [
    ("fp16", b"\x00\x7c"),  # +inf
    ("fp16", b"\x00\xfc"),  # -inf
    ("fp16", b"\x00\x7e"),  # nan
    ("bf16", b"\x80\x7f"),  # +inf
    ("bf16", b"\xc0\xff"),  # nan
    ("fp32", struct.pack("<f", float("inf"))),
    ("fp32", struct.pack("<f", float("nan"))),
]


@pytest.mark.parametrize(("name", "pattern"), BAD_PATTERNS)
def test_nonfinite_bit_patterns(name: str, pattern: bytes) -> None:
    codec = get_codec(name)
    good = bytes(codec.encode(torch.ones(5)).numpy())
    size = codec.itemsize
    bad = good[: 3 * size] + pattern + good[4 * size :]
    with pytest.raises(NonFiniteError, match="element 3"):
        codec.decode(bad, 5)


def test_int8_crafted_overflow() -> None:
    """The largest legal scale decodes every legal code; byte 0 (never encoded) would overflow."""
    codec = get_codec("int8")
    x = torch.tensor([FLT_MAX, -FLT_MAX, 1.0], dtype=torch.float32)
    y = codec.decode(codec.encode(x), 3)
    assert bool(torch.isfinite(y).all())
    assert_within_bound("int8", x, y)
    enc = bytearray(codec.encode(x).numpy().tobytes())
    enc[4 + 1] = 0
    with pytest.raises(NonFiniteError, match="element 1 decodes to"):
        codec.decode(enc, 3)


@pytest.mark.parametrize("name", BLOCKWISE)
def test_extremes_and_denormals(name: str) -> None:
    codec = get_codec(name)
    parts = [
        torch.full((64,), FLT_MAX),
        torch.full((64,), -3e38),
        torch.linspace(-1e-42, 1e-42, 64),
        torch.linspace(-1e-38, 1e-38, 64),
        torch.zeros(64),
        torch.tensor([1e-45, -1e-45, 3e38, -3e38, 1.0, 0.0, 7e-39]),
    ]
    x = torch.cat(parts)
    y = codec.decode(codec.encode(x), x.numel())
    assert_within_bound(name, x, y)


# ---------------------------------------------------------------- property tests

FINITE32 = st.floats(width=32, allow_nan=False, allow_infinity=False)
SPECIAL = st.sampled_from([0.0, -0.0, 3e38, -3e38, FLT_MAX, -FLT_MAX, 1e-42, -1e-42, 1e-45, 1.0, -1.0, 65504.0])
ELEMENTS = st.one_of(FINITE32, SPECIAL, st.floats(-10, 10, width=32))


def arrays(elements: st.SearchStrategy[float]) -> st.SearchStrategy[np.ndarray]:
    shapes = hnp.array_shapes(min_dims=1, max_dims=3, min_side=0, max_side=24)
    return hnp.arrays(np.float32, shapes, elements=elements)


PROPERTY = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@PROPERTY
@given(arr=arrays(ELEMENTS), name=st.sampled_from(NAMES))
def test_property_round_trip(arr: np.ndarray, name: str) -> None:
    codec = get_codec(name)
    x = torch.from_numpy(arr.reshape(-1).copy())
    if name in ("fp16", "bf16"):
        ref = x.to(torch.float16 if name == "fp16" else torch.bfloat16)
        if not bool(torch.isfinite(ref).all()):
            with pytest.raises(NonFiniteError):
                codec.encode(x)
            return
    enc = codec.encode(x)
    assert enc.numel() == codec.encoded_nbytes(x.numel())
    assert_within_bound(name, x, codec.decode(enc, x.numel()))


@PROPERTY
@given(
    arr=arrays(ELEMENTS).filter(lambda a: a.size > 0),
    name=st.sampled_from(NAMES),
    bad=st.sampled_from([float("nan"), float("inf"), float("-inf")]),
    where=st.floats(0, 1),
)
def test_property_nonfinite_refused(arr: np.ndarray, name: str, bad: float, where: float) -> None:
    flat = arr.reshape(-1).copy()
    flat[min(int(where * flat.size), flat.size - 1)] = bad
    with pytest.raises(NonFiniteError):
        get_codec(name).encode(torch.from_numpy(flat))


@st.composite
def payloads(draw: st.DrawFn) -> tuple[str, bytes, int]:
    name = draw(st.sampled_from(NAMES))
    n = draw(st.integers(0, 300))
    size = get_codec(name).encoded_nbytes(n)
    if draw(st.booleans()):
        data = draw(st.binary(min_size=size, max_size=size))
        if name in BLOCKWISE and draw(st.booleans()):
            # plausible scales, so that the code bytes are exercised instead of failing on a scale
            nb = -(-n // 64)
            scales = draw(st.lists(st.floats(0, FLT_MAX, width=32), min_size=nb, max_size=nb))
            data = struct.pack(f"<{nb}f", *scales) + data[4 * nb :]
    else:
        data = draw(st.binary(max_size=2 * size + 8))
    return name, data, n


@settings(max_examples=200, deadline=None)
@given(payload=payloads())
def test_property_random_bytes(payload: tuple[str, bytes, int]) -> None:
    name, data, n = payload
    codec = get_codec(name)
    try:
        y = codec.decode(data, n)
    except CodecError:
        return
    assert y.dtype == torch.float32 and y.numel() == n
    assert bool(torch.isfinite(y).all())


# ---------------------------------------------------------------- zstd stage


@pytest.mark.parametrize("itemsize", [1, 2, 4])
@pytest.mark.parametrize("nbytes", [0, 4, 1000, 1 << 20])
def test_zstd_round_trip(itemsize: int, nbytes: int) -> None:
    stage = ZstdStage()
    raw = np.random.default_rng(nbytes).integers(0, 16, nbytes, dtype=np.uint8).tobytes()
    packed = stage.compress(raw, itemsize)
    assert stage.decompress(packed, nbytes, itemsize, max_bytes=nbytes) == raw
    assert stage.decompress(memoryview(packed), nbytes, itemsize, max_bytes=1 << 30) == raw


def test_zstd_accepts_tensors() -> None:
    stage = ZstdStage(level=3)
    x = torch.randn(4096)
    packed = stage.compress(x, 4)
    assert stage.compress(x.view(torch.uint8), 4) == packed
    out = stage.decompress(packed, 4 * 4096, 4, max_bytes=1 << 20)
    assert torch.equal(torch.frombuffer(bytearray(out), dtype=torch.float32), x)


def test_zstd_shuffle_helps() -> None:
    stage = ZstdStage()
    zeros = bytes(4 << 20)
    assert len(stage.compress(zeros, 4)) < len(zeros) // 1000
    # zstd's entropy stage works per 128 KiB block, so the data must span several blocks for the
    # shuffle (which separates the low-entropy exponent bytes from the noisy mantissa bytes) to show.
    x = bytes(torch.randn(1 << 18).view(torch.uint8).numpy())
    assert len(stage.compress(x, 4)) < 0.95 * len(stage.compress(x, 1))


def test_zstd_errors() -> None:
    stage = ZstdStage()
    raw = bytes(range(256)) * 64
    packed = stage.compress(raw, 4)
    n = len(raw)
    with pytest.raises(CodecError, match="OVERSIZE"):
        stage.decompress(packed, n, 4, max_bytes=n - 1)
    with pytest.raises(CodecError, match="declares 16384 bytes, expected 16380"):
        stage.decompress(packed, n - 4, 4, max_bytes=1 << 20)
    with pytest.raises(CodecError):
        stage.decompress(packed[:-1], n, 4, max_bytes=1 << 20)
    with pytest.raises(CodecError):
        stage.decompress(packed[:5], n, 4, max_bytes=1 << 20)
    with pytest.raises(CodecError, match="zstd"):
        stage.decompress(b"not a zstd frame at all", n, 4, max_bytes=1 << 20)
    with pytest.raises(CodecError):
        stage.decompress(b"", n, 4, max_bytes=1 << 20)
    with pytest.raises(CodecError):
        stage.decompress(packed + b"trailing", n, 4, max_bytes=1 << 20)
    corrupt = bytearray(packed)
    corrupt[len(corrupt) // 2] ^= 0xFF
    with pytest.raises(CodecError):
        stage.decompress(bytes(corrupt), n, 4, max_bytes=1 << 20)
    with pytest.raises(CodecError, match="multiple of itemsize"):
        stage.compress(b"abc", 2)
    with pytest.raises(CodecError, match="multiple of itemsize"):
        stage.decompress(packed, n + 1, 2, max_bytes=1 << 20)


def test_zstd_declared_size_beyond_limit_not_allocated() -> None:
    """A frame claiming a huge size is refused from its header alone."""
    stage = ZstdStage()
    huge = stage.compress(bytes(1 << 24), 1)
    with pytest.raises(CodecError, match="OVERSIZE"):
        stage.decompress(huge, 1 << 10, 1, max_bytes=1 << 10)


@settings(max_examples=100, deadline=None)
@given(data=st.binary(max_size=200), raw_length=st.integers(0, 4096), itemsize=st.sampled_from([1, 2, 4]))
def test_property_zstd_garbage(data: bytes, raw_length: int, itemsize: int) -> None:
    stage = ZstdStage()
    try:
        out = stage.decompress(data, raw_length, itemsize, max_bytes=4096)
    except CodecError:
        return
    assert len(out) == raw_length


# ---------------------------------------------------------------- error feedback


@pytest.mark.parametrize("name", BLOCKWISE)
def test_error_feedback_tracks_sum(name: str) -> None:
    codec = get_codec(name)
    rounds = 300
    gen = torch.Generator().manual_seed(0)
    # One big value per block pins the scale, so the small ones sit below half a quantization step
    # and plain rounding loses them every round.
    base = torch.full((640,), 0.003)
    base[::64] = 1.0
    ef = ErrorFeedback(codec)
    sum_in = torch.zeros(640, dtype=torch.float64)
    sum_ef = torch.zeros(640, dtype=torch.float64)
    sum_plain = torch.zeros(640, dtype=torch.float64)
    for _ in range(rounds):
        x = base + 1e-4 * torch.randn(640, generator=gen)
        sum_in += x.double()
        sum_ef += codec.decode(ef.encode("w", x), 640).double()
        sum_plain += codec.decode(codec.encode(x), 640).double()
    residual = ef.residual("w")
    assert residual is not None
    # telescoping: what was sent so far equals what was offered minus what is still owed
    assert torch.allclose(sum_in - sum_ef, residual.double(), atol=1e-3)
    # and what is owed is at most one quantization step of the (compensated) block
    step = {"int8": 1.0 / 127, "int4": 1.0 / 7, "e3m0": 0.5, "int2": 2.0 / 3}[name]
    ef_err = float((sum_in - sum_ef).abs().max())
    plain_err = float((sum_in - sum_plain).abs().max())
    assert ef_err <= step * 1.1
    assert plain_err > 5 * ef_err


def test_error_feedback_bookkeeping() -> None:
    ef = ErrorFeedback(get_codec("int4"))
    x = torch.randn(100)
    ef.encode("a", x)
    ef.encode(("b", 1), x)
    assert ef.residual("a") is not None and ef.residual(("b", 1)) is not None
    with pytest.raises(ValueError, match="reset"):
        ef.encode("a", torch.randn(101))
    before = ef.residual("a").clone()  # type: ignore[union-attr]
    with pytest.raises(NonFiniteError):
        ef.encode("a", torch.full((100,), float("nan")))
    assert torch.equal(ef.residual("a"), before)  # type: ignore[arg-type]
    ef.reset("a")
    assert ef.residual("a") is None and ef.residual(("b", 1)) is not None
    ef.reset()
    assert ef.residual(("b", 1)) is None


def test_error_feedback_lossless_stores_nothing() -> None:
    codec: Codec = get_codec("fp32")
    ef = ErrorFeedback(codec)
    x = torch.randn(50)
    assert torch.equal(codec.decode(ef.encode("k", x), 50), x)
    assert ef.residual("k") is None
