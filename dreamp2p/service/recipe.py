"""A daemon's training recipe: the model, optimizer, LR scheduler and data it trains with, and one step of it.

A ``[task] entry`` returns either a :class:`~dreamp2p.service.tasks.Task` (the daemon then builds AdamW at
``task.lr``, shaped by ``[train]``'s warm-up and cosine schedule, and reads ``task.batch(i)``) or a
:class:`Recipe`: the user's own model, optimizer, optional LR scheduler and data (a DataLoader, any iterable of
batches, or a function of the first batch index). :class:`Training` runs one step of either under ``[train]``:
``accumulation`` micro-batches, each loss divided by their number; AMP (bf16 autocast, or fp16 autocast with a
GradScaler on CUDA); gradient clipping to ``grad_clip``; then the strategy's ``step()`` in place of the
optimizer's, then the scheduler's ``step()``, so the scheduler moves exactly once per training step.

Where a resumed or joining node continues: batch index ``step * accumulation``. A task's ``batch(i)`` and a
data function ``data(start)`` start there at once. A plain iterable (a DataLoader) is read from its start
and the first ``step * accumulation`` batches are skipped (a new pass is begun each time it runs out), so
it continues at the same batch only if it yields the same sequence in a new process: give a shuffling
DataLoader a seeded ``generator``. The scheduler and the GradScaler come back from the checkpoint; a node
that joins a running cluster takes the members' optimizer state (its learning rates included) and moves its
scheduler to the step it joins at (``last_epoch = step``).

fp16 steps whose gradients overflow must still call the strategy's ``step()`` on every member, so that all
count the same steps and take part in the same rounds. A strategy that declares GradScaler support
(``_step_supports_amp_scaling``, see ``dreamp2p.sync.model.optim``) is stepped through ``scaler.step(sync)`` after
``scaler.unscale_(sync)`` and clipping: it skips only its optimizer's update on an overflow. Without it, the
gradients are unscaled on the optimizer and, when not finite, zeroed before ``sync.step()``: the optimizer
then steps on zero gradients (momentum and weight decay act), which keeps S-SGD's replicas identical (they
apply the same averaged gradient). Either way the scaler then lowers its scale.
"""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR, LRScheduler

from dreamp2p.config.daemon import DaemonConfig
from dreamp2p.config.train import TrainConfig, scheduled_lr
from dreamp2p.service.tasks import Task, make_task

log = logging.getLogger(__name__)

DataSource = Iterable[Any] | Callable[[int], Iterable[Any]]


@dataclass
class Recipe:
    """What a ``[task] entry`` may return instead of a Task: the user's own model, optimizer, scheduler and data.

    ``data``: an iterable of batches (a ``torch.utils.data.DataLoader`` is welcome) or a function from the
    first batch index to an iterable starting there (resumes without reading skipped batches). Tensors in a
    batch (alone or in tuples, lists and dicts) are moved to the node's device. ``loss(model, batch)``
    returns the scalar to minimise; ``scheduler`` (optional) is stepped once per training step;
    ``evaluate(model)`` (optional) returns a held-out loss; ``tokens_per_batch`` what one batch counts in
    the tokens/s figure (0: not measured).
    """

    model: nn.Module
    optimizer: torch.optim.Optimizer
    loss: Callable[[nn.Module, Any], torch.Tensor]
    data: DataSource
    scheduler: LRScheduler | None = None
    evaluate: Callable[[nn.Module], float] | None = None
    tokens_per_batch: int = 0


@dataclass(frozen=True)
class StepResult:
    """One training step: its mean loss over the micro-batches, the strategy's stats, the learning rate it used."""

    loss: float
    stats: Any
    lr: float
    overflowed: bool = False


class Batches:
    """Batch index -> batch, read in order from a data function (positioned at once) or an iterable (skipped)."""

    def __init__(self, data: DataSource, device: torch.device | None = None) -> None:
        self.data = data
        self.device = device
        self.position = 0  # index of the next batch
        self._it: Iterator[Any] | None = None

    def seek(self, start: int) -> None:
        """Continue at batch ``start``: at once for a data function, else by reading ``start`` batches."""
        self.position = start
        self._it = self._open(start)
        if start and not _is_data_function(self.data):
            log.info("data: skipping %d batches to continue where the cluster is", start)
            for _ in range(start):
                self._read()

    def next(self) -> Any:
        if self._it is None:
            self.seek(self.position)
        batch = self._read()
        self.position += 1
        return _to_device(batch, self.device)

    def _open(self, start: int) -> Iterator[Any]:
        """A new pass: a data function from batch ``start``, an iterable from its beginning."""
        if _is_data_function(self.data):
            return iter(self.data(start))  # type: ignore[operator]
        return iter(self.data)  # type: ignore[arg-type]

    def _read(self) -> Any:
        for attempt in range(2):
            try:
                return next(self._it if self._it is not None else self._open(self.position))
            except StopIteration:
                if attempt:
                    break
                self._it = self._open(self.position)  # a new pass (an epoch)
        raise RuntimeError("task data yields no batches")


def _is_data_function(data: DataSource) -> bool:
    return callable(data) and not hasattr(data, "__iter__")


def _to_device(batch: Any, device: torch.device | None) -> Any:
    if device is None:
        return batch
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a namedtuple
        return type(batch)(*(_to_device(b, device) for b in batch))
    if isinstance(batch, tuple | list):
        return type(batch)(_to_device(b, device) for b in batch)
    if isinstance(batch, Mapping):
        return {k: _to_device(v, device) for k, v in batch.items()}
    return batch


class Training:
    """One node's recipe under ``[train]``: runs steps, checkpoints and restores the scheduler and scaler."""

    def __init__(self, recipe: Recipe, train: TrainConfig, device: str = "cpu") -> None:
        self.model = recipe.model  # run_node may put it in DistributedDataParallel (a region of many ranks)
        self.optimizer = recipe.optimizer
        self.scheduler = recipe.scheduler
        self.recipe = recipe
        self.cfg = train
        self.device = torch.device(device)
        self.batches = Batches(recipe.data, self.device)
        self.tokens_per_step = recipe.tokens_per_batch * train.accumulation
        self.scaler: torch.amp.GradScaler | None = None
        if train.amp == "fp16":
            if self.device.type != "cuda":
                raise ValueError(f"train.amp = 'fp16' needs CUDA (a GradScaler on a GPU); this node runs on {device}")
            self.scaler = torch.amp.GradScaler("cuda")
        self.overflows = 0  # fp16 steps whose gradients were not finite (zeroed)

    @property
    def lr(self) -> float:
        """The learning rate of the first parameter group now."""
        return float(self.optimizer.param_groups[0]["lr"])

    def evaluate(self) -> float | None:
        return None if self.recipe.evaluate is None else float(self.recipe.evaluate(self.model))

    def restore(self, step: int, saved: Mapping[str, Any] | None = None) -> None:
        """Continue at ``step`` (after a resume or a join): data position, then scheduler and scaler state."""
        self.batches.seek(step * self.cfg.accumulation)
        if self.scheduler is not None:
            if saved is not None and "scheduler" in saved:
                self.scheduler.load_state_dict(saved["scheduler"])
            elif step:
                # the optimizer came from the members (its learning rates as of this step): move the scheduler there
                self.scheduler.last_epoch = step
                self.scheduler._last_lr = [float(g["lr"]) for g in self.optimizer.param_groups]
        if self.scaler is not None and saved is not None and "scaler" in saved:
            self.scaler.load_state_dict(saved["scaler"])

    def state(self) -> dict[str, Any]:
        """What a checkpoint keeps beside the strategy's state: the scheduler's and the scaler's."""
        out: dict[str, Any] = {}
        if self.scheduler is not None:
            out["scheduler"] = self.scheduler.state_dict()
        if self.scaler is not None:
            out["scaler"] = self.scaler.state_dict()
        return out

    def step(self, sync: Any, step: int, quiet: bool = False) -> StepResult:
        """One training step through ``sync`` (the strategy); ``quiet``: learning rate 0 for this step only."""
        k = self.cfg.accumulation
        if self.batches.position != step * k:
            self.batches.seek(step * k)
        total = torch.zeros((), device=self.device)
        for _ in range(k):
            batch = self.batches.next()
            with self._autocast():
                loss = self.recipe.loss(self.model, batch)
            part = loss.float() / k
            (self.scaler.scale(part) if self.scaler is not None else part).backward()
            total += part.detach()
        native = self.scaler is not None and getattr(sync, "_step_supports_amp_scaling", False)
        overflowed = self._prepare_grads(sync if native else self.optimizer, zero_on_overflow=not native)
        groups = self.optimizer.param_groups
        lrs = [g["lr"] for g in groups]
        if quiet:
            for g in groups:
                g["lr"] = 0.0
        try:
            # DreamDDP launched (and may have waited on) syncs from the gradient hooks
            stats = self.scaler.step(sync) if native and self.scaler is not None else sync.step()
        finally:
            for g, lr in zip(groups, lrs, strict=True):
                g["lr"] = lr
        if self.scaler is not None:
            self.scaler.update()
        if self.scheduler is not None:
            self.scheduler.step()
        return StepResult(float(total), stats, 0.0 if quiet else float(lrs[0]), overflowed)

    def _autocast(self) -> AbstractContextManager[Any]:
        if self.cfg.amp == "off":
            return nullcontext()
        dtype = torch.bfloat16 if self.cfg.amp == "bf16" else torch.float16
        return torch.autocast(self.device.type, dtype=dtype)

    def _prepare_grads(self, scaled: Any, zero_on_overflow: bool) -> bool:
        """Unscale ``scaled``'s gradients (fp16), zero them on an overflow if asked, clip; whether it overflowed."""
        params = [p for g in self.optimizer.param_groups for p in g["params"] if p.grad is not None]
        grads = [p.grad for p in params if p.grad is not None]
        overflowed = False
        if self.scaler is not None:
            self.scaler.unscale_(scaled)
            if not math.isfinite(float(total_norm(grads))):
                overflowed = True
                self.overflows += 1
                what = "zeroed for this step" if zero_on_overflow else "the strategy skips this update"
                log.info("fp16 gradients overflowed (scale %g): %s", self.scaler.get_scale(), what)
                if zero_on_overflow:
                    for grad in grads:
                        grad.zero_()
        if self.cfg.grad_clip > 0 and params and not (overflowed and not zero_on_overflow):
            torch.nn.utils.clip_grad_norm_(params, self.cfg.grad_clip)
        return overflowed


def total_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The global L2 norm of ``grads`` (inf or nan when one is not finite); 0 for none."""
    if not grads:
        return torch.zeros(())
    device = grads[0].device
    norms = [torch.linalg.vector_norm(g.detach().float()).to(device) for g in grads]
    return torch.linalg.vector_norm(torch.stack(norms))


def make_training(cfg: DaemonConfig, rank: int, world: int, device: str = "cpu") -> Training:
    """The daemon's training for ``cfg``: the task or entry it names, as a :class:`Training` under ``[train]``."""
    made: Task | Recipe = make_task(cfg.task, rank, world, device)  # an entry may return a Recipe
    if isinstance(made, Recipe):
        if cfg.train.scheduled:
            raise ValueError(
                "train.warmup_steps and train.schedule shape the optimizer the daemon builds, but task.entry returned "
                "its own optimizer: give the entry's Recipe a scheduler instead"
            )
        return Training(made, cfg.train, device)
    return Training(task_recipe(made, cfg), cfg.train, device)


def task_recipe(task: Task, cfg: DaemonConfig) -> Recipe:
    """A Task as a Recipe: AdamW at ``task.lr``, the ``[train]`` schedule, batch ``i`` from ``task.batch(i)``."""
    model = task.model()
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.task.lr)
    t = cfg.train
    scheduler = None
    if t.scheduled:
        lr, steps, cosine = cfg.task.lr, cfg.task.steps, t.schedule == "cosine"

        def factor(step: int) -> float:
            return scheduled_lr(step, lr, steps, t.warmup_steps, t.lr_min, cosine) / lr

        scheduler = LambdaLR(opt, factor)

    def data(start: int) -> Iterator[Any]:
        return (task.batch(i) for i in itertools.count(start))

    return Recipe(model, opt, task.loss, data, scheduler, task.evaluate, task.tokens_per_batch)
