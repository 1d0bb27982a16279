"""A small, learnable training task shared by the strategy tests and `bench strategies`.

A fixed random "teacher" network labels Gaussian inputs; a student MLP learns it by regression. Batches
are a deterministic function of (rank, step), so any process can rebuild the union batch of all ranks
for the single-process reference run.
"""

from __future__ import annotations

import itertools
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dreamp2p.manifest import param_digest
from dreamp2p.node import Node
from dreamp2p.sync.strategies.base import Strategy


def student(width: int = 64, depth: int = 3, dim: int = 16, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    d = dim
    for _ in range(depth):
        layers += [nn.Linear(d, width), nn.Tanh()]
        d = width
    layers.append(nn.Linear(d, 1))
    return nn.Sequential(*layers)


_TEACHERS: dict[int, nn.Module] = {}


def teacher(dim: int = 16) -> nn.Module:
    if dim not in _TEACHERS:
        g = torch.Generator().manual_seed(1234)
        net = nn.Sequential(nn.Linear(dim, 32), nn.Tanh(), nn.Linear(32, 1))
        with torch.no_grad():
            for p in net.parameters():
                # unit-scale outputs: a well-conditioned target whose loss starts near 1
                fan_in = p.shape[-1] if p.dim() > 1 else 1
                p.copy_(torch.randn(p.shape, generator=g) / fan_in**0.5)
        _TEACHERS[dim] = net
    return _TEACHERS[dim]


def batch(rank: int, step: int, size: int = 32, dim: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1_000_003 * step + rank)
    x = torch.randn(size, dim, generator=g)
    with torch.no_grad():
        y = teacher(dim)(x)
    return x, y


def _optimizer(model: nn.Module, optimizer: str, lr: float) -> torch.optim.Optimizer:
    """SGD for "sgd", AdamW for anything else."""
    if optimizer == "sgd":
        return torch.optim.SGD(model.parameters(), lr=lr)
    return torch.optim.AdamW(model.parameters(), lr=lr)


def _quiet_steps(
    s: Strategy,
    model: nn.Module,
    opt: torch.optim.Optimizer,
    rank: int,
    first_batch: int,
    final_step: int,
    batch_size: int,
    device: str,
) -> None:
    """Steps at learning rate 0 (a full period with no local progress): only synchronization moves the model.

    Until the cluster's step ``final_step``, not for a count of iterations: a node that took the members'
    state near the end (Node.resync) starts beyond its own count, and a last round that no member but it
    runs would wait for the finished members until its deadline.
    """
    for group in opt.param_groups:
        group["lr"] = 0.0
    for step in itertools.count(first_batch):
        if s.step_count >= final_step:
            break
        x, y = (t.to(device) for t in batch(rank, step, batch_size))
        nn.functional.mse_loss(model(x), y).backward()
        s.step()
        s.zero_grad()


def _attach(
    node: Node,
    model: nn.Module,
    opt: torch.optim.Optimizer,
    strategy: str,
    sync: dict[str, Any],
    started_file: str | None,
    rank: int,
) -> Strategy:
    """``node.attach``, then touch ``<started_file>.<rank>`` when asked (training starts now)."""
    s = node.attach(model, opt, strategy=strategy, **sync)
    if started_file is not None:
        Path(f"{started_file}.{rank}").touch()
    return s


def _sync_figures(s: Strategy, node: Node, stamps: list[float]) -> dict[str, Any]:
    """What the strategy and the node counted in ``train_job``'s run, in its report's order: times and bytes,
    plans, step times (``stamps``), view changes and resyncs, skipped rounds, heals, link codecs."""
    tot = s.totals
    return {
        "compute_s": tot.compute_s,
        "exposed_s": tot.exposed_s,
        "comm_s": tot.comm_s,
        "bytes_sent": tot.bytes_sent,
        "hidden_fraction": tot.hidden_fraction,
        "plan_history": list(getattr(s, "plan_history", [])),
        # DreamDDP's control rounds: (step, slowest link's bandwidth, slowest goodput), what each re-plan saw
        "controls": [list(c) for c in getattr(s, "controls_seen", [])],
        "step_times": stamps,
        "view_changes": node.comm.view_changes,
        "resyncs": node.resyncs,
        "rounds_skipped": s.rounds_skipped,
        "anchors_healed": getattr(s, "anchors_healed", 0),
        # DiLoCo's, Streaming DiLoCo's and CO2's global copy and outer momentum: equal on every member once
        # a check found them apart and averaged them (`dreamp2p.sync.strategies.outercheck`); None for the others
        "outer_digest": s.outer_digest() if hasattr(s, "outer_digest") else None,
        "outer_heals": getattr(s, "outer_heals", 0),
        # DreamDDP's agreed control schedule: equal on every member that ends at the same step
        "next_control": getattr(s, "next_control_step", None),
        "link_codecs": list(rc.send) if (rc := getattr(s, "ring_codecs", None)) is not None else None,
        # what the per-link codecs were chosen from: each rank's goodput to its successor (B/s, NaN unknown)
        "link_bandwidths": list(g.link_bandwidths) if (g := getattr(s, "last_gathered", None)) is not None else None,
    }


def train_job(
    node: Node,
    rank: int,
    world: int,
    strategy: str,
    steps: int = 60,
    lr: float = 0.05,
    optimizer: str = "sgd",
    width: int = 64,
    depth: int = 3,
    batch_size: int = 32,
    sync: dict[str, Any] | None = None,
    slow_at: int | None = None,
    slow_rate: float | None = None,
    slow_ranks: list[int] | None = None,
    stall: tuple[int, int, float] | None = None,
    flush: bool = False,
    quiet_steps: int = 0,
    step_sleep: float = 0.0,
    step_times: bool = False,
    device: str = "cpu",
    started_file: str | None = None,
) -> dict[str, Any]:
    """Train the student with ``strategy``; report losses, stats, plans and a parameter digest.

    ``device="cuda"`` trains on the GPU (batches are made on the host and uploaded, as a loader would).
    ``stall=(rank, step, seconds)``: that rank's trainer stops for that long before that step (a slow
    peer whose process stays alive and keeps answering heartbeats).
    ``started_file``: touched as ``<started_file>.<rank>`` once attached (faults timed from training start).
    """
    # different inits on purpose: attach broadcasts rank 0's
    model = student(width, depth, seed=rank).to(device)
    opt = _optimizer(model, optimizer, lr)
    s = _attach(node, model, opt, strategy, sync or {}, started_file, rank)
    init_digest = param_digest(model)
    losses = []
    stamps: list[float] = []
    t0 = time.perf_counter()
    # until the cluster's step ``steps``, not for ``steps`` iterations: a node that took the members' state
    # (Node.resync) continues at their step, and every member must stop at the same round
    for step in itertools.count():
        if s.step_count >= steps:
            break
        if slow_at is not None and step == slow_at and (slow_ranks is None or rank in slow_ranks):
            node.comm.set_rate_limit(slow_rate)  # this rank's outgoing link(s)
        if stall is not None and (rank, step) == (stall[0], stall[1]):
            time.sleep(stall[2])
        x, y = (t.to(device, non_blocking=True) for t in batch(rank, step, batch_size))
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        if step_sleep:
            time.sleep(step_sleep)  # stands in for a heavier model's compute
        s.step()
        s.zero_grad()
        losses.append(loss.item())
        if step_times:
            stamps.append(time.time())  # wall clock: comparable with the parent's fault timeline
    wall = time.perf_counter() - t0
    trained_digest = param_digest(model)
    _quiet_steps(s, model, opt, rank, step, steps + quiet_steps, batch_size, device)
    s.close()
    flushed = s.flush() if flush else None
    return {
        "losses": losses,
        "wall_s": wall,
        "init_digest": init_digest,
        "digest": param_digest(model),
        "flush_path": flushed,  # how flush() made the parameters identical (`Strategy.flush`), None without
        "trained_digest": trained_digest,
        "basis_bw": getattr(s, "basis_bw", None),  # DreamDDP's: the bandwidth its latest plan was made for
        "params": [p.detach().cpu().numpy().copy() for p in model.parameters()],
        **_sync_figures(s, node, stamps),
    }


def reference_ssgd(
    world: int, steps: int, lr: float, width: int = 64, depth: int = 3, batch_size: int = 32
) -> nn.Module:
    """Single-process SGD on the union of every rank's batch, from rank 0's initialization."""
    model = student(width, depth, seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for step in range(steps):
        xs, ys = zip(*(batch(r, step, batch_size) for r in range(world)), strict=True)
        loss = nn.functional.mse_loss(model(torch.cat(xs)), torch.cat(ys))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model
