"""The sync object where PyTorch expects an optimizer (issue 13, deliver 4): LR schedulers, GradScaler and
gradient accumulation act on it as on the user's optimizer, and an fp16 overflow on one member leaves every
member on the same step and round ids. In-process members (`dreamp2p.sync.comm.inprocess`), one thread each."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from test_strategy_logic import batch, config, digest, each, make_model, members
from torch import nn

from dreamp2p.sync.comm.inprocess import InProcessHub
from dreamp2p.sync.strategies.base import Strategy
from dreamp2p.sync.strategies.registry import strategy_class

SCHEDULERS: dict[str, Callable[[torch.optim.Optimizer], Any]] = {
    "lambda": lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s)),
    "cosine": lambda opt: torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=5),
    "warmup+cosine": lambda opt: torch.optim.lr_scheduler.SequentialLR(
        opt,
        [
            torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.1, total_iters=2),
            torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=4),
        ],
        milestones=[2],
    ),
    "onecycle": lambda opt: torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.2, total_steps=8),
}


def sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def test_a_strategy_is_an_optimizer_over_the_users_groups() -> None:
    model = make_model()
    opt = sgd(model)
    sync = strategy_class("localsgd")(model, opt, InProcessHub(1).member(0), config("localsgd"))
    assert isinstance(sync, torch.optim.Optimizer)
    # the same objects, not copies: a change through the strategy is a change of the inner optimizer
    assert sync.param_groups is opt.param_groups
    assert sync.state is opt.state
    assert sync.defaults is opt.defaults
    sync.param_groups[0]["lr"] = 0.5
    assert opt.param_groups[0]["lr"] == 0.5
    with pytest.raises(NotImplementedError):
        sync.add_param_group({"params": [nn.Parameter(torch.zeros(1))]})


@pytest.mark.parametrize("kind", sorted(SCHEDULERS))
def test_a_scheduler_on_the_sync_object_drives_the_inner_optimizer(kind: str) -> None:
    """Training through the strategy ``none`` with a scheduler on it equals plain training with the same
    scheduler on the optimizer, bit for bit: the scheduled rates are the ones the inner step applied."""
    steps = 8

    def run(through_sync: bool) -> tuple[list[float], bytes]:
        model = make_model()
        opt = sgd(model)
        sync = strategy_class("none")(model, opt, InProcessHub(1).member(0), config("none")) if through_sync else None
        target: Any = sync if sync is not None else opt
        sched = SCHEDULERS[kind](target)
        lrs = []
        for step in range(steps):
            x, y = batch(0, step)
            nn.functional.mse_loss(model(x), y).backward()
            target.step()
            target.zero_grad()
            lrs.append(opt.param_groups[0]["lr"])
            sched.step()
        return lrs, b"".join(p.detach().numpy().tobytes() for p in model.parameters())

    with warnings.catch_warnings():
        # torch warns when scheduler.step() seems to run before optimizer.step(): it must see our step
        warnings.simplefilter("error", UserWarning)
        lrs, params = run(through_sync=True)
    ref_lrs, ref_params = run(through_sync=False)
    assert lrs == ref_lrs
    assert len(set(lrs)) > 1  # the schedule really moved the rate
    assert params == ref_params


def test_learning_rate_zero_from_a_scheduler_stops_local_updates() -> None:
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sync = strategy_class("localsgd")(model, opt, InProcessHub(1).member(0), config("localsgd", period=100))
    sched = torch.optim.lr_scheduler.LambdaLR(sync, lambda s: 1.0 if s < 2 else 0.0)
    moved = []
    for step in range(4):
        before = digest(sync)
        x, y = batch(0, step)
        nn.functional.mse_loss(model(x), y).backward()
        sync.step()
        sync.zero_grad()
        sched.step()
        moved.append(digest(sync) != before)
    assert moved == [True, True, False, False]


def amp_train(
    strategy: str,
    steps: int,
    quiet_from: int,
    overflow: tuple[int, int] | None,
    accumulate: int = 1,
    clip: float | None = None,
    **kw: Any,
) -> tuple[list[Strategy], list[torch.amp.GradScaler], InProcessHub]:
    """Two members under a CPU GradScaler; member ``overflow[0]`` gets an Inf gradient at step ``overflow[1]``.

    From ``quiet_from`` on the learning rate is 0, so only averaging moves the parameters (the daemon's quiet
    stretch): the replicas must then agree. ``clip``: unscale first (``scaler.unscale_``) and clip the norm.
    """
    hub = InProcessHub(2)
    strategies = members(hub, config(strategy, **{"period": 4, "warmup_steps": 2, **kw}))
    scalers = [torch.amp.GradScaler("cpu", init_scale=2.0**10) for _ in strategies]

    def run(rank: int, sync: Strategy) -> None:
        scaler = scalers[rank]
        for step in range(steps):
            if step == quiet_from:
                for group in sync.param_groups:
                    group["lr"] = 0.0
            for micro in range(accumulate):
                x, y = batch(rank, step * accumulate + micro)
                loss = nn.functional.mse_loss(sync.model(x), y) / accumulate
                scaler.scale(loss).backward()
            if overflow == (rank, step):
                next(iter(sync.model.parameters())).grad.view(-1)[0] = float("inf")  # type: ignore[union-attr]
            if clip is not None:
                scaler.unscale_(sync)
                nn.utils.clip_grad_norm_(sync.model.parameters(), clip)
            scaler.step(sync)
            scaler.update()
            sync.zero_grad()

    each(strategies, run)
    return strategies, scalers, hub


@pytest.mark.parametrize("strategy", ["localsgd", "diloco", "streaming", "co2", "dreamddp"])
def test_an_overflow_on_one_member_skips_its_local_update_not_its_step(strategy: str) -> None:
    # streaming keeps half of each replica's own weights at a landing unless mix_alpha = 0
    kw: dict[str, Any] = {"mix_alpha": 0.0} if strategy == "streaming" else {}
    strategies, scalers, hub = amp_train(strategy, steps=16, quiet_from=8, overflow=(1, 3), **kw)
    # every member took every step and every round (the hub would have left a round waiting otherwise)
    assert [s.step_count for s in strategies] == [16, 16]
    assert hub._pending == {}
    assert not [r for r in hub.rounds if r.failed]
    assert [s.amp_steps_skipped for s in strategies] == [0, 1]
    assert scalers[1].get_scale() < scalers[0].get_scale()  # only the overflowing member lowered its scale
    assert all(torch.isfinite(p).all() for s in strategies for p in s.model.parameters())
    # after the quiet stretch, the replicas agree
    assert digest(strategies[0]) == digest(strategies[1])


@pytest.mark.parametrize("strategy", ["localsgd", "dreamddp"])
def test_unscale_and_clip_before_the_step_under_an_overflow(strategy: str) -> None:
    """``scaler.unscale_(sync)`` then clipping, then ``scaler.step(sync)``: unscaled once, same outcome."""
    strategies, _, hub = amp_train(strategy, steps=16, quiet_from=8, overflow=(0, 5), clip=0.5)
    assert [s.step_count for s in strategies] == [16, 16]
    assert [s.amp_steps_skipped for s in strategies] == [1, 0]
    assert not [r for r in hub.rounds if r.failed]
    assert digest(strategies[0]) == digest(strategies[1])


def test_unscale_first_unscales_once() -> None:
    """``unscale_`` before ``step`` (a clip that never bites) trains as the step's own unscaling does: the
    gradients are not divided by the scale a second time."""
    amp, _, _ = amp_train("none", steps=4, quiet_from=4, overflow=None, clip=1e9)
    plain, _, _ = amp_train("none", steps=4, quiet_from=4, overflow=None)
    for a, p in zip(amp, plain, strict=True):
        for pa, pp in zip(a.model.parameters(), p.model.parameters(), strict=True):
            torch.testing.assert_close(pa, pp, rtol=1e-5, atol=1e-6)


def test_ssgd_overflow_on_one_member_takes_the_others_mean_everywhere() -> None:
    """S-SGD averages gradients: the overflowing member's are left out (the contribution guard), and every
    member applies the same mean, so the replicas agree after every step with no quiet stretch at all."""
    strategies, _, hub = amp_train("ssgd", steps=6, quiet_from=6, overflow=(0, 2))
    assert [s.step_count for s in strategies] == [6, 6]
    assert [s.amp_steps_skipped for s in strategies] == [0, 0]
    assert not [r for r in hub.rounds if r.failed]
    assert digest(strategies[0]) == digest(strategies[1])
    assert all(torch.isfinite(p).all() for s in strategies for p in s.model.parameters())


def test_amp_without_overflow_matches_fp32_training() -> None:
    """A GradScaler that never overflows changes nothing: the step unscales what the scaler scaled."""
    amp, _, _ = amp_train("localsgd", steps=6, quiet_from=6, overflow=None)
    hub = InProcessHub(2)
    plain = members(hub, config("localsgd", period=4, warmup_steps=2))

    def run(rank: int, sync: Strategy) -> None:
        for step in range(6):
            x, y = batch(rank, step)
            nn.functional.mse_loss(sync.model(x), y).backward()
            sync.step()
            sync.zero_grad()

    each(plain, run)
    for a, p in zip(amp, plain, strict=True):
        for pa, pp in zip(a.model.parameters(), p.model.parameters(), strict=True):
            torch.testing.assert_close(pa, pp, rtol=1e-5, atol=1e-6)


def test_gradient_accumulation_equals_the_whole_batch() -> None:
    """Two backward passes over halves of a batch, then one sync step: the step of the whole batch."""

    def run(accumulate: int) -> bytes:
        model = make_model()
        sync = strategy_class("none")(model, sgd(model), InProcessHub(1).member(0), config("none"))
        for step in range(4):
            x, y = batch(0, step)
            for xs, ys in zip(x.chunk(accumulate), y.chunk(accumulate), strict=True):
                (nn.functional.mse_loss(model(xs), ys) / accumulate).backward()
            sync.step()
            sync.zero_grad()
        return b"".join(p.detach().numpy().tobytes() for p in model.parameters())

    whole = torch.tensor(bytearray(run(1))).view(torch.float32)
    halves = torch.tensor(bytearray(run(2))).view(torch.float32)
    torch.testing.assert_close(halves, whole, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("strategy", ["ssgd", "dreamddp"])
def test_gradient_accumulation_launches_each_round_once_per_step(strategy: str) -> None:
    """DreamDDP launches syncs from gradient hooks, which fire on every backward pass: with three passes per
    step it still launches the same rounds as with one, and the replicas agree after flush().
    (A warm-up longer than the run keeps DreamDDP on its first plan, whose syncs land up to 3 steps late;
    later plans would follow measured timings. That plan's sparse syncs leave their unsent parts in each
    replica, so the quiet stretch alone does not make them agree.)"""

    def rounds(accumulate: int) -> tuple[list[tuple[int, int]], list[Strategy]]:
        strategies, _, hub = amp_train(
            strategy, steps=20, quiet_from=8, overflow=None, accumulate=accumulate, warmup_steps=100
        )
        assert [s.step_count for s in strategies] == [20, 20]
        return sorted((r.group_id, r.round_id) for r in hub.rounds), strategies

    once, _ = rounds(1)
    thrice, strategies = rounds(3)
    assert thrice == once
    each(strategies, lambda rank, s: s.flush())
    assert digest(strategies[0]) == digest(strategies[1])
