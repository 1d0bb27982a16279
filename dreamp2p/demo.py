"""`dreamp2p demo`: start local peer processes over rate-limited links and average a real model.

Each node builds the same small byte-level transformer from a different seed, takes a few local SGD
steps on its own shard of a real corpus (the Python standard library's source files), then the nodes
average every parameter over the ring. The table shows per-round loss, wire bytes, time, link
goodput and how far averaging moved the replicas; identical digests prove all peers agree bit for bit.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Any

import torch
import xxhash
from torch import nn

from dreamp2p.config import parse_rate
from dreamp2p.launch import run_local
from dreamp2p.peer import Peer


def tiny_lm(vocab: int = 256, dim: int = 128, layers: int = 2, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    layer = nn.TransformerEncoderLayer(dim, nhead=4, dim_feedforward=4 * dim, batch_first=True)
    return nn.Sequential(nn.Embedding(vocab, dim), nn.TransformerEncoder(layer, layers), nn.Linear(dim, vocab))


def stdlib_shard(rank: int, world: int, max_bytes: int = 4 << 20) -> torch.Tensor:
    """Bytes of every ``world``-th stdlib source file starting at ``rank``: disjoint shards per node."""
    files = sorted(Path(os.__file__).parent.glob("*.py"))
    chunks = []
    total = 0
    for path in files[rank::world]:
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    return torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8).long()


async def demo_job(peer: Peer, rank: int, world: int, rounds: int, codec: str, local_steps: int = 8) -> dict[str, Any]:
    model = tiny_lm(seed=rank)
    params = list(model.parameters())
    opt = torch.optim.Adam(params, lr=2e-3)
    g = torch.Generator().manual_seed(100 + rank)
    corpus = stdlib_shard(rank, world)
    log = []

    def local_steps_() -> float:
        for _ in range(local_steps):
            starts = torch.randint(0, corpus.numel() - 65, (16,), generator=g)
            x = torch.stack([corpus[i : i + 65] for i in starts.tolist()])
            logits = model(x[:, :-1])
            loss = nn.functional.cross_entropy(logits.reshape(-1, 256), x[:, 1:].reshape(-1))
            opt.zero_grad()
            loss.backward()
            opt.step()
        return loss.item()

    for r in range(rounds):
        t0 = time.perf_counter()
        # compute off the event loop, so the peer keeps answering probes and frames meanwhile
        loss = await asyncio.to_thread(local_steps_)
        compute_s = time.perf_counter() - t0
        before = torch.cat([p.detach().reshape(-1) for p in params]).clone()
        res = await peer.allreduce(params, codec=codec)
        after = torch.cat([p.detach().reshape(-1) for p in params])
        log.append(
            {
                "round": r + 1,
                "loss": loss,
                "compute_s": compute_s,
                "sync_s": res.seconds,
                "wire_bytes": res.bytes_sent,
                "moved": float((after - before).norm() / before.norm()),
                "digest": xxhash.xxh3_64_hexdigest(after.numpy().tobytes()),
            }
        )
    links = [
        {"peer": s.peer, "goodput_Mbit": s.goodput_Bps * 8 / 1e6, "rtt_ms": s.rtt_s * 1e3}
        for s in peer.link_snapshots()
    ]
    return {"params": sum(p.numel() for p in params), "rounds": log, "links": links}


def run_demo(nodes: int = 3, link: str = "50mbit", codec: str = "int8", rounds: int = 10) -> int:
    rate = parse_rate(link)
    print(
        f"dreamp2p demo: {nodes} peer processes on 127.0.0.1, links paced to {link} ({rate / 1e6:.1f} MB/s), "
        f"codec {codec}, {rounds} rounds"
    )
    t0 = time.perf_counter()
    config = {"transport": {"rate_limit": rate, "probe_interval_s": 1.0}, "codec": codec}
    results = run_local(nodes, "dreamp2p.demo:demo_job", {"rounds": rounds, "codec": codec}, config)
    n = results[0]["params"]
    print(f"model: byte-level transformer, {n:,} parameters ({n * 4 / 1e6:.1f} MB fp32)")
    print(
        f"{'round':>5} {'node':>5} {'loss':>7} {'compute s':>9} {'sync s':>7} {'wire MB':>8} {'Mbit/s':>7} "
        f"{'moved':>7}  digest"
    )
    for r in range(rounds):
        for rank, res in enumerate(results):
            row = res["rounds"][r]
            mbit = row["wire_bytes"] * 8 / row["sync_s"] / 1e6 if row["sync_s"] > 0 else 0.0
            print(
                f"{row['round']:>5} {'p' + str(rank):>5} {row['loss']:7.3f} {row['compute_s']:9.3f} "
                f"{row['sync_s']:7.3f} {row['wire_bytes'] / 1e6:8.2f} {mbit:7.1f} {row['moved']:7.4f}  {row['digest']}"
            )
    same = all(len({res["rounds"][r]["digest"] for res in results}) == 1 for r in range(rounds))
    print("after every round all peers hold identical parameters:", "yes" if same else "NO")
    for rank, res in enumerate(results):
        for ln in res["links"]:
            rtt = f"{ln['rtt_ms']:.2f} ms" if ln["rtt_ms"] > 0 else "n/a (link never idle)"
            print(
                f"  p{rank} -> {ln['peer']}: measured goodput {ln['goodput_Mbit']:.1f} Mbit/s"
                f" (limit {rate * 8 / 1e6:.0f}),"
                f" rtt {rtt}"
            )
    print(f"done in {time.perf_counter() - t0:.1f} s")
    return 0 if same else 1
