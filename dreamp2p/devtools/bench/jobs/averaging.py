"""Jobs that run inside peer processes started by `dreamp2p.devtools.launch`: averaging checks and timing loops.

Inputs are generated from seeds, so every process can rebuild every other rank's tensors and compute
the exact mean locally; only small summaries travel back to the parent.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import torch
import xxhash

from dreamp2p.errors import RoundFailed
from dreamp2p.messages import RoundResult
from dreamp2p.peer import Peer


def make_tensors(rank: int, sizes: list[int], seed: int) -> list[torch.Tensor]:
    out = []
    for i, n in enumerate(sizes):
        g = torch.Generator().manual_seed(seed * 1_000_003 + rank * 7919 + i)
        out.append(torch.randn(n, generator=g) * (1.0 + i))
    return out


async def allreduce_check(
    peer: Peer, rank: int, world: int, sizes: list[int], codecs: list[str], seed: int = 0
) -> dict[str, Any]:
    """Average seeded tensors with each codec; report error vs the exact mean and a digest of the result.

    The reference arithmetic (every rank's inputs rebuilt, fp64 sums over tens of MB) runs off the event
    loop: on a loaded host it takes seconds, and a loop busy that long answers no heartbeat, so the other
    members would count this one dead and the ring would re-form mid-check.
    """
    expect, in_scale, scale = await asyncio.to_thread(_reference, world, sizes, seed)
    report: dict[str, Any] = {}
    for codec in codecs:
        tensors = await asyncio.to_thread(make_tensors, rank, sizes, seed)
        res = await peer.allreduce(tensors, group_id=0, codec=codec)
        err, digest, finite = await asyncio.to_thread(_compare, tensors, expect)
        report[codec] = {
            "max_abs_err": err,
            "rel_err": err / max(in_scale, 1e-30),
            "mean_scale": scale,
            "digest": digest,
            "seconds": res.seconds,
            "bytes_sent": res.bytes_sent,
            "finite": finite,
        }
    return report


def _reference(world: int, sizes: list[int], seed: int) -> tuple[list[torch.Tensor], float, float]:
    """The exact (fp64) mean of every rank's inputs, the largest input magnitude (the error's unit) and the
    mean's, each rank's inputs built once."""
    sums = [torch.zeros(n, dtype=torch.float64) for n in sizes]
    magnitudes = []
    for r in range(world):
        for acc, t in zip(sums, make_tensors(r, sizes, seed), strict=True):
            acc.add_(t.double())
            if t.numel():
                magnitudes.append(float(t.abs().max()))
    expect = [s / world for s in sums]
    return expect, max(magnitudes, default=1.0), max((float(e.abs().max()) for e in expect if e.numel()), default=1.0)


def _compare(tensors: list[torch.Tensor], expect: list[torch.Tensor]) -> tuple[float, str, bool]:
    """Largest absolute error against ``expect``, a digest of ``tensors`` and whether all are finite."""
    err = max(
        (float((t.double() - e).abs().max()) for t, e in zip(tensors, expect, strict=True) if t.numel()),
        default=0.0,
    )
    digest = xxhash.xxh3_64()
    for t in tensors:
        digest.update(t.numpy().tobytes())
    return err, digest.hexdigest(), all(bool(torch.isfinite(t).all()) for t in tensors)


async def _measured_rounds(
    peer: Peer, tensor: torch.Tensor, codec: str, group_id: int, warmup: int, rounds: int
) -> list[tuple[float, RoundResult]]:
    """``rounds`` all-reduces of ``tensor`` after ``warmup`` unmeasured ones: (process CPU seconds, result) each."""
    out = []
    for i in range(warmup + rounds):
        c0 = time.process_time()
        res = await peer.allreduce([tensor], group_id=group_id, codec=codec)
        if i >= warmup:
            out.append((time.process_time() - c0, res))
    return out


async def allreduce_timing(
    peer: Peer,
    rank: int,
    world: int,
    mbytes: float,
    codecs: list[str],
    rounds: int = 3,
    warmup: int = 1,
    tiny_elems: int = 1024,
) -> dict[str, Any]:
    """Time ring all-reduce of one ``mbytes`` MB fp32 buffer per codec (median of ``rounds``), and its CPU.

    CPU is this process's (every thread: the loop, gRPC's, the kernel's work in our syscalls) per round,
    for the buffer and for a ``tiny_elems`` round, whose CPU is the fixed cost a round pays whatever its size.
    """
    n = int(mbytes * 1e6 // 4)
    buf = torch.randn(n, generator=torch.Generator().manual_seed(rank))
    tiny = torch.randn(tiny_elems, generator=torch.Generator().manual_seed(rank))
    out: dict[str, Any] = {}
    for codec in codecs:
        big = await _measured_rounds(peer, buf, codec, 0, warmup, rounds)
        small = await _measured_rounds(peer, tiny, codec, 1, warmup, rounds)
        times = sorted(res.seconds for _, res in big)
        out[codec] = {
            "seconds": times[len(times) // 2],
            "bytes_sent_per_round": sum(res.bytes_sent for _, res in big) / rounds,
            "chunk_bytes": big[-1][1].chunk_bytes,
            "cpu_s_per_round": sum(cpu for cpu, _ in big) / rounds,
            "tiny_cpu_s_per_round": sum(cpu for cpu, _ in small) / rounds,
        }
    return out


async def stream_timing(peer: Peer, rank: int, world: int, mbytes: float, seconds: float) -> dict[str, Any]:
    """Repeated 2-peer fp32 all-reduce for ``seconds``: every byte crosses the link once per direction."""
    n = int(mbytes * 1e6 // 4)
    buf = torch.randn(n, generator=torch.Generator().manual_seed(rank))
    await peer.allreduce([buf], codec="fp32")  # warm-up: connections, windows, chunk size
    t0 = time.perf_counter()
    sent = 0
    rounds = 0
    # every peer must run the same number of rounds: rank 0 decides by time, others follow its count
    while True:
        rounds += 1
        res = await peer.allreduce([buf], codec="fp32")
        sent += res.bytes_sent
        flag = torch.tensor([1.0 if (time.perf_counter() - t0) < seconds or rank != 0 else 0.0])
        await peer.allreduce([flag], group_id=1, codec="fp32")
        if float(flag) < 1.0 - 0.5 / world:
            break
    elapsed = time.perf_counter() - t0
    links = {
        s.peer: {"goodput_MBps": s.goodput_Bps / 1e6, "rtt_ms": s.rtt_s * 1e3, "chunk_bytes": s.chunk_bytes}
        for s in peer.link_snapshots()
    }
    return {"bytes_sent": sent, "seconds": elapsed, "rounds": rounds, "links": links}


def _rss_bytes() -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def _open_fds() -> int:
    import os

    return len(os.listdir("/proc/self/fd"))


async def soak(
    peer: Peer, rank: int, world: int, seconds: float, mbytes: float = 4.0, sample_s: float = 5.0
) -> dict[str, Any]:
    """Back-to-back rounds (a big int8 group and a small fp32 one) for ``seconds``; samples resources.

    Every peer runs the same number of rounds: rank 0 decides when to stop, through a stop flag averaged
    like any other tensor.
    """
    import asyncio

    n = int(mbytes * 1e6 // 4)
    big = torch.randn(n, generator=torch.Generator().manual_seed(rank))
    small = torch.randn(4097, generator=torch.Generator().manual_seed(100 + rank))
    samples = []
    t0 = time.perf_counter()
    next_sample = 0.0
    rounds = failed = 0
    while True:
        now = time.perf_counter() - t0
        if now >= next_sample:
            samples.append({"t": now, "rss": _rss_bytes(), "fds": _open_fds(), "tasks": len(asyncio.all_tasks())})
            next_sample += sample_s
        try:
            await peer.allreduce([big], group_id=1, codec="int8")
            await peer.allreduce([small], group_id=2, codec="fp32")
            rounds += 2
        except RoundFailed:
            failed += 1
        flag = torch.tensor([1.0 if (time.perf_counter() - t0) < seconds or rank != 0 else 0.0])
        await peer.allreduce([flag], group_id=3, codec="fp32")
        if float(flag) < 1.0 - 0.5 / world:
            break
    samples.append(
        {"t": time.perf_counter() - t0, "rss": _rss_bytes(), "fds": _open_fds(), "tasks": len(asyncio.all_tasks())}
    )
    return {
        "samples": samples,
        "rounds": rounds,
        "failed": failed,
        "peer_failed": peer.rounds_failed,
        "frames_rejected": peer.frames_rejected,
    }
