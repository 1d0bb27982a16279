"""The built-in tensor codecs (fp32, fp16, bf16, int8, int4, e3m0, int2) and their registration.

Wire formats (all little-endian, ``n`` = element count, ``nb = ceil(n / 64)``):

* ``fp32`` (id 1): ``n`` raw float32 values. Lossless.
* ``fp16`` (id 2), ``bf16`` (id 3): ``n`` raw half-precision values (round to nearest even).
* ``int8`` (id 4): blockwise absmax quantization in the style of hivemind / bitsandbytes blockwise
  8-bit quantization (Dettmers et al., arXiv 2110.02861). ``[nb float32 scales][n uint8 codes]``; block
  ``b`` has scale ``s = absmax(block) / 127`` and element ``i`` stores ``round(x_i / s) + 128`` (so codes
  are 1..255; byte 0 is never produced and decodes as ``-128 * s``). The last block may be partial and
  its codes are not padded.
* ``int4`` (id 5): the same with 15 levels, ``s = absmax / 7``, code ``round(x / s) + 8`` in 1..15,
  packed two per byte. ``[nb float32 scales][ceil(n / 2) bytes]``. A block of ``w`` elements
  (``w = 64``, or for a partial last block of ``r`` elements ``w = r`` rounded up to even, the extra
  element being a zero) uses ``w / 2`` bytes: byte ``j`` holds code ``j`` in the low nibble and code
  ``j + w / 2`` in the high nibble. Pairing ``j`` with ``j + 32`` keeps both halves of the
  pack/unpack contiguous, which is what makes it fast.
* ``e3m0`` (id 6): the 4-bit sign + 3-bit exponent float of Streaming DiLoCo (Douillard et al.,
  arXiv 2501.18512). Block scale ``s = absmax``, nibble ``sign << 3 | k``: ``k = 0`` is zero and
  ``k = 1..7`` is ``2**(k - 7) * s`` (``s/64 .. s``). Rounding is to the nearest level in the linear
  domain (thresholds ``s/128`` and ``1.5 * 2**e * s``), so ``|err| <= max(|x| / 3, s / 128)``. Same
  scale/nibble layout as ``int4``.
* ``int2`` (id 8): four levels, ``s = absmax / 1.5``, code ``c`` in 0..3 decoding to ``(c - 1.5) * s``
  (``+-absmax``, ``+-absmax / 3``: no zero, so ``|err| <= absmax / 3``), packed four per byte. A block of
  ``w`` elements (64, or a partial last block rounded up to a multiple of 4 with zeros) uses ``w / 4``
  bytes: byte ``j`` holds codes ``j``, ``j + w/4``, ``j + w/2``, ``j + 3w/4`` in bits 0-1, 2-3, 4-5, 6-7.
  Meant for pseudo-gradients with error feedback, where a link cannot carry 4 bits of each in time.

Blockwise encoders work tile by tile (2**18 elements) so that their temporaries stay in cache, and write
straight into slices of the output. Blocks whose absmax is below ~2.9e-39 (denormal) encode as zeros,
an absolute error under 3e-39.
"""

from __future__ import annotations

import math
import threading

import numpy as np
import torch

from dreamp2p.compression.base import Codec, NonFiniteError, register_codec

__all__ = ["BF16", "E3M0", "FP16", "FP32", "INT2", "INT4", "INT8"]

_FLT_MAX = float(np.finfo(np.float32).max)
# Elements per tile: 1 MiB of float32, small enough that a tile and its temporaries stay in L2.
_TILE = 1 << 18
_BLOCK = 64


def _largest_safe_scale(level: int) -> float:
    """Largest float32 ``s`` with ``level * s`` finite in float32 arithmetic.

    ``FLT_MAX / 127`` rounds up, and ``127 * that`` overflows to inf; an encoder that stored it would
    emit data its own decoder must reject.
    """
    s = np.float32(_FLT_MAX) / np.float32(level)
    with np.errstate(over="ignore"):
        while not np.isfinite(np.float32(level) * s):
            s = np.nextafter(s, np.float32(0))
    return float(s)


class _Scratch(threading.local):
    """Per-thread tile buffers, so repeated encode/decode calls allocate almost nothing."""

    def __init__(self) -> None:
        self.bufs: dict[tuple[str, torch.dtype], torch.Tensor] = {}


_scratch = _Scratch()


def _buffer(tag: str, dtype: torch.dtype, numel: int) -> torch.Tensor:
    key = (tag, dtype)
    buf = _scratch.bufs.get(key)
    if buf is None or buf.numel() < numel:
        # zeros, not empty: the e3m0 decoder relies on bytes it never writes staying zero.
        buf = torch.zeros(max(numel, _TILE), dtype=dtype)
        _scratch.bufs[key] = buf
    return buf[:numel]


def _reinterpret(buf: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """View uint8 ``buf`` as ``dtype``, copying first only when the memory is misaligned for it."""
    size = torch.empty(0, dtype=dtype).element_size()
    if buf.data_ptr() % size != 0 or buf.storage_offset() % size != 0:
        buf = buf.clone()
    return buf.view(dtype)


def _first_nonfinite(x: torch.Tensor) -> tuple[int, float]:
    flat = x.reshape(-1)
    idx = int(torch.nonzero(~torch.isfinite(flat))[0, 0])
    return idx, float(flat[idx])


class _Cast(Codec):
    """Raw IEEE values of one float dtype; a finite input must stay finite after the cast."""

    block = 1
    dtype: torch.dtype

    def encoded_nbytes(self, n: int) -> int:
        self._check_n(n)
        return n * self.itemsize

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        x = self._check_input(x)
        n = x.numel()
        out = torch.empty(n * self.itemsize, dtype=torch.uint8)
        dst = out.view(self.dtype)
        for s in range(0, n, _TILE):
            e = min(n, s + _TILE)
            src = x[s:e]
            if self.dtype == torch.float32:
                self._check_finite(src, s, "input")
                dst[s:e].copy_(src)
            else:
                # Checking after the cast catches NaN/Inf and overflow to inf with one cheap reduction.
                dst[s:e].copy_(src)
                self._check_finite(dst[s:e], s, "input", src)
        return out

    def decode(
        self,
        data: torch.Tensor | bytes | bytearray | memoryview,
        n: int,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        buf = self._payload(data, n)
        res = self._output(out, n)
        if n == 0:
            return res
        src = _reinterpret(buf, self.dtype)
        for s in range(0, n, _TILE):
            e = min(n, s + _TILE)
            res[s:e].copy_(src[s:e])
            self._check_finite(res[s:e], s, "decoded")
        return res

    def _check_finite(self, t: torch.Tensor, base: int, what: str, orig: torch.Tensor | None = None) -> None:
        if t.numel() == 0:
            return
        mn, mx = torch.aminmax(t)
        # aminmax propagates NaN, so both ends finite means every element is.
        if math.isfinite(float(mn)) and math.isfinite(float(mx)):
            return
        idx, val = _first_nonfinite(t)
        if orig is not None and math.isfinite(float(orig[idx])):
            raise NonFiniteError(
                f"{self.name}: input element {base + idx} = {float(orig[idx])!r} overflows {self.name} "
                f"(max {torch.finfo(self.dtype).max!r})"
            )
        raise NonFiniteError(f"{self.name}: {what} element {base + idx} is {val!r}")


class _FP32(_Cast):
    """Lossless raw float32."""

    name = "fp32"
    wire_id = 1
    lossless = True
    itemsize = 4
    dtype = torch.float32


class _FP16(_Cast):
    """IEEE half precision: 11-bit significand, |x| < 65520 or the cast overflows."""

    name = "fp16"
    wire_id = 2
    lossless = False
    itemsize = 2
    dtype = torch.float16


class _BF16(_Cast):
    """bfloat16: float32's exponent range with an 8-bit significand."""

    name = "bf16"
    wire_id = 3
    lossless = False
    itemsize = 2
    dtype = torch.bfloat16


class _Blockwise(Codec):
    """Shared machinery of the 64-element-block codecs: scales first, then codes.

    Subclasses supply the per-tile quantize/dequantize kernels; this class validates, tiles the
    tensor, handles the partial last block and checks scales.
    """

    block = _BLOCK
    itemsize = 1
    lossless = False
    # stored scale = absmax / _scale_div
    _scale_div: float
    # Largest scale the encoder may store: every legitimate code must decode to a finite value.
    _max_scale: float
    # Above this scale a crafted (never encoded) code could decode to +-inf, so decoded tiles are checked.
    _overflow_scale: float
    # How many codes share a byte (1, 2 or 4).
    _per_byte: int

    def _code_bytes(self, n: int) -> int:
        return -(-n // self._per_byte)

    def _width(self, r: int) -> int:
        """Row width used for a partial last block of ``r`` elements."""
        return self._code_bytes(r) * self._per_byte

    def encoded_nbytes(self, n: int) -> int:
        self._check_n(n)
        return 4 * -(-n // _BLOCK) + self._code_bytes(n)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        x = self._check_input(x)
        n = x.numel()
        nb = -(-n // _BLOCK)
        out = torch.empty(self.encoded_nbytes(n), dtype=torch.uint8)
        scales = out[: 4 * nb].view(torch.float32)
        codes = out[4 * nb :]
        full = n - n % _BLOCK
        for s in range(0, full, _TILE):
            e = min(full, s + _TILE)
            rows = x[s:e].view(-1, _BLOCK)
            dst = codes[self._code_bytes(s) : self._code_bytes(e)].view(rows.shape[0], -1)
            self._encode_rows(rows, scales[s // _BLOCK : e // _BLOCK], dst, s)
        r = n - full
        if r:
            w = self._width(r)
            if w == r:
                rows = x[full:].view(1, r)
            else:
                rows = torch.zeros(1, w, dtype=torch.float32)
                rows[0, :r] = x[full:]
            self._encode_rows(rows, scales[nb - 1 :], codes[self._code_bytes(full) :].view(1, -1), full)
        return out

    def _encode_rows(self, rows: torch.Tensor, scales: torch.Tensor, codes: torch.Tensor, base: int) -> None:
        m, w = rows.shape
        mag = _buffer("f32", torch.float32, m * w).view(m, w)
        torch.abs(rows, out=mag)
        absmax = mag.amax(dim=1)
        # amax propagates NaN and |inf| = inf, so the small per-block maxima reveal any non-finite input.
        if not bool(torch.isfinite(absmax).all()):
            idx, val = _first_nonfinite(rows)
            raise NonFiniteError(f"{self.name}: input element {base + idx} is {val!r}")
        torch.div(absmax, self._scale_div, out=scales)
        scales.clamp_(max=self._max_scale)
        # Zero blocks (and denormal ones whose reciprocal overflows) get inv = 0 and encode as zeros.
        inv = torch.reciprocal(absmax).nan_to_num_(nan=0.0, posinf=0.0)
        self._quantize(rows, mag, inv.unsqueeze(1), codes)

    def _quantize(self, rows: torch.Tensor, mag: torch.Tensor, inv: torch.Tensor, codes: torch.Tensor) -> None:
        """Write the codes of ``rows``; ``mag`` holds ``|rows|`` and may be overwritten."""
        raise NotImplementedError

    def _dequantize(self, codes: torch.Tensor, scales: torch.Tensor, out: torch.Tensor) -> None:
        """Write ``out`` (rows x width) from ``codes`` and per-row ``scales`` (rows x 1)."""
        raise NotImplementedError

    def decode(
        self,
        data: torch.Tensor | bytes | bytearray | memoryview,
        n: int,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        buf = self._payload(data, n)
        res = self._output(out, n)
        if n == 0:
            return res
        nb = -(-n // _BLOCK)
        scales = _reinterpret(buf[: 4 * nb], torch.float32)
        self._check_scales(scales)
        codes = buf[4 * nb :]
        full = n - n % _BLOCK
        for s in range(0, full, _TILE):
            e = min(full, s + _TILE)
            dst = res[s:e].view(-1, _BLOCK)
            sc = scales[s // _BLOCK : e // _BLOCK]
            src = codes[self._code_bytes(s) : self._code_bytes(e)].view(dst.shape[0], -1)
            self._dequantize(src, sc.unsqueeze(1), dst)
            self._check_decoded(dst, sc, s)
        r = n - full
        if r:
            w = self._width(r)
            sc = scales[nb - 1 :]
            src = codes[self._code_bytes(full) :].view(1, -1)
            if w == r:
                dst = res[full:].view(1, r)
                self._dequantize(src, sc.unsqueeze(1), dst)
            else:
                dst = torch.empty(1, w, dtype=torch.float32)
                self._dequantize(src, sc.unsqueeze(1), dst)
                res[full:].copy_(dst[0, :r])
            self._check_decoded(res[full:].view(1, r), sc, full)
        return res

    def _check_scales(self, scales: torch.Tensor) -> None:
        mn, mx = torch.aminmax(scales)
        lo, hi = float(mn), float(mx)
        # NaN fails both comparisons.
        if lo >= 0.0 and hi <= _FLT_MAX:
            return
        bad = ~(torch.isfinite(scales) & (scales >= 0))
        idx = int(torch.nonzero(bad)[0, 0])
        raise NonFiniteError(
            f"{self.name}: block {idx} has scale {float(scales[idx])!r}; scales must be finite and >= 0"
        )

    def _check_decoded(self, dst: torch.Tensor, scales: torch.Tensor, base: int) -> None:
        # Only blocks with huge scales can overflow, so the common case costs one tiny max.
        if float(scales.max()) <= self._overflow_scale:
            return
        mn, mx = torch.aminmax(dst)
        if math.isfinite(float(mn)) and math.isfinite(float(mx)):
            return
        idx, val = _first_nonfinite(dst)
        block = (base + idx) // _BLOCK
        raise NonFiniteError(
            f"{self.name}: element {base + idx} decodes to {val!r} (block {block} scale "
            f"{float(scales[idx // dst.shape[1]])!r} with an out-of-range code)"
        )


class _INT8(_Blockwise):
    """Blockwise absmax int8, levels -127..127, codes stored as ``level + 128``."""

    name = "int8"
    wire_id = 4
    _per_byte = 1
    _scale_div = 127.0
    _max_scale = _largest_safe_scale(127)
    _overflow_scale = _FLT_MAX / 128.0

    def _quantize(self, rows: torch.Tensor, mag: torch.Tensor, inv: torch.Tensor, codes: torch.Tensor) -> None:
        t = torch.mul(rows, inv, out=mag)
        # Scale to +-127 after normalizing (not before): 127 / absmax overflows for tiny blocks.
        # Adding 128.5 makes the truncating float->uint8 cast round half up onto codes 1..255.
        t.mul_(127.0).add_(128.5)
        codes.copy_(t)

    def _dequantize(self, codes: torch.Tensor, scales: torch.Tensor, out: torch.Tensor) -> None:
        out.copy_(codes)
        out.sub_(128.0).mul_(scales)


class _INT4(_Blockwise):
    """Blockwise absmax int4, levels -7..7, codes ``level + 8`` packed two per byte."""

    name = "int4"
    wire_id = 5
    _per_byte = 2
    _scale_div = 7.0
    _max_scale = _largest_safe_scale(7)
    _overflow_scale = _FLT_MAX / 8.0

    def _quantize(self, rows: torch.Tensor, mag: torch.Tensor, inv: torch.Tensor, codes: torch.Tensor) -> None:
        m, w = rows.shape
        t = torch.mul(rows, inv, out=mag)
        t.mul_(7.0).add_(8.5)
        q = _buffer("u8a", torch.uint8, m * w).view(m, w)
        q.copy_(t)
        h = w // 2
        torch.add(q[:, :h], q[:, h:], alpha=16, out=codes)

    def _dequantize(self, codes: torch.Tensor, scales: torch.Tensor, out: torch.Tensor) -> None:
        m, h = codes.shape
        lo = _buffer("u8a", torch.uint8, m * h).view(m, h)
        hi = _buffer("u8b", torch.uint8, m * h).view(m, h)
        torch.bitwise_and(codes, 15, out=lo)
        torch.bitwise_right_shift(codes, 4, out=hi)
        out[:, :h].copy_(lo)
        out[:, h:].copy_(hi)
        out.sub_(8.0).mul_(scales)


# Bit pattern of 2**-7 as float32: normalized magnitudes at or above it round to a nonzero level,
# because 2**-7 is the linear midpoint between level 0 and the smallest level 2**-6.
_E3M0_ZERO_CUT = 120 << 23
# Adding half an exponent step's worth of mantissa carries into the exponent exactly when the
# significand is >= 1.5, i.e. at 1.5 * 2**e, the linear midpoint between 2**e and 2**(e+1).
_E3M0_ROUND = 1 << 22


class _E3M0(_Blockwise):
    """Blockwise 4-bit float with a sign bit and a 3-bit exponent, no mantissa."""

    name = "e3m0"
    wire_id = 6
    _per_byte = 2
    _scale_div = 1.0
    _max_scale = _FLT_MAX
    # Decoded magnitudes never exceed the scale, so a finite scale cannot overflow.
    _overflow_scale = math.inf

    def _quantize(self, rows: torch.Tensor, mag: torch.Tensor, inv: torch.Tensor, codes: torch.Tensor) -> None:
        m, w = rows.shape
        y = mag.mul_(inv)  # |x| / absmax, in [0, 1]
        bits = y.view(torch.int32)
        flag = _buffer("bool", torch.bool, m * w).view(m, w)
        torch.ge(bits, _E3M0_ZERO_CUT, out=flag)
        # Non-negative float32 bit patterns order like the values, and the rounded exponent field is
        # (bits + 2**22) >> 23; level k = exponent - 120 (2**(k-7)), clamped into 0..7.
        bits.add_(_E3M0_ROUND).bitwise_right_shift_(23)
        k = _buffer("u8a", torch.uint8, m * w).view(m, w)
        k.copy_(bits)
        k.clamp_(120, 127).sub_(120)
        torch.maximum(k, flag.view(torch.uint8), out=k)
        torch.lt(rows, 0.0, out=flag)
        torch.add(k, flag.view(torch.uint8), alpha=8, out=k)
        h = w // 2
        torch.add(k[:, :h], k[:, h:], alpha=16, out=codes)

    def _dequantize(self, codes: torch.Tensor, scales: torch.Tensor, out: torch.Tensor) -> None:
        # Build float16 values whose high byte is sign | exponent k (low byte zero): that is exactly
        # +-2**(k-15), and +-0 for k = 0, so no per-element branch or table lookup is needed.
        m, h = codes.shape
        w = 2 * h
        half = _buffer("f16", torch.float16, m * w)
        high = half.view(torch.uint8).view(m, w, 2)[:, :, 1]
        a = _buffer("u8a", torch.uint8, m * h).view(m, h)
        b = _buffer("u8b", torch.uint8, m * h).view(m, h)
        # low nibble s kkk -> high byte s 00kkk 00
        torch.bitwise_and(codes, 7, out=a).bitwise_left_shift_(2)
        torch.bitwise_and(codes, 8, out=b).bitwise_left_shift_(4)
        torch.bitwise_or(a, b, out=high[:, :h])
        # high nibble s kkk (bits 7..4) -> high byte s 00kkk 00
        torch.bitwise_right_shift(codes, 2, out=a).bitwise_and_(0x1C)
        torch.bitwise_and(codes, 0x80, out=b)
        torch.bitwise_or(a, b, out=high[:, h:])
        out.copy_(half.view(m, w))
        # 2**(k-15) * 2**8 = 2**(k-7); scaling in two steps keeps s * 256 from overflowing.
        out.mul_(256.0).mul_(scales)


class _INT2(_Blockwise):
    """Blockwise absmax 2-bit, levels -1.5..1.5 in steps of 1, codes ``level + 1.5`` packed four per byte."""

    name = "int2"
    wire_id = 8
    _per_byte = 4
    _scale_div = 1.5
    _max_scale = _largest_safe_scale(2)
    _overflow_scale = _FLT_MAX / 2.0

    def _quantize(self, rows: torch.Tensor, mag: torch.Tensor, inv: torch.Tensor, codes: torch.Tensor) -> None:
        m, w = rows.shape
        t = torch.mul(rows, inv, out=mag)
        # [-1, 1] -> [0, 3], then round half up by truncation; 3.5 (x = absmax) must stay code 3
        t.mul_(1.5).add_(2.0).clamp_(max=3.5)
        q = _buffer("u8a", torch.uint8, m * w).view(m, w)
        q.copy_(t)
        k = w // 4
        torch.add(q[:, :k], q[:, k : 2 * k], alpha=4, out=codes)
        codes.add_(q[:, 2 * k : 3 * k], alpha=16).add_(q[:, 3 * k :], alpha=64)

    def _dequantize(self, codes: torch.Tensor, scales: torch.Tensor, out: torch.Tensor) -> None:
        m, k = codes.shape
        part = _buffer("u8a", torch.uint8, m * k).view(m, k)
        for j in range(4):
            torch.bitwise_right_shift(codes, 2 * j, out=part).bitwise_and_(3)
            out[:, j * k : (j + 1) * k].copy_(part)
        out.sub_(1.5).mul_(scales)


FP32: Codec = _FP32()
FP16: Codec = _FP16()
BF16: Codec = _BF16()
INT8: Codec = _INT8()
INT4: Codec = _INT4()
E3M0: Codec = _E3M0()
INT2: Codec = _INT2()

for _codec in (FP32, FP16, BF16, INT8, INT4, E3M0, INT2):
    register_codec(_codec)
del _codec
