"""The job of test_amp_overflow.py, run in each member's own process by `dreamp2p.devtools.launch.run_local`:
train under a CPU GradScaler with one member's gradients overflowing at one step, then a quiet stretch and flush()."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from dreamp2p.manifest import param_digest
from dreamp2p.node import Node


def amp_job(
    node: Node, rank: int, world: int, strategy: str, steps: int, quiet_from: int, overflow: list[int]
) -> dict[str, Any]:
    """``overflow``: [rank, step] whose gradients get an Inf. From ``quiet_from`` on the learning rate is 0."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    sync = node.attach(model, opt, strategy=strategy, period=4, warmup_steps=2, control_every=4, max_stretch=1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    for step in range(steps):
        if step == quiet_from:
            for group in sync.param_groups:
                group["lr"] = 0.0
        g = torch.Generator().manual_seed(1000 * rank + step)
        x = torch.randn(8, 6, generator=g)
        scaler.scale(nn.functional.mse_loss(model(x), torch.sin(x[:, :3]) + 0.1 * rank)).backward()
        if [rank, step] == overflow:
            next(iter(model.parameters())).grad.view(-1)[0] = float("inf")  # type: ignore[union-attr]
        scaler.step(sync)
        scaler.update()
        sync.zero_grad()
    sync.close()
    flushed = sync.flush()
    return {
        "steps": sync.step_count,
        "skipped_local": sync.amp_steps_skipped,
        "rounds_skipped": sync.rounds_skipped,
        "scale": scaler.get_scale(),
        "digest": param_digest(model),
        "flush_path": flushed,
        "finite": all(bool(torch.isfinite(p).all()) for p in model.parameters()),
    }
