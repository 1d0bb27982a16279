"""The sparse ``topk`` codec: the largest 2% of each 4096-element block, each sent as 2 bits plus its index.

SparseLoCo (Sarfi et al., arXiv 2508.15706) averages pseudo-gradients as the top-k 1-3% of each chunk of
a tensor, values quantized to 2 bits, and keeps what was not sent in an error-feedback accumulator. This
module is that compressor; the accumulator is the ring's (``dreamp2p.collective.feedback``), which carries
what each encode left out into the group's next round. Without error feedback 98% of every increment is
lost, and for parameters it would zero them: the codec is ``sparse`` and configurations refuse it there.

Wire format, ``topk`` (id 7), all little-endian. ``n`` elements in ``nb = ceil(n / 4096)`` blocks; a
block of ``w`` elements (4096, or the remainder for the last) keeps ``k = ceil(w / 50)`` of them (82 of
4096: 2.0%), ``K`` in all. Each block's sorted indices are Elias-Fano coded (Elias 1974; Fano 1971): with
``L = floor(log2(w / k))`` (5 for a full block), index ``x_i`` (``i = 0 .. k-1``) puts its low ``L`` bits
in the low plane and sets bit ``(x_i >> L) + i`` of the block's high bitmap of ``k + ((w - 1) >> L) + 1``
bits. Fields, each a concatenation over the blocks in order, sizes all following from ``n``:

* ``nb`` pairs of float32 ``(lo, hi)``: the block's two magnitude levels, ``0 <= lo <= hi``;
* the low plane: ``L`` bits per kept element;
* the high plane: every block's bitmap (exactly ``k`` bits set);
* the code plane: 2 bits per kept element, bit 0 picks ``hi`` over ``lo``, bit 1 is the sign.

Bit planes are packed least significant bit first (a value's bit ``j`` follows its bit ``j - 1``) and
padded with zero bits to a whole byte. A full block costs 8 + (82 * 5 + 210 + 82 * 2) / 8 = 106 bytes,
0.026 bytes per element (int4: 0.5625, fp32: 4), about 7.6 bits per index against the 7.0 of the entropy
of 82 positions among 4096; packed 12-bit indices would cost 152 bytes. zstd finds almost nothing left:
the low bits of sorted positions and the signs are close to uniform (the ring keeps whichever is smaller).

Selection keeps the ``k`` largest ``|x|`` of each block, ties to the lower index: it ranks the keys
``bits(|x|) * 4096 + 4095 - i``, all distinct, so the bytes are a function of the input alone, whatever
order ``torch.topk`` returns equal values in. Levels: with ``t`` and ``M`` the least and largest kept
magnitude, a kept element is ``hi`` when ``|x| >= (t + M) / 2``, and each level is the mean magnitude of
its elements (one Lloyd step of a two-level quantizer). When ``t = 0`` (the block has fewer than ``k``
non-zeros) the threshold is any positive magnitude, so zeros decode as ``lo = 0`` exactly.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from dreamp2p.compression.base import Codec, CodecError, NonFiniteError, register_codec
from dreamp2p.compression.codecs import _first_nonfinite, _reinterpret

__all__ = ["TOPK"]

_BLOCK = 4096
_KEEP_DEN = 50  # keep ceil(w / 50) of a block of w: 2%
_ROWS = 64  # blocks per tile: 1 MiB of float32 input, its int64 keys 2 MiB


class _Shape(NamedTuple):
    """One kind of block: its width, kept count, low bits per index and high bitmap length."""

    w: int
    k: int
    low: int
    high: int


def _shape(w: int) -> _Shape:
    k = -(-w // _KEEP_DEN)
    low = (w // k).bit_length() - 1  # floor(log2(w / k)), Elias-Fano's split
    return _Shape(w, k, low, k + ((w - 1) >> low) + 1)


_FULL = _shape(_BLOCK)


class _Layout(NamedTuple):
    """Where everything of ``n`` elements lies: ``full`` whole blocks, then ``last`` (None if none)."""

    full: int
    last: _Shape | None
    nb: int
    kept: int  # K, elements kept
    low_bits: int
    high_bits: int
    nbytes: int

    @property
    def planes(self) -> tuple[int, int, int, int]:
        """Byte offsets where the low, high and code planes start, and the end."""
        a = 8 * self.nb
        b = a + -(-self.low_bits // 8)
        c = b + -(-self.high_bits // 8)
        return a, b, c, c + -(-2 * self.kept // 8)


@functools.lru_cache(maxsize=512)
def _layout(n: int) -> _Layout:
    full, r = divmod(n, _BLOCK)
    last = _shape(r) if r else None
    shapes = [(full, _FULL)] + ([(1, last)] if last else [])
    kept = sum(m * s.k for m, s in shapes)
    low = sum(m * s.k * s.low for m, s in shapes)
    high = sum(m * s.high for m, s in shapes)
    nb = full + (1 if last else 0)
    nbytes = 8 * nb + -(-low // 8) + -(-high // 8) + -(-2 * kept // 8)
    return _Layout(full, last, nb, kept, low, high, nbytes)


def _to_bits(values: torch.Tensor, width: int) -> torch.Tensor:
    """``values`` (..., m) as (..., m * width) bits, least significant first."""
    shifts = torch.arange(width, dtype=torch.int64)
    bits = values.to(torch.int64).unsqueeze(-1).bitwise_right_shift(shifts).bitwise_and_(1)
    return bits.flatten(-2).to(torch.uint8)


def _from_bits(bits: torch.Tensor, width: int) -> torch.Tensor:
    """Inverse of :func:`_to_bits`: (..., m * width) bits to (..., m) int64 values."""
    weights = torch.ones(width, dtype=torch.int64).bitwise_left_shift_(torch.arange(width, dtype=torch.int64))
    return (bits.unflatten(-1, (-1, width)).to(torch.int64) * weights).sum(-1)


_BYTE_WEIGHTS = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)


def _pack(bits: torch.Tensor, dst: torch.Tensor) -> None:
    """Pack a 1-D 0/1 uint8 tensor into ``dst`` bytes, least significant bit first, zero-padded."""
    padded = torch.zeros(8 * dst.numel(), dtype=torch.uint8)
    padded[: bits.numel()] = bits
    # the eight weighted bits of a byte are disjoint powers of two: their uint8 sum cannot wrap
    torch.sum(padded.view(-1, 8).mul_(_BYTE_WEIGHTS), dim=1, dtype=torch.uint8, out=dst)


def _unpack(src: torch.Tensor) -> torch.Tensor:
    return _to_bits(src, 8)


class _TopK(Codec):
    """Top-2% of each 4096-element block with 2-bit values; meant for increments under error feedback."""

    name = "topk"
    wire_id = 7
    lossless = False
    sparse = True
    block = _BLOCK
    itemsize = 1

    def encoded_nbytes(self, n: int) -> int:
        self._check_n(n)
        return _layout(n).nbytes

    # ------------------------------------------------------------------ encode

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        x = self._check_input(x)
        n = x.numel()
        lay = _layout(n)
        out = torch.empty(lay.nbytes, dtype=torch.uint8)
        if n == 0:
            return out
        levels = out[: 8 * lay.nb].view(torch.float32).view(lay.nb, 2)
        low = torch.empty(lay.low_bits, dtype=torch.uint8)
        high = torch.empty(lay.high_bits, dtype=torch.uint8)
        codes = torch.empty(lay.kept, dtype=torch.uint8)
        f = _FULL
        for s in range(0, lay.full, _ROWS):
            e = min(lay.full, s + _ROWS)
            rows = x[s * f.w : e * f.w].view(e - s, f.w)
            self._encode_rows(
                rows,
                f,
                levels[s:e],
                low[s * f.k * f.low : e * f.k * f.low].view(e - s, -1),
                high[s * f.high : e * f.high].view(e - s, f.high),
                codes[s * f.k : e * f.k].view(e - s, f.k),
                s * f.w,
            )
        if lay.last is not None:
            g, s = lay.last, lay.full
            rows = x[s * f.w :].view(1, g.w)
            self._encode_rows(
                rows,
                g,
                levels[s:],
                low[s * f.k * f.low :].view(1, -1),
                high[s * f.high :].view(1, g.high),
                codes[s * f.k :].view(1, g.k),
                s * f.w,
            )
        a, b, c, end = lay.planes
        _pack(low, out[a:b])
        _pack(high, out[b:c])
        _pack(_to_bits(codes, 2), out[c:end])
        return out

    def _encode_rows(
        self,
        rows: torch.Tensor,
        shape: _Shape,
        levels: torch.Tensor,
        low: torch.Tensor,
        high: torch.Tensor,
        codes: torch.Tensor,
        base: int,
    ) -> None:
        """Blocks ``rows`` (m x w): their levels, Elias-Fano bits and value codes into the given slices."""
        sel, vals = self._select(rows, shape.k, base)
        self._quantize(vals, levels, codes)
        low.copy_(_to_bits(sel.bitwise_and((1 << shape.low) - 1), shape.low))
        high.zero_()
        ranks = torch.arange(shape.k, dtype=torch.int64)
        high.scatter_(1, sel.bitwise_right_shift(shape.low).add_(ranks), 1)

    def _select(self, rows: torch.Tensor, k: int, base: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Sorted indices of the ``k`` largest magnitudes of each row (ties to the lower index), and their values."""
        w = rows.shape[1]
        mag = rows.abs()
        # amax propagates NaN and |inf| = inf: the per-block maxima reveal any non-finite input.
        if not bool(torch.isfinite(mag.amax(dim=1)).all()):
            i, val = _first_nonfinite(rows)
            raise NonFiniteError(f"{self.name}: input element {base + i} is {val!r}")
        # Non-negative float32 bit patterns order like the values; the low 12 bits break ties to the lower index.
        keys = mag.view(torch.int32).to(torch.int64).mul_(_BLOCK)
        keys.add_(torch.arange(_BLOCK - 1, _BLOCK - 1 - w, -1, dtype=torch.int64))
        top = torch.topk(keys, k, dim=1, sorted=False).values
        sel = torch.sort(top.bitwise_and_(_BLOCK - 1).neg_().add_(_BLOCK - 1), dim=1).values
        return sel, rows.gather(1, sel)

    @staticmethod
    def _quantize(vals: torch.Tensor, levels: torch.Tensor, codes: torch.Tensor) -> None:
        """Two magnitude levels per row (one Lloyd step from the midpoint) and each value's 2-bit code."""
        k = vals.shape[1]
        # float64: a sum of 82 finite float32 magnitudes cannot overflow, and each mean fits float32 again
        a = vals.abs().double()
        t = a.amin(dim=1, keepdim=True)
        thr = torch.where(t > 0, (t + a.amax(dim=1, keepdim=True)) * 0.5, torch.full_like(t, 1e-300))
        upper = a >= thr
        n_hi = upper.sum(dim=1)
        s_hi = (a * upper).sum(dim=1)
        hi = torch.where(n_hi > 0, s_hi / n_hi.clamp(min=1), 0.0)
        # no element below the threshold: lo is never used, and lo = hi keeps 0 <= lo <= hi
        lo = torch.where(n_hi < k, (a * ~upper).sum(dim=1) / (k - n_hi).clamp(min=1), hi)
        # float32 rounding is monotonic, so lo < threshold <= hi survives it as lo <= hi
        levels[:, 0].copy_(lo)
        levels[:, 1].copy_(hi)
        torch.add(upper.to(torch.uint8), (vals < 0).to(torch.uint8), alpha=2, out=codes)

    # ------------------------------------------------------------------ decode

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
        lay = _layout(n)
        levels = _reinterpret(buf[: 8 * lay.nb], torch.float32).view(lay.nb, 2)
        self._check_levels(levels)
        a, b, c, end = lay.planes
        low = self._plane(buf[a:b], lay.low_bits, "low")
        high = self._plane(buf[b:c], lay.high_bits, "high")
        codes = _from_bits(self._plane(buf[c:end], 2 * lay.kept, "code"), 2)
        f = _FULL
        idx = torch.empty(lay.kept, dtype=torch.int64)
        if lay.full:
            rows = idx[: lay.full * f.k].view(lay.full, f.k)
            rows.copy_(self._indices(low[: lay.full * f.k * f.low], high[: lay.full * f.high], f, 0))
        if lay.last is not None:
            g = lay.last
            last = self._indices(low[lay.full * f.k * f.low :], high[lay.full * f.high :], g, lay.full)
            idx[lay.full * f.k :].copy_(last.view(-1))
        block_of = torch.arange(lay.kept, dtype=torch.int64).div_(f.k, rounding_mode="floor")
        mag = levels[block_of, codes.bitwise_and(1)]
        vals = torch.where(codes.bitwise_and(2).bool(), -mag, mag)
        res.zero_()
        # positions are unique (indices strictly increase within a block), so the scatter is deterministic
        res[block_of.mul_(_BLOCK).add_(idx)] = vals
        return res

    def _plane(self, src: torch.Tensor, nbits: int, what: str) -> torch.Tensor:
        """The first ``nbits`` bits of a plane; its padding bits must be zero."""
        bits = _unpack(src)
        if bool(bits[nbits:].any()):
            raise CodecError(f"{self.name}: non-zero padding bits after the {nbits} bits of the {what} plane")
        return bits[:nbits]

    def _indices(self, low: torch.Tensor, high: torch.Tensor, shape: _Shape, first: int) -> torch.Tensor:
        """Elias-Fano decoded indices of blocks ``first ..`` of ``shape``, checked: (m x k), in range, increasing."""
        bitmap = high.view(-1, shape.high)
        m = bitmap.shape[0]
        ones = bitmap.sum(dim=1, dtype=torch.int64)
        if bool((ones != shape.k).any()):
            j = int(torch.nonzero(ones != shape.k)[0, 0])
            raise CodecError(
                f"{self.name}: block {first + j} index bitmap has {int(ones[j])} bits set, expected {shape.k}"
            )
        pos = torch.nonzero(bitmap)[:, 1].view(m, shape.k)
        ranks = torch.arange(shape.k, dtype=torch.int64)
        idx = pos.sub_(ranks).bitwise_left_shift_(shape.low)
        if shape.low:
            idx.bitwise_or_(_from_bits(low.view(m, -1), shape.low))
        out_of_range = idx >= shape.w
        if bool(out_of_range.any()):
            b, j = (int(i) for i in torch.nonzero(out_of_range)[0])
            raise CodecError(
                f"{self.name}: block {first + b} index {int(idx[b, j])} (kept element {j}) is out of range "
                f"for its {shape.w} elements"
            )
        step = idx[:, 1:] <= idx[:, :-1]
        if bool(step.any()):
            b, j = (int(i) for i in torch.nonzero(step)[0])
            raise CodecError(
                f"{self.name}: block {first + b} indices not strictly increasing: kept element {j + 1} is "
                f"{int(idx[b, j + 1])} after {int(idx[b, j])}"
            )
        return idx

    def _check_levels(self, levels: torch.Tensor) -> None:
        finite = torch.isfinite(levels)
        if not bool(finite.all()):
            b, j = (int(i) for i in torch.nonzero(~finite)[0])
            raise NonFiniteError(f"{self.name}: block {b} has level {float(levels[b, j])!r}; levels must be finite")
        bad = (levels[:, 0] < 0) | (levels[:, 0] > levels[:, 1])
        if bool(bad.any()):
            b = int(torch.nonzero(bad)[0, 0])
            lo, hi = float(levels[b, 0]), float(levels[b, 1])
            raise CodecError(f"{self.name}: block {b} has levels lo={lo!r} hi={hi!r}; need 0 <= lo <= hi")


TOPK: Codec = _TopK()
register_codec(TOPK)
