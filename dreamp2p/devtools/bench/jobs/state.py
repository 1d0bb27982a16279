"""Jobs for the model-state and settings-agreement tests: a model whose state is more than its weights.

``BatchNormNet`` holds what gradient averaging alone never equalizes: BatchNorm running statistics, a frozen
parameter and a registered buffer, each initialized differently per rank on purpose.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from dreamp2p.errors import PeerError
from dreamp2p.manifest import param_digest, state_digest
from dreamp2p.node import Node


class BatchNormNet(nn.Module):
    def __init__(self, seed: int, channels: int = 4) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.conv = nn.Conv2d(1, channels, 3, padding=1)
        self.bn = nn.BatchNorm2d(channels)
        self.head = nn.Linear(channels * 8 * 8, 10)
        self.bias = nn.Parameter(torch.randn(channels), requires_grad=False)  # frozen
        self.register_buffer("gain", torch.rand(1) + 0.5)  # registered, never trained

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.bn(self.conv(x))) * self.get_buffer("gain") + self.bias.view(1, -1, 1, 1)
        return self.head(h.flatten(1))


def _batch(rank: int, step: int, size: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7919 * step + rank)
    # per-rank input scale, so BatchNorm statistics really differ between ranks
    x = torch.randn(size, 1, 8, 8, generator=g) * (1.0 + rank)
    return x, torch.randint(0, 10, (size,), generator=g)


def model_state_job(
    node: Node, rank: int, world: int, strategy: str, steps: int = 12, sync: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Attach, train, flush; the state digest (parameters and buffers) at each point."""
    model = BatchNormNet(seed=rank)
    before = state_digest(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    s = node.attach(model, opt, strategy=strategy, **(sync or {}))
    attached = state_digest(model)
    for step in range(steps):
        x, y = _batch(rank, step)
        nn.functional.cross_entropy(model(x), y).backward()
        s.step()
        s.zero_grad()
    trained = state_digest(model)
    trained_params = param_digest(model)
    s.flush()
    return {
        "before": before,
        "attached": attached,
        "trained": trained,
        "trained_params": trained_params,
        "flushed": state_digest(model),
        "running_mean": [float(v) for v in model.bn.get_buffer("running_mean")],
        "batches_tracked": int(model.bn.get_buffer("num_batches_tracked")),
        "rounds_skipped": s.rounds_skipped,
    }


def attach_job(
    node: Node, rank: int, world: int, sync_by_rank: list[dict[str, Any]], channels_by_rank: list[int]
) -> dict[str, Any]:
    """Attach with this rank's settings; report the refusal (status and message) instead of raising."""
    model = BatchNormNet(seed=rank, channels=channels_by_rank[rank])
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    try:
        s = node.attach(model, opt, **sync_by_rank[rank])
    except PeerError as exc:
        return {"status": exc.status.name, "error": str(exc)}
    s.close()
    return {"status": "OK", "error": ""}
