"""Lossless stage applied after a codec: byte-shuffle then zstd, with bounded decompression."""

from __future__ import annotations

import threading

import numpy as np
import torch
import zstandard

from dreamp2p.compression.base import CodecError

__all__ = ["ZstdStage"]

# zstd's fastest negative level (ZSTD_minCLevel); python-zstandard does not export it.
_MIN_LEVEL = -(1 << 17)


def _as_numpy_bytes(raw: bytes | bytearray | memoryview | torch.Tensor) -> np.ndarray:
    if isinstance(raw, torch.Tensor):
        if raw.device.type != "cpu":
            raise CodecError(f"zstd: tensor must be on the CPU, got device {raw.device}")
        t = raw.detach().contiguous().reshape(-1)
        if t.dtype != torch.uint8:
            t = t.view(torch.uint8)
        return t.numpy()
    if isinstance(raw, memoryview) and not raw.c_contiguous:
        raw = raw.tobytes()
    if not isinstance(raw, bytes | bytearray | memoryview):
        raise CodecError(f"zstd: expected bytes, memoryview or tensor, got {type(raw).__name__}")
    return np.frombuffer(raw, dtype=np.uint8)


class ZstdStage:
    """Byte-shuffle + zstd over a codec's output.

    The shuffle groups byte ``k`` of every ``itemsize``-byte value together: exponents and sign bytes of
    float data are highly repetitive and compress well once they are adjacent. Frames carry their
    content size and a checksum. Compressor/decompressor contexts are per instance *and* per thread
    (zstandard contexts are not thread-safe), so one stage may be shared by many threads.
    """

    def __init__(self, level: int = 1) -> None:
        lo, hi = _MIN_LEVEL, int(zstandard.MAX_COMPRESSION_LEVEL)
        if isinstance(level, bool) or not isinstance(level, int) or not lo <= level <= hi:
            raise ValueError(f"zstd level must be an int in [{lo}, {hi}], got {level!r}")
        self.level = level
        self._local = threading.local()

    def _compressor(self) -> zstandard.ZstdCompressor:
        c = getattr(self._local, "compressor", None)
        if c is None:
            c = zstandard.ZstdCompressor(level=self.level, write_content_size=True, write_checksum=True)
            self._local.compressor = c
        return c

    def _decompressor(self) -> zstandard.ZstdDecompressor:
        d = getattr(self._local, "decompressor", None)
        if d is None:
            d = zstandard.ZstdDecompressor()
            self._local.decompressor = d
        return d

    @staticmethod
    def _check_itemsize(itemsize: int) -> None:
        if isinstance(itemsize, bool) or not isinstance(itemsize, int) or itemsize < 1:
            raise CodecError(f"zstd: itemsize must be an int >= 1, got {itemsize!r}")

    def compress(self, raw: bytes | bytearray | memoryview | torch.Tensor, itemsize: int) -> bytes:
        """Shuffle ``raw`` by ``itemsize`` (1 = no shuffle) and compress it into one zstd frame."""
        self._check_itemsize(itemsize)
        arr = _as_numpy_bytes(raw)
        if arr.size % itemsize:
            raise CodecError(f"zstd: raw length {arr.size} is not a multiple of itemsize {itemsize}")
        if itemsize > 1:
            arr = np.ascontiguousarray(arr.reshape(-1, itemsize).T)
        result: bytes = self._compressor().compress(arr.data)
        return result

    def decompress(self, data: bytes | bytearray | memoryview, raw_length: int, itemsize: int, max_bytes: int) -> bytes:
        """Decompress one frame of exactly ``raw_length`` bytes and undo the shuffle.

        Never allocates more than ``max_bytes`` for the output: the declared size is checked against
        ``raw_length`` and ``max_bytes`` before zstd is asked to decode anything.
        """
        self._check_itemsize(itemsize)
        if isinstance(raw_length, bool) or not isinstance(raw_length, int) or raw_length < 0:
            raise CodecError(f"zstd: raw_length must be an int >= 0, got {raw_length!r}")
        if raw_length > max_bytes:
            raise CodecError(f"zstd: OVERSIZE: raw_length {raw_length} exceeds the limit of {max_bytes} bytes")
        if raw_length % itemsize:
            raise CodecError(f"zstd: raw_length {raw_length} is not a multiple of itemsize {itemsize}")
        if isinstance(data, memoryview) and not data.c_contiguous:
            data = data.tobytes()
        try:
            declared = zstandard.frame_content_size(data)
        except zstandard.ZstdError as exc:
            raise CodecError(f"zstd: malformed frame header ({len(data)} bytes): {exc}") from exc
        if declared == -1:
            # No declared size: zstd then sizes its buffer by max_output_size, which bounds memory
            # just as well. Zero would mean "unlimited" to zstandard, hence the explicit refusal.
            if raw_length == 0:
                raise CodecError("zstd: frame does not declare its content size")
        elif declared != raw_length:
            raise CodecError(
                f"zstd: OVERSIZE/size mismatch: frame declares {declared} bytes, expected {raw_length}"
                + (f" (limit {max_bytes})" if declared > max_bytes else "")
            )
        dctx = self._decompressor()
        try:
            try:
                out = dctx.decompress(data, max_output_size=raw_length, allow_extra_data=False)
            except TypeError:  # pragma: no cover - zstandard < 0.24 has no allow_extra_data
                out = dctx.decompress(data, max_output_size=raw_length)
        except zstandard.ZstdError as exc:
            raise CodecError(f"zstd: cannot decompress {len(data)} bytes: {exc}") from exc
        if len(out) != raw_length:
            raise CodecError(f"zstd: decompressed {len(out)} bytes, expected {raw_length}")
        if itemsize == 1 or raw_length == 0:
            return bytes(out)
        planes = np.frombuffer(out, dtype=np.uint8).reshape(itemsize, -1)
        return planes.T.tobytes()
