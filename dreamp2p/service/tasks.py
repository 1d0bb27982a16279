"""Training tasks a node can run: the embedded byte-level language model and user plug-ins.

The default task needs no download: a small causal transformer learns to predict the next byte of
the Python standard library's own source files, which exist wherever Python does. Files are dealt to
nodes round-robin (disjoint shards); every 20th file is held out for evaluation. A batch is a pure
function of (seed, rank, step), so the data position is the step and a resumed node continues exactly.
Users plug in their own task with ``entry = "package.module:function"`` (called as
``function(task_config, rank, world, device)``) returning a :class:`Task`, or a
:class:`dreamp2p.service.recipe.Recipe` with their own model, optimizer, LR scheduler and data.
"""

from __future__ import annotations

import importlib
import math
import sysconfig
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn
from torch.nn import functional as F

from dreamp2p.config.task import TaskConfig


class Task(Protocol):
    """What the node daemon needs from a task."""

    tokens_per_batch: int

    def model(self) -> nn.Module: ...

    def batch(self, step: int) -> Any: ...

    def loss(self, model: nn.Module, batch: Any) -> torch.Tensor: ...

    def evaluate(self, model: nn.Module) -> float: ...


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, 4 * dim)
        self.out = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class ByteTransformer(nn.Module):
    """A nanoGPT-style causal transformer over bytes (vocabulary 256)."""

    def __init__(self, context: int, dim: int, layers: int, heads: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(256, dim)
        self.pos = nn.Embedding(context, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, 256)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts and p.is_file())
    if not files:
        raise RuntimeError(f"no Python source files under {root}")
    return files


def _read(files: list[Path], limit: int) -> torch.Tensor:
    chunks = []
    total = 0
    for path in files:
        try:
            data = path.read_bytes()
        except OSError:
            continue
        chunks.append(data)
        total += len(data)
        if total >= limit:
            break
    return torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8).long()


class BytesLM:
    """The embedded default task: next-byte prediction on a shard of the standard library's source."""

    def __init__(self, cfg: TaskConfig, rank: int, world: int, device: str = "cpu") -> None:
        self.cfg = cfg
        self.rank = rank
        self.device = torch.device(device)
        files = stdlib_files()
        held = files[::20]
        train = [f for i, f in enumerate(files) if i % 20]
        self.train_data = _read(train[rank::world], cfg.max_corpus_bytes)
        self.eval_data = _read(held, 1 << 20)
        if self.train_data.numel() <= cfg.context + 1:
            raise RuntimeError(f"shard {rank} of {world} is too small to train on")
        self.tokens_per_batch = cfg.batch * cfg.context
        g = torch.Generator().manual_seed(cfg.seed + 7)
        starts = torch.randint(0, self.eval_data.numel() - cfg.context - 1, (32,), generator=g)
        self._eval_batch = self._windows(self.eval_data, starts)

    def _windows(self, data: torch.Tensor, starts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        idx = starts.unsqueeze(1) + torch.arange(self.cfg.context + 1)
        w = data[idx]
        return w[:, :-1].to(self.device), w[:, 1:].to(self.device)

    def model(self) -> nn.Module:
        torch.manual_seed(self.cfg.seed)
        c = self.cfg
        return ByteTransformer(c.context, c.dim, c.layers, c.heads).to(self.device)

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(self.cfg.seed * 1_000_003 + self.rank * 7919 + step)
        starts = torch.randint(0, self.train_data.numel() - self.cfg.context - 1, (self.cfg.batch,), generator=g)
        return self._windows(self.train_data, starts)

    def loss(self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(model(x).reshape(-1, 256), y.reshape(-1))

    @torch.no_grad()
    def evaluate(self, model: nn.Module) -> float:
        was = model.training
        model.eval()
        loss = float(self.loss(model, self._eval_batch))
        model.train(was)
        return loss if math.isfinite(loss) else float("inf")


def make_task(cfg: TaskConfig, rank: int, world: int, device: str = "cpu") -> Task:
    """The embedded task, or what ``cfg.entry`` returns (a Task, or a Recipe: see dreamp2p.service.recipe)."""
    if cfg.entry:
        module, _, name = cfg.entry.partition(":")
        if not module or not name:
            raise ValueError(f"task.entry must look like 'package.module:function', got {cfg.entry!r}")
        fn = getattr(importlib.import_module(module), name, None)
        if fn is None:
            raise ValueError(f"task.entry: {module} has no attribute {name!r}")
        task: Task = fn(cfg, rank, world, device)
        return task
    return BytesLM(cfg, rank, world, device)
