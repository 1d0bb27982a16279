"""A node's library entry point: the peer (on its comm thread) plus `attach` for the user's model.

node = Node(config)                       # or Node.from_toml(path)
sync = node.attach(model, optimizer)      # DreamDDP by default
for batch in loader:
    loss = loss_fn(model(batch)); loss.backward()
    sync.step(); sync.zero_grad()
node.close()
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dreamp2p.config import PeerConfig, PeerInfo
from dreamp2p.manifest import manifest_hash
from dreamp2p.sync.base import Strategy, broadcast_parameters
from dreamp2p.sync.baselines import CO2, SSGD, DiLoCo, LocalSGD, NoSync, StreamingDiLoCo
from dreamp2p.sync.comm import CommThread
from dreamp2p.sync.config import SyncConfig
from dreamp2p.sync.dreamddp import DreamDDP

STRATEGY_CLASSES: dict[str, type[Strategy]] = {
    cls.name: cls for cls in (NoSync, SSGD, LocalSGD, DiLoCo, StreamingDiLoCo, CO2, DreamDDP)
}


class Node:
    def __init__(self, config: PeerConfig, model: nn.Module | None = None) -> None:
        if model is not None and not config.manifest_hash:
            # peers only average with peers that hold the same model layout
            config = dataclasses.replace(config, manifest_hash=manifest_hash(model.state_dict().items()))
        self.config = config
        self.comm = CommThread(config)
        self._connected = False
        self.strategy: Strategy | None = None

    @staticmethod
    def from_toml(path: str | Path) -> Node:
        return Node(PeerConfig.from_toml(path))

    @property
    def address(self) -> str:
        return self.comm.address

    def connect(self, ring: Sequence[PeerInfo] | None = None, timeout: float | None = None) -> None:
        self.comm.connect(ring, timeout)
        self._connected = True

    def attach(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        strategy: str | None = None,
        sync: SyncConfig | None = None,
        broadcast: bool = True,
        **overrides: Any,
    ) -> Strategy:
        """Wrap ``optimizer`` with a synchronization strategy; replicas start from rank 0's parameters."""
        cfg = sync or SyncConfig()
        if strategy is not None:
            overrides["strategy"] = strategy
        if overrides:
            cfg = dataclasses.replace(cfg, **overrides)
        if not self._connected:
            self.connect()
        if broadcast:  # a node resuming from its checkpoint keeps its own parameters
            params = [p for p in model.parameters() if p.requires_grad]
            broadcast_parameters(self.comm, params, cfg.round_timeout_s)
        strat = STRATEGY_CLASSES[cfg.strategy](model, optimizer, self.comm, cfg)
        self.strategy = strat
        return strat

    def close(self) -> None:
        try:
            if self.strategy is not None:
                self.strategy.close()
        finally:
            self.comm.close()
