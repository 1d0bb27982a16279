"""One local rank of a region in a test run: ``torchrun --nproc-per-node N -m dreamp2p.devtools.regionjob ...``.

Trains the student of `dreamp2p.devtools.bench.jobs.training` with DDP inside the region (gloo) and a
dreamp2p strategy between regions, then a quiet stretch at learning rate 0, and writes what the tests
check (losses, parameter digests, WAN bytes) to ``<out>/<region>.<local rank>.json``. Each rank's batches
depend on its global position (region index x ranks + local rank), so no two ranks see the same data.

``--fsdp``: the student is sharded with FSDP2 (``fully_shard``, AdamW) instead; ``--strategy`` may then name
several strategies, trained one after another in the same processes (each on a fresh model, its peers on
ports of their own), each ending with ``flush()``; results go to ``<out>/<strategy>.<region>.<local rank>.json``
with digests of the whole (gathered) parameters and state.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import logging
import math
import os
import random
import signal
import socket
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from dreamp2p.config import PeerConfig, PeerInfo
from dreamp2p.devtools.bench.jobs.training import batch, student
from dreamp2p.devtools.bench.memory.process import return_freed_memory
from dreamp2p.manifest import param_digest, state_digest
from dreamp2p.node import Node
from dreamp2p.service.dcp import ShardedCheckpoints
from dreamp2p.service.region import elastic_restart, start_region
from dreamp2p.sync.comm.shards import shift_port

CGROUP_MEMORY = Path("/sys/fs/cgroup/memory")  # cgroup v1's memory controller (this kernel's v2 has none)


def free_port_block(n: int, start: int = 20000, stop: int = 32768) -> int:
    """A loopback port p such that p .. p + n - 1 are free now (a region's ranks listen on them).

    Blocks are tried in a random order, so two callers at once (tests on parallel workers) rarely pick the
    same one; the default range ends where Linux's ephemeral ports begin, so no socket the kernel numbers
    itself takes a port of the block between this check and the ranks' binds.
    """
    stride = max(n, 1) + 1
    bases = list(range(start, stop - n, stride))
    random.shuffle(bases)
    for base in bases:
        socks: list[socket.socket] = []
        try:
            for port in range(base, base + n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no block of {n} free ports in {start}..{stop}")


def _args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--region", required=True, help="this region's id (one of --ring)")
    p.add_argument("--ring", required=True, help="id=host:port,... : every region and its local rank 0's address")
    p.add_argument("--strategy", default="ssgd")
    p.add_argument("--sync", default="{}", help="JSON of [sync] settings")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--quiet-steps", type=int, default=0)
    p.add_argument("--flush", action="store_true", help="flush() after the quiet steps (--fsdp always flushes)")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--fsdp", action="store_true", help="shard the model with FSDP2 and flush at the end")
    p.add_argument("--stop-file", type=Path, help="--fsdp: train until the step this file names, once it exists")
    p.add_argument("--min-step", type=float, default=0.0, help="--fsdp: the shortest a step may take (s)")
    p.add_argument("--kill-at", type=int, help="--fsdp: local rank --kill-rank SIGKILLs itself at this step")
    p.add_argument("--kill-rank", type=int, default=1)
    p.add_argument("--width", type=int, default=64, help="the student's width (--fsdp)")
    p.add_argument("--depth", type=int, default=3, help="the student's hidden layers (--fsdp)")
    p.add_argument(
        "--memory-budget",
        type=float,
        help="--fsdp, root: confine each rank to a memory cgroup (v1) of its usage at start plus this many bytes "
        "per parameter of the whole model",
    )
    p.add_argument("--cgroup-prefix", default="dreamp2p-regionjob", help="the ranks' memory cgroups' name prefix")
    p.add_argument("--dcp", type=Path, help="--fsdp: a sharded checkpoint folder (torch.distributed.checkpoint)")
    p.add_argument("--dcp-save-at", type=int, help="save --dcp before this step (asynchronously)")
    p.add_argument("--dcp-load", action="store_true", help="resume from --dcp after attach")
    p.add_argument(
        "--global-batch",
        type=int,
        help="--fsdp: every step's batch is one of this size per region, split among its ranks (so a run's "
        "data does not depend on its rank count)",
    )
    return p.parse_args(argv)


def _confine(args: argparse.Namespace, params: int) -> dict[str, int]:
    """Move this rank into a memory cgroup of its own (``<prefix>.<region>.<rank>``) whose limit is its usage now
    plus --memory-budget bytes per parameter: what the rank may add for the model it builds and shards, the
    gradients, AdamW, the strategy and every transient. (Cgroup v1 leaves the pages a task had charged where
    they were, and this kernel refuses to move them, so the usage starts near 0 and counts what comes after.)
    The cgroup's figures, for the caller to report."""
    return_freed_memory()  # what the rank frees leaves its charge at once instead of waiting in glibc's heap
    group = CGROUP_MEMORY / f"{args.cgroup_prefix}.{args.region}.{dist.get_rank()}"
    group.mkdir(exist_ok=True)
    (group / "cgroup.procs").write_text(str(os.getpid()))
    start = int((group / "memory.usage_in_bytes").read_text())
    budget = int(args.memory_budget * params)
    (group / "memory.limit_in_bytes").write_text(str(start + budget))
    return {"start": start, "budget": budget}


def _cgroup_peak(args: argparse.Namespace) -> int:
    """The most this rank's cgroup held (its memory.max_usage_in_bytes)."""
    group = CGROUP_MEMORY / f"{args.cgroup_prefix}.{args.region}.{dist.get_rank()}"
    return int((group / "memory.max_usage_in_bytes").read_text())


def _steps(sync: Any, model: nn.Module, data_rank: int, steps: range, batch_size: int) -> list[float]:
    losses = []
    for step in steps:
        x, y = batch(data_rank, step, batch_size)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        sync.step()
        sync.zero_grad()
        losses.append(loss.item())
    return losses


def main(argv: list[str] | None = None) -> int:
    args = _args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    faulthandler.register(signal.SIGUSR1)  # a test that sees a rank hang can ask for its threads' stacks
    torch.set_num_threads(1)
    start_region("cpu")  # torchrun's process group (a restarted attempt's on a store prefix of its own)
    local, ranks = dist.get_rank(), dist.get_world_size()
    logging.basicConfig(level=logging.WARNING, format=f"%(asctime)s {args.region}.{local} %(name)s %(message)s")
    ring = tuple(PeerInfo(*entry.split("=", 1)) for entry in args.ring.split(","))
    ids = [p.node_id for p in ring]
    me = ring[ids.index(args.region)]
    data_rank = ids.index(args.region) * ranks + local
    if args.fsdp:
        for k, strategy in enumerate(args.strategy.split(",")):
            # every strategy's peers on ports of their own: the previous ones' may still be closing
            shifted = tuple(PeerInfo(p.node_id, shift_port(p.address, 2 * k * ranks)) for p in ring)
            result = _train_sharded(args, strategy, shifted, data_rank)
            (args.out / f"{strategy}.{args.region}.{local}.json").write_text(json.dumps(result))
        dist.barrier()  # no rank tears the group down while another still uses it
        dist.destroy_process_group()
        return 0
    model = DistributedDataParallel(student(seed=data_rank))  # different inits: attach broadcasts region 0's
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    config = PeerConfig(node_id=me.node_id, cluster_id="regions", listen=me.address, ring=ring)
    node = Node(config)
    try:
        sync = node.attach(model, opt, strategy=args.strategy, **json.loads(args.sync))
        init_digest = param_digest(model)
        losses = _steps(sync, model, data_rank, range(args.steps), args.batch_size)
        trained_digest = param_digest(model)
        for group in opt.param_groups:
            group["lr"] = 0.0
        _steps(sync, model, data_rank, range(args.steps, args.steps + args.quiet_steps), args.batch_size)
        sync.close()
        flushed = sync.flush() if args.flush else None
        result = {
            "node_id": node.config.node_id,
            "flush_path": flushed,
            "losses": losses,
            "init_digest": init_digest,
            "trained_digest": trained_digest,
            "digest": param_digest(model),
            "bytes_sent": sync.totals.bytes_sent,
            "rounds_skipped": sync.rounds_skipped,
            "plan_history": [list(h) for h in getattr(sync, "plan_history", [])],
        }
    finally:
        node.close()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.region}.{local}.json").write_text(json.dumps(result))
    dist.destroy_process_group()
    return 0


def _train_sharded(
    args: argparse.Namespace, strategy: str, ring: tuple[PeerInfo, ...], data_rank: int
) -> dict[str, Any]:
    """One strategy over an FSDP2 student: train, flush, and report digests of the whole model and state."""
    params = sum(p.numel() for p in student(args.width, args.depth).parameters())
    confined = _confine(args, params) if args.memory_budget is not None else None
    model = student(args.width, args.depth, seed=data_rank)  # different inits: attach takes region 0's shards
    for layer in list(model.children()):  # one FSDP unit per Linear, as users wrap blocks
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    me = next(p for p in ring if p.node_id == args.region)
    # torchrun restarted the region after one of its ranks died: it joins the running cluster
    joining = elastic_restart(os.environ)
    node = Node(PeerConfig(node_id=me.node_id, cluster_id="regions", listen=me.address, ring=ring), joining=joining)
    try:
        sync = node.attach(model, opt, strategy=strategy, join=joining, **json.loads(args.sync))
        joined = sync.step_count if joining else None
        if joined is not None:
            (args.out / f"joined.{node.config.node_id}").write_text(str(joined))
        ckpt = ShardedCheckpoints(sync) if args.dcp is not None else None
        resumed_at = ckpt.load(args.dcp) if ckpt is not None and args.dcp_load else None
        first = sync.step_count
        init_digest = param_digest(model)
        losses = _sharded_steps(args, sync, model, data_rank, killer=not joining, ckpt=ckpt)
        if ckpt is not None:
            ckpt.wait()
        trained_digest = param_digest(model)
        norm = _whole_norm(model)
        sync.flush()
        sync.close()
        state = sync.state_dict()
        return {
            "node_id": node.config.node_id,
            "strategy": strategy,
            "losses": losses,
            "init_digest": init_digest,
            "trained_digest": trained_digest,
            "digest": param_digest(model),
            "state_digest": state_digest(model),
            "local_elements": sum(t.numel() for t in state["model"].values()),
            "bytes_sent": sync.totals.bytes_sent,
            "rounds_skipped": sync.rounds_skipped,
            "joined_at": joined,
            "final_step": sync.step_count,
            "params": params,
            "memory": None if confined is None else {**confined, "peak": _cgroup_peak(args)},
            "first_step": first,
            "resumed_at": resumed_at,
            "trained_norm": norm,
        }
    finally:
        node.close()


def _whole_norm(model: nn.Module) -> float:
    """The L2 norm of every parameter, gathered whole (collective): runs of other rank counts compare by it."""
    total = 0.0
    with torch.no_grad():
        for p in model.parameters():
            whole = p.full_tensor() if isinstance(p, DTensor) else p
            total += float(whole.double().square().sum())
    return math.sqrt(total)


def _stop_step(args: argparse.Namespace) -> int:
    """--steps, or the step --stop-file names once it exists."""
    if args.stop_file is not None and args.stop_file.exists():
        text = args.stop_file.read_text().strip()
        if text:
            return int(text)
    return int(args.steps)


def _sharded_steps(
    args: argparse.Namespace, sync: Any, model: nn.Module, data_rank: int, killer: bool, ckpt: Any
) -> list[float]:
    """Train from the strategy's step to the stop step (--kill-at: the killer rank dies on the way; --dcp-save-at:
    a sharded checkpoint is saved on the way)."""
    local, ranks = dist.get_rank(), dist.get_world_size()
    losses = []
    while sync.step_count < _stop_step(args):
        t0 = time.monotonic()
        if killer and local == args.kill_rank and sync.step_count == args.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        if ckpt is not None and sync.step_count == args.dcp_save_at:
            ckpt.save(args.dcp)
        if args.global_batch:
            x, y = batch(data_rank // ranks, sync.step_count, args.global_batch)
            x, y = x[local::ranks], y[local::ranks]
        else:
            x, y = batch(data_rank, sync.step_count, args.batch_size)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        sync.step()
        sync.zero_grad()
        losses.append(loss.item())
        time.sleep(max(0.0, args.min_step - (time.monotonic() - t0)))
    return losses


if __name__ == "__main__":
    raise SystemExit(main())
