"""The ``[train]`` table (accumulation, clipping, AMP, LR schedule): its checks, the loaders and the pure schedule."""

from __future__ import annotations

import itertools
import math
import threading
import time
from typing import Any

import pytest

from dreamp2p.config import DaemonConfig, TrainConfig
from dreamp2p.config.check import check_daemon_config
from dreamp2p.config.train import check_train, scheduled_lr
from dreamp2p.service.daemon import _pace
from dreamp2p.service.lifecycle import StopFlag

NODE = {"node_id": "eu-west"}


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"accumulation": 0}, "train.accumulation must be an integer >= 1, got 0"),
        ({"accumulation": 1.5}, "train.accumulation must be an integer >= 1"),
        ({"accumulation": True}, "train.accumulation must be an integer >= 1"),
        ({"grad_clip": -1.0}, "train.grad_clip must be a number >= 0"),
        ({"grad_clip": math.nan}, "train.grad_clip must be a number >= 0"),
        ({"grad_clip": math.inf}, "train.grad_clip must be a number >= 0"),
        ({"amp": "fp8"}, "train.amp must be one of off, bf16, fp16; got 'fp8'"),
        ({"schedule": "linear"}, "train.schedule must be one of constant, cosine; got 'linear'"),
        ({"warmup_steps": -1}, "train.warmup_steps must be an integer >= 0"),
        ({"lr_min": -0.1, "schedule": "cosine"}, "train.lr_min must be a number >= 0"),
        ({"lr_min": 1e-4}, "train.lr_min is where the cosine schedule ends"),
        ({"min_step_s": -0.01}, "train.min_step_s must be a number of seconds in [0, 60)"),
        ({"min_step_s": math.nan}, "train.min_step_s must be a number of seconds in [0, 60)"),
        ({"flush_at_end": "yes"}, "train.flush_at_end must be true or false"),
        ({"min_step_s": 60}, "train.min_step_s must be a number of seconds in [0, 60)"),
        ({"min_step_s": True}, "train.min_step_s must be a number of seconds in [0, 60)"),
    ],
)
def test_bad_train_values_are_refused_naming_the_key(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match="train\\.") as info:
        TrainConfig(**fields)
    assert message in str(info.value)


@pytest.mark.parametrize(
    "fields",
    [
        {},
        {"accumulation": 4, "grad_clip": 1.0, "amp": "bf16"},
        {"amp": "fp16"},
        {"schedule": "cosine", "warmup_steps": 10, "lr_min": 1e-5},
        {"warmup_steps": 5},
        {"min_step_s": 0.02},
    ],
)
def test_good_train_values(fields: dict[str, Any]) -> None:
    cfg = TrainConfig(**fields)
    assert cfg.scheduled == (cfg.warmup_steps > 0 or cfg.schedule == "cosine")


@pytest.mark.parametrize(
    ("train", "lr", "steps", "device", "message"),
    [
        ({"schedule": "cosine", "lr_min": 0.01}, 0.01, 100, "auto", "train.lr_min (0.01) must be < task.lr (0.01)"),
        ({"warmup_steps": 100}, 0.01, 100, "auto", "train.warmup_steps (100) must be < task.steps (100)"),
        ({"amp": "fp16"}, 0.01, 100, "cpu", "train.amp = 'fp16' needs CUDA"),
        ({"amp": "fp16"}, 0.01, 100, "auto", None),
        ({"amp": "bf16"}, 0.01, 100, "cpu", None),
        ({"schedule": "cosine", "warmup_steps": 99, "lr_min": 0.001}, 0.01, 100, "cpu", None),
    ],
)
def test_checks_across_tables(train: dict[str, Any], lr: float, steps: int, device: str, message: str | None) -> None:
    cfg = TrainConfig(**train)
    if message is None:
        check_train(cfg, lr, steps, device)
        return
    with pytest.raises(ValueError) as info:
        check_train(cfg, lr, steps, device)
    assert message in str(info.value)


def test_the_loader_reads_train_and_checks_it_against_task() -> None:
    cfg = DaemonConfig.from_dict({"node": NODE, "train": {"accumulation": 2, "grad_clip": 1, "amp": "bf16"}})
    assert cfg.train == TrainConfig(accumulation=2, grad_clip=1.0, amp="bf16")
    assert DaemonConfig.from_dict({"node": NODE}).train == TrainConfig()
    with pytest.raises(ValueError, match=r"unknown key train\.clip \(did you mean 'grad_clip'\?\)"):
        DaemonConfig.from_dict({"node": NODE, "train": {"clip": 1.0}})
    with pytest.raises(ValueError, match=r"train\.warmup_steps \(50\) must be < task\.steps \(20\)"):
        DaemonConfig.from_dict({"node": NODE, "task": {"steps": 20}, "train": {"warmup_steps": 50}})
    with pytest.raises(ValueError, match="needs CUDA"):
        DaemonConfig.from_dict({"node": NODE, "device": "cpu", "train": {"amp": "fp16"}})


def test_config_check_reports_train_errors_with_the_others() -> None:
    data = {
        "node": NODE,
        "task": {"steps": 0},
        "train": {"accumulation": 0, "amp": "fp32", "gradclip": 1.0},
    }
    errors = check_daemon_config(data)
    expected = [
        "task.steps must be >= 1",
        "unknown key train.gradclip (did you mean 'grad_clip'?)",
        "train.accumulation must be an integer >= 1",
        "train.amp must be one of off, bf16, fp16",
    ]
    assert len(errors) == len(expected), errors
    for message, error in zip(expected, errors, strict=True):
        assert message in error, (message, error)


def test_config_check_reports_a_check_across_tables() -> None:
    data = {"node": NODE, "task": {"lr": 0.001}, "train": {"schedule": "cosine", "lr_min": 0.01}}
    assert check_daemon_config(data) == ["train.lr_min (0.01) must be < task.lr (0.001) for the cosine schedule"]
    assert check_daemon_config({"node": NODE, "device": "cpu", "train": {"amp": "fp16"}}) == [
        "train.amp = 'fp16' needs CUDA (a GradScaler on a GPU); use 'bf16' on the CPU"
    ]
    both = {"node": NODE, "device": "cpu", "task": {"steps": 10}, "train": {"amp": "fp16", "warmup_steps": 10}}
    assert check_daemon_config(both) == [
        "train.warmup_steps (10) must be < task.steps (10)",
        "train.amp = 'fp16' needs CUDA (a GradScaler on a GPU); use 'bf16' on the CPU",
    ]


@pytest.mark.parametrize(
    ("step", "warmup", "cosine", "expected"),
    [
        (0, 0, False, 1.0),  # constant, no warm-up
        (99, 0, False, 1.0),
        (0, 4, False, 0.25),  # warm-up: (step + 1) / warmup, never 0
        (3, 4, False, 1.0),
        (4, 4, False, 1.0),
        (0, 0, True, 1.0),  # cosine starts at lr
        (50, 0, True, 0.55),  # halfway: the mean of lr (1) and lr_min (0.1)
        (100, 0, True, 0.1),  # ends at lr_min
        (500, 0, True, 0.1),  # and stays there past task.steps
        (1, 2, True, 1.0),  # last warm-up step reaches lr
        (2, 2, True, 1.0),  # the cosine starts at lr after the warm-up
        (51, 2, True, 0.55),  # halfway through the 98 cosine steps
    ],
)
def test_scheduled_lr(step: int, warmup: int, cosine: bool, expected: float) -> None:
    assert scheduled_lr(step, 1.0, 100, warmup, 0.1, cosine) == pytest.approx(expected)


def test_the_cosine_falls_monotonically_after_the_warm_up() -> None:
    lrs = [scheduled_lr(s, 3e-3, 200, 20, 1e-4) for s in range(220)]
    assert lrs[:20] == sorted(lrs[:20]) and lrs[19] == pytest.approx(3e-3)
    assert all(a >= b for a, b in itertools.pairwise(lrs[20:]))
    assert min(lrs) == pytest.approx(1e-4) and all(lr > 0 for lr in lrs)


@pytest.mark.timeout(20)
def test_the_daemons_pace_sleeps_out_the_floor_and_a_stop_cuts_it_short() -> None:
    stop = StopFlag()
    t0 = time.perf_counter()
    _pace(t0, 0.05, stop)
    assert time.perf_counter() - t0 >= 0.05 * 0.99  # the rest of the floor was slept out
    t1 = time.perf_counter()
    _pace(t1 - 1.0, 0.05, stop)  # a step that already took longer than the floor: no sleep at all
    threading.Timer(0.05, stop.event.set).start()
    _pace(time.perf_counter(), 30.0, stop)  # returns once the stop is set (else: this test's timeout)
    assert stop.event.is_set()
