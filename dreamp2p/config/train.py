"""The ``[train]`` table of a node daemon: how each step is computed (accumulation, clipping, AMP, schedule).

These knobs act on whatever task runs (the embedded one or a ``[task] entry``), except the learning-rate
schedule, which shapes only the optimizer the daemon builds itself (an entry that returns its own optimizer
brings its own scheduler). What applies them is :mod:`dreamp2p.service.recipe`; the schedule itself is
:func:`scheduled_lr` here, pure.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from dreamp2p.config.parse import one_of_message

AMP_MODES = ("off", "bf16", "fp16")
# the most a step floor (min_step_s) may ask, in seconds: more is a typo, not a pace
MAX_MIN_STEP_S = 60.0
SCHEDULES = ("constant", "cosine")


@dataclass(frozen=True)
class TrainConfig:
    """``[train]``: micro-batches per step, gradient clipping, mixed precision, the learning-rate schedule, a pace."""

    accumulation: int = 1  # micro-batches whose gradients are summed (each loss divided by this) per step
    grad_clip: float = 0.0  # max global L2 norm of the gradients before the optimizer step; 0 turns it off
    amp: str = "off"  # "bf16": autocast to bfloat16 (CPU or CUDA); "fp16": float16 + GradScaler (CUDA only)
    schedule: str = "constant"  # "cosine": from task.lr down to lr_min at task.steps, after the warm-up
    warmup_steps: int = 0  # linear warm-up from task.lr / warmup_steps to task.lr over these first steps
    lr_min: float = 0.0  # the learning rate the cosine schedule ends at
    # the shortest wall time a daemon's step may take: the trainer sleeps out the rest (0: never sleeps). For
    # daemons that share a host (a laptop demo, a test suite on two cores), so a tiny model does not spin a
    # core flat out stepping faster than anyone reads; the sleep is outside the profiled compute
    min_step_s: float = 0.0
    # a daemon that reaches task.steps (not one stopped by a signal) flushes before its last checkpoint:
    # every member that reached it ends with bit-identical parameters (checked first, so replicas that already
    # agree send only digests). Off: each keeps its own replica, as after any stop
    flush_at_end: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.accumulation, bool) or not isinstance(self.accumulation, int) or self.accumulation < 1:
            raise ValueError(f"train.accumulation must be an integer >= 1, got {self.accumulation!r}")
        if not 0 <= self.grad_clip < math.inf:
            raise ValueError(f"train.grad_clip must be a number >= 0 (0 turns clipping off), got {self.grad_clip!r}")
        if self.amp not in AMP_MODES:
            raise ValueError(one_of_message("train.amp", self.amp, AMP_MODES))
        if self.schedule not in SCHEDULES:
            raise ValueError(one_of_message("train.schedule", self.schedule, SCHEDULES))
        if isinstance(self.warmup_steps, bool) or not isinstance(self.warmup_steps, int) or self.warmup_steps < 0:
            raise ValueError(f"train.warmup_steps must be an integer >= 0, got {self.warmup_steps!r}")
        if not 0 <= self.lr_min < math.inf:
            raise ValueError(f"train.lr_min must be a number >= 0, got {self.lr_min!r}")
        if isinstance(self.min_step_s, bool) or not 0 <= self.min_step_s < MAX_MIN_STEP_S:
            raise ValueError(
                f"train.min_step_s must be a number of seconds in [0, {MAX_MIN_STEP_S:g}), got {self.min_step_s!r}"
            )
        if not isinstance(self.flush_at_end, bool):
            raise ValueError(f"train.flush_at_end must be true or false, got {self.flush_at_end!r}")
        if self.lr_min > 0 and self.schedule != "cosine":
            raise ValueError("train.lr_min is where the cosine schedule ends: set train.schedule = 'cosine' too")

    @property
    def scheduled(self) -> bool:
        """Whether the learning rate changes with the step (a warm-up or the cosine schedule)."""
        return self.warmup_steps > 0 or self.schedule != "constant"


def check_train(train: TrainConfig, lr: float, steps: int, device: str) -> None:
    """The checks that need other tables: ``[task]`` lr and steps, the top-level device; ValueError names them."""
    errors = train_errors(train, lr, steps, device)
    if errors:
        raise ValueError(errors[0])


def train_errors(train: TrainConfig, lr: float, steps: int, device: str) -> list[str]:
    """Every error of :func:`check_train` (for ``config check``, which reports them all at once)."""
    errors = []
    if train.lr_min >= lr and train.schedule == "cosine":
        errors.append(f"train.lr_min ({train.lr_min}) must be < task.lr ({lr}) for the cosine schedule")
    if train.warmup_steps >= steps and train.scheduled:
        errors.append(f"train.warmup_steps ({train.warmup_steps}) must be < task.steps ({steps})")
    if train.amp == "fp16" and device == "cpu":
        errors.append("train.amp = 'fp16' needs CUDA (a GradScaler on a GPU); use 'bf16' on the CPU")
    return errors


def scheduled_lr(
    step: int, lr: float, steps: int, warmup_steps: int = 0, lr_min: float = 0.0, cosine: bool = True
) -> float:
    """The learning rate of ``step`` (0-based) under a linear warm-up then a cosine decay to ``lr_min``. Pure.

    Warm-up: ``lr * (step + 1) / warmup_steps`` for the first ``warmup_steps`` steps (never 0, so the first
    step moves). Then ``lr`` (``cosine=False``), or the cosine from ``lr`` at the end of the warm-up to
    ``lr_min`` at ``steps``, held there past it.
    """
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    if not cosine:
        return lr
    progress = min(1.0, (step - warmup_steps) / max(1, steps - warmup_steps))
    return lr_min + (lr - lr_min) * 0.5 * (1.0 + math.cos(math.pi * progress))
