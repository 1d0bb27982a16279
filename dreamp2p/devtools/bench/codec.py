"""Single-core throughput and accuracy benchmark of every tensor codec, plus the zstd stage on its output."""

from __future__ import annotations

import functools
import math
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from dreamp2p.compression import ZstdStage, codec_names, get_codec

__all__ = ["bench_codecs"]

# zstd on 64 MB takes far longer than a codec pass, so it gets fewer repeats to keep the default run short.
_ZSTD_MAX_REPEATS = 3


def _median_seconds(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _mbps(nbytes: int, seconds: float) -> float:
    return round(nbytes / 1e6 / seconds, 1) if seconds > 0 else math.inf


def bench_codecs(
    mbytes: float = 64.0, repeats: int = 5, names: list[str] | None = None, seed: int = 0
) -> dict[str, Any]:
    """Measure encode/decode throughput, compression ratio and error of each codec on one CPU core.

    Throughputs are MB (1e6 bytes) of float32 input per second, median of ``repeats`` runs. ``ratio`` is
    input bytes / encoded bytes; ``zstd_ratio`` is input bytes / bytes after the byte-shuffle + zstd
    stage applied to the codec's output, and ``zstd_MBps`` that stage's compress throughput, again per
    MB of float32 input. Errors are of the decoded tensor against the input (standard normal data).
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    if not mbytes > 0:
        raise ValueError(f"mbytes must be > 0, got {mbytes}")
    codecs = [get_codec(name) for name in (names if names else codec_names())]
    n = max(1, int(mbytes * 1e6) // 4)
    input_bytes = 4 * n
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        gen = torch.Generator().manual_seed(seed)
        x = torch.randn(n, generator=gen, dtype=torch.float32)
        decoded = torch.empty_like(x)
        zstd = ZstdStage(level=1)
        results: dict[str, dict[str, float]] = {}
        for codec in codecs:
            encoded = codec.encode(x)
            enc_s = _median_seconds(functools.partial(codec.encode, x), repeats)
            dec_s = _median_seconds(functools.partial(codec.decode, encoded, n, out=decoded), repeats)
            err = decoded.double().sub_(x.double())
            max_abs = float(err.abs().max())
            rms = float(err.square().mean().sqrt())
            del err
            packed = zstd.compress(encoded, codec.itemsize)
            compress = functools.partial(zstd.compress, encoded, codec.itemsize)
            zstd_s = _median_seconds(compress, min(repeats, _ZSTD_MAX_REPEATS))
            results[codec.name] = {
                "encode_MBps": _mbps(input_bytes, enc_s),
                "decode_MBps": _mbps(input_bytes, dec_s),
                "ratio": round(input_bytes / encoded.numel(), 4),
                "max_abs_err": max_abs,
                "rms_err": rms,
                "zstd_ratio": round(input_bytes / len(packed), 4),
                "zstd_MBps": _mbps(input_bytes, zstd_s),
            }
            del encoded, packed
    finally:
        torch.set_num_threads(threads)
    return {"codecs": results, "input_MB": round(input_bytes / 1e6, 3), "threads": 1, "repeats": repeats}
