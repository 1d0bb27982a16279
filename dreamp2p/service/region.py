"""`dreamp2p node` as one local rank of a region: torchrun's environment, the process group, DDP.

``torchrun --nproc-per-node N -m dreamp2p node --config region.toml`` starts N daemons from one region
file. Each finds its place from torchrun's environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``),
joins the region's process group (gloo on CPU, NCCL on GPU), trains on ``cuda:LOCAL_RANK`` when the
device is CUDA, wraps the task's model in DDP, and reads its own share of the data (its global position
among every rank of every region). `dreamp2p.node.Node` then gives it its own peer (node id, ports,
ring: `dreamp2p.sync.shards`) and shard of every WAN round (`dreamp2p.sync.sharded`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from dreamp2p.config.daemon import DaemonConfig
from dreamp2p.sync.shards import rank_node_id, shift_port


@dataclass(frozen=True)
class RankPlace:
    """Where torchrun put this process in its region."""

    rank: int  # its rank in the region: the shard it owns on the WAN and its port offset
    ranks: int  # the region's rank count (every region must have the same)
    local_rank: int  # its accelerator index on this host


def torchrun_place(env: Mapping[str, str]) -> RankPlace | None:
    """This process's place from torchrun's variables; None outside torchrun or in a job of one rank."""
    if "RANK" not in env or "WORLD_SIZE" not in env:
        return None
    try:
        rank, ranks = int(env["RANK"]), int(env["WORLD_SIZE"])
        local = int(env.get("LOCAL_RANK", env["RANK"]))
    except ValueError:
        raise ValueError(f"torchrun's RANK/WORLD_SIZE/LOCAL_RANK are not integers: {dict(env)!r}") from None
    if not 0 <= rank < ranks or local < 0:
        raise ValueError(f"RANK {rank} outside 0..{ranks - 1} (WORLD_SIZE) or LOCAL_RANK {local} < 0")
    return RankPlace(rank, ranks, local) if ranks > 1 else None


def rank_device(device: str, place: RankPlace) -> str:
    """``cuda`` means this rank's own GPU, ``cuda:LOCAL_RANK``; any other device is kept."""
    return f"cuda:{place.local_rank}" if device == "cuda" else device


def data_position(region: int, regions: int, place: RankPlace | None) -> tuple[int, int]:
    """``(rank, world)`` of this process among every rank of every region (which data it reads)."""
    if place is None:
        return region, regions
    return region * place.ranks + place.rank, regions * place.ranks


def rank_daemon_config(cfg: DaemonConfig, place: RankPlace, resume: bool, join: bool) -> DaemonConfig:
    """The region's daemon settings for one rank: its own checkpoint folder and metrics port.

    Refuses what a region of many ranks cannot do yet: resuming (the ranks would have to agree on one
    checkpoint of the region) and joining a running cluster.
    """
    if resume or join:
        raise ValueError("--resume and --join are not supported yet for a region of many ranks (torchrun)")
    metrics = cfg.metrics
    if metrics.listen:
        metrics = dataclasses.replace(metrics, listen=shift_port(metrics.listen, place.rank))
    # every rank holds the region's replica; each writes its own copy until checkpoints per region exist
    folder = str(Path(cfg.checkpoint.dir) / rank_node_id(cfg.node.node_id, place.rank))
    return dataclasses.replace(cfg, metrics=metrics, checkpoint=dataclasses.replace(cfg.checkpoint, dir=folder))


def start_region(device: str) -> None:
    """Join the region's process group (torchrun's rendezvous): NCCL on a GPU, gloo on the CPU."""
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.startswith("cuda") else "gloo")


def data_parallel(model: nn.Module, device: str) -> DistributedDataParallel:
    """The region's replica: DDP averages gradients among the ranks every step.

    Buffers are not broadcast on every forward (the strategy syncs them with the parameters), so a rank
    may evaluate alone without waiting on the others.
    """
    ids = [torch.device(device).index] if device.startswith("cuda") else None
    return DistributedDataParallel(model, device_ids=ids, broadcast_buffers=False)
