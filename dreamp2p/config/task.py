"""The ``[task]`` table of a node daemon: which training task ``dreamp2p node`` runs and its size.

The tasks themselves (the byte-level language model, user plug-ins) live in :mod:`dreamp2p.service.tasks`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TaskConfig:
    name: str = "bytes-lm"
    entry: str | None = None  # "package.module:function" returning a Task; overrides name
    steps: int = 1000
    batch: int = 16
    context: int = 64
    dim: int = 128
    layers: int = 2
    heads: int = 4
    lr: float = 3e-3
    seed: int = 0
    eval_every: int = 50
    max_corpus_bytes: int = 8 << 20

    def __post_init__(self) -> None:
        if self.entry is None and self.name != "bytes-lm":
            raise ValueError(
                f"task.name must be 'bytes-lm' (or give task.entry = 'module:function'), got {self.name!r}"
            )
        for key in ("steps", "batch", "context", "dim", "layers", "heads", "eval_every", "max_corpus_bytes"):
            if getattr(self, key) < 1:
                raise ValueError(f"task.{key} must be >= 1, got {getattr(self, key)}")
        if self.dim % self.heads:
            raise ValueError(f"task.dim ({self.dim}) must be a multiple of task.heads ({self.heads})")
        if not self.lr > 0:
            raise ValueError(f"task.lr must be > 0, got {self.lr}")
