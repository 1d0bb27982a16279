"""Ring all-reduce across real peer processes on 127.0.0.1: every codec, awkward sizes, N = 2, 3, 5.

Each peer is its own process with its own event loop and gRPC server. Inputs are seeded so every
process can rebuild all ranks' tensors and measure its result against the exact (fp64) mean.
"""

from __future__ import annotations

import pytest

from dreamp2p.compression import codec_names, get_codec
from dreamp2p.devtools.launch import run_local

# 1 element, tiny, primes, and ~24 MB (6 M fp32 elements, prime-ish length): even with 5 peers a segment
# (~4.8 MB) is more than one frame's most (4 MiB), so every ring here sends a segment in several chunks
SIZES = [1, 2, 13, 1009, 65537, 6_000_011]

# Worst-case relative error of one quantization, against the block's absolute maximum.
QUANT_STEP = {
    "fp32": 2.0**-23,
    "fp16": 2.0**-11,
    "bf16": 2.0**-8,
    "int8": 1 / 254,
    "int4": 1 / 14,
    "e3m0": 1 / 3,
    "int2": 1 / 3,
    # top-k: a kept value errs by less than the block's largest, a dropped one is below the smallest kept
    # (so this only checks bit-identical, finite results; its accuracy comes over rounds with error feedback)
    "topk": 1.0,
}


def tolerance(codec: str, world: int) -> float:
    """Bound on |result - exact mean| / max|input|.

    Reduce-scatter re-quantizes the partial sum after k contributions (|sum| <= k max|x|) at each
    of the N-1 hops, and the owner quantizes the mean once: total error of the mean is at most
    q (1 + 2 + ... + (N-1)) / N + q = q (N + 1) / 2, all in units of max|x|.
    """
    if world == 1:
        return 0.0
    return QUANT_STEP[codec] * (world + 1) / 2 + 1e-7


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("world", [2, 3, 5])
def test_ring_mean_every_codec(world: int) -> None:
    codecs = codec_names()
    assert set(codecs) == set(QUANT_STEP)
    results = run_local(
        world,
        "dreamp2p.devtools.bench.jobs.averaging:allreduce_check",
        {"sizes": SIZES, "codecs": codecs, "seed": world},
        timeout=220,
    )
    assert len(results) == world
    for codec in codecs:
        reports = [r[codec] for r in results]
        # every peer ends with bit-identical values, lossy codecs included
        assert len({r["digest"] for r in reports}) == 1, codec
        assert all(r["finite"] for r in reports)
        worst = max(r["rel_err"] for r in reports)
        assert worst <= tolerance(codec, world), f"{codec}: relative error {worst:.3g} > {tolerance(codec, world):.3g}"
        # the bytes on the wire shrink as the codec promises (fp32 sends 2(N-1)/N of the buffer; a sparse
        # codec's contributions are gathered, each member sending N-1 encoded buffers: `collective.gather`)
        total = 4 * sum(SIZES)
        sent = reports[0]["bytes_sent"]
        expect = total * ((world - 1) if get_codec(codec).sparse else 2 * (world - 1) / world)
        ratio = {
            "fp32": 1.0,
            "fp16": 0.5,
            "bf16": 0.5,
            "int8": 0.27,
            "int4": 0.15,
            "e3m0": 0.15,
            "int2": 0.08,
            "topk": 0.0066,
        }[codec]
        assert sent <= expect * ratio * 1.05 + 4096, f"{codec}: sent {sent} bytes"


@pytest.mark.timeout(120)
def test_single_peer_ring_is_identity() -> None:
    (result,) = run_local(
        1, "dreamp2p.devtools.bench.jobs.averaging:allreduce_check", {"sizes": [1, 7, 1000], "codecs": ["int4"]}
    )
    assert result["int4"]["max_abs_err"] == 0.0
    assert result["int4"]["bytes_sent"] == 0
