"""`dreamp2p node` as one local rank of a region: torchrun's environment, the process group, DDP.

``torchrun --nproc-per-node N -m dreamp2p node --config region.toml`` starts N daemons from one region
file. Each finds its place from torchrun's environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``),
joins the region's process group (gloo on CPU, NCCL on GPU), trains on ``cuda:LOCAL_RANK`` when the
device is CUDA, wraps the task's model in DDP, and reads its own share of the data (its global position
among every rank of every region). `dreamp2p.node.Node` then gives it its own peer (node id, ports,
ring: `dreamp2p.sync.comm.shards`) and shard of every WAN round (`dreamp2p.sync.comm.sharded`).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from dreamp2p.config.daemon import DaemonConfig
from dreamp2p.node import Node
from dreamp2p.service.checkpoint import checkpoint_file, save_checkpoint
from dreamp2p.service.lifecycle import JOIN, agree_and_load
from dreamp2p.state.snapshot import flatten_state, unflatten_state
from dreamp2p.sync.comm.regionjoin import decode_fetched, encode_fetched
from dreamp2p.sync.comm.shards import shift_port


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


def elastic_restart(env: Mapping[str, str]) -> bool:
    """Whether torchrun restarted this region's ranks (``--max-restarts``) after one of them failed.

    The other regions trained on without it meanwhile, so the region joins them by state transfer.
    """
    try:
        return int(env.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
    except ValueError:
        count = env["TORCHELASTIC_RESTART_COUNT"]
        raise ValueError(f"TORCHELASTIC_RESTART_COUNT is not an integer: {count!r}") from None


def rank_daemon_config(cfg: DaemonConfig, place: RankPlace, resume: bool, join: bool) -> DaemonConfig:
    """The region's daemon settings for one rank: its own metrics port; the region's checkpoint folder.

    Every rank holds the region's one replica, so the region keeps one checkpoint, written by local rank 0
    into ``[checkpoint] dir`` (:func:`save_region_checkpoint`); a resuming region loads it on rank 0 and
    shares it (:func:`region_agree_and_load`). Joining: every rank joins its shard ring, local rank 0
    fetches the state for the region (`dreamp2p.sync.comm.regionjoin`).
    """
    metrics = cfg.metrics
    if metrics.listen:
        # the ranks on one host share its ports: each takes the one of its rank on the host
        metrics = dataclasses.replace(metrics, listen=shift_port(metrics.listen, place.local_rank))
    return dataclasses.replace(cfg, metrics=metrics)


def save_region_checkpoint(node: Node, directory: str, step: int, state: dict[str, Any], keep: int) -> Path:
    """Write the checkpoint of ``step``; in a region only local rank 0 writes it (the other ranks hold the
    same replica after the step's gathers) and the others get the path of that file."""
    if node.region is not None and node.region.local_rank != 0:
        return checkpoint_file(directory, step)
    return save_checkpoint(directory, step, state, keep)


def region_agree_and_load(directory: str, node: Node) -> tuple[Path, dict[str, Any]] | Literal["join"] | None:
    """:func:`~dreamp2p.service.lifecycle.agree_and_load` for a region: local rank 0 agrees with the other
    regions (over ring 0, whose members are their ranks 0) and loads the checkpoint; every rank gets the
    same decision and state (over the process group: the checkpoint may lie on rank 0's host only)."""
    if node.region is None:
        return agree_and_load(directory, node)
    region, t = node.region, node.config.transport
    payload: bytes | None = None
    error: BaseException | None = None
    if region.local_rank == 0:
        try:
            decided = agree_and_load(directory, node)
            if decided is None or decided == JOIN:
                payload = b"N" if decided is None else b"J"
            else:
                skeleton, named = flatten_state({"path": str(decided[0]), "state": decided[1]})
                payload = b"S" + encode_fetched(0, skeleton, dict(named))
        except Exception as exc:  # told to the other ranks (an empty buffer), raised here
            error, payload = exc, b""
    buf = region.broadcast_bytes(payload, 2 * t.connect_timeout_s + t.rpc_deadline_s)
    if error is not None:
        raise error
    if not buf:
        raise RuntimeError("local rank 0 of the region could not agree where to resume from")
    if buf[:1] in (b"N", b"J"):
        return None if buf[:1] == b"N" else JOIN
    _, skeleton, tensors = decode_fetched(buf[1:])
    shared = unflatten_state(skeleton, tensors)
    return Path(shared["path"]), shared["state"]


def start_region(device: str) -> None:
    """Join the region's process group (torchrun's rendezvous): NCCL on a GPU, gloo on the CPU."""
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    if not dist.is_initialized():
        backend = "nccl" if device.startswith("cuda") else "gloo"
        store = restart_store(os.environ)
        if store is None:
            dist.init_process_group(backend)
        else:
            rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
            dist.init_process_group(backend, store=store, rank=rank, world_size=world)


def restart_store(env: Mapping[str, str]) -> dist.Store | None:
    """After torchrun restarted the region: its rendezvous store under a prefix of this attempt, else None.

    torchrun's shared store still holds the keys the previous attempt's ranks wrote (the dead rank's
    address among them), which the new process group would read instead of waiting for the new ranks.
    """
    if not elastic_restart(env) or "MASTER_ADDR" not in env:
        return None
    agent = env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"  # the agent hosts it, else rank 0 does
    store = dist.TCPStore(
        env["MASTER_ADDR"],
        int(env["MASTER_PORT"]),
        int(env["WORLD_SIZE"]),
        is_master=not agent and env["RANK"] == "0",
        timeout=timedelta(minutes=10),
    )
    return dist.PrefixStore(f"/dreamp2p/attempt_{env['TORCHELASTIC_RESTART_COUNT']}", store)


def data_parallel(model: nn.Module, device: str) -> DistributedDataParallel:
    """The region's replica: DDP averages gradients among the ranks every step.

    Buffers are not broadcast on every forward (the strategy syncs them with the parameters), so a rank
    may evaluate alone without waiting on the others.
    """
    ids = [torch.device(device).index] if device.startswith("cuda") else None
    return DistributedDataParallel(model, device_ids=ids, broadcast_buffers=False)


def fully_sharded(model: nn.Module) -> nn.Module:
    """The region's model sharded with FSDP2 (``fully_shard``) instead of replicated: each block of the
    model's ModuleLists (a transformer's layers) one unit, or, in a model without any, each child holding
    parameters; then the whole (what is left: embeddings, the head). Gloo on the CPU, NCCL on a GPU."""
    from torch.distributed.fsdp import fully_shard

    units = [block for mods in model.modules() if isinstance(mods, nn.ModuleList) for block in mods]
    if not units:
        units = [child for child in model.children() if any(True for _ in child.parameters())]
    for unit in units:
        fully_shard(unit)
    fully_shard(model)
    return model
