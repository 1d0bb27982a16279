"""What a node must agree on with the others before it trains: its settings and its model's layout.

Built once at attach from the resolved strategy config and the model; compared in every handshake (see
`dreamp2p.settings`), so a cluster never starts with nodes that would average groups of different sizes
or drift apart silently.
"""

from __future__ import annotations

import torch
from torch import nn

from dreamp2p.config.sync import SyncConfig
from dreamp2p.manifest import manifest_hash

# Inner optimizers with per-element adaptive steps: DiLoCo's Nesterov outer step suits them (looked up by
# name: older torch releases lack some).
ADAPTIVE_OPTIMIZERS: tuple[type, ...] = tuple(
    getattr(torch.optim, name)
    for name in ("Adam", "AdamW", "Adamax", "NAdam", "RAdam", "Adagrad", "Adadelta", "RMSprop", "Adafactor")
    if hasattr(torch.optim, name)
)


def is_adaptive(optimizer: torch.optim.Optimizer) -> bool:
    return isinstance(optimizer, ADAPTIVE_OPTIMIZERS)


def inner_momentum(optimizer: torch.optim.Optimizer) -> float:
    """The largest SGD-style momentum among the optimizer's parameter groups (0 when it has none)."""
    return max((float(g.get("momentum", 0.0) or 0.0) for g in optimizer.param_groups), default=0.0)


def model_settings(model: nn.Module) -> dict[str, str]:
    """The model's layout as the settings members must share: names, shapes and dtypes of all its state."""
    params = list(model.parameters())
    buffers = list(model.buffers())
    state = list(model.state_dict().items())
    return {
        "model.manifest": manifest_hash(state).hex()[:16],
        "model.trainable_elements": str(sum(p.numel() for p in params if p.requires_grad)),
        "model.frozen_elements": str(sum(p.numel() for p in params if not p.requires_grad)),
        "model.buffer_elements": str(sum(b.numel() for b in buffers)),
    }


def training_settings(cfg: SyncConfig, model: nn.Module) -> dict[str, str]:
    """Everything that must match on every member: every sync setting plus the model's layout."""
    return {**cfg.shared_settings(), **model_settings(model)}
