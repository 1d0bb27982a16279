"""The daemon's training step (dreamp2p.service.recipe), in process: accumulation, clipping, AMP, the LR schedule,
the quiet stretch, fp16 overflow, data positions and what a resume or a join restores."""

from __future__ import annotations

import concurrent.futures
import sys
import threading
import types
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dreamp2p.config import DaemonConfig, SyncConfig, TrainConfig
from dreamp2p.config.train import scheduled_lr
from dreamp2p.service.recipe import Batches, Recipe, Training, make_training, task_recipe, total_norm
from dreamp2p.sync.comm.inprocess import InProcessHub
from dreamp2p.sync.strategies.registry import strategy_class


class FakeSync:
    """A strategy stand-in: records the gradients and learning rates its step() sees, then steps the optimizer."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self.step_count = 0
        self.grads: list[list[torch.Tensor]] = []
        self.lrs: list[float] = []

    def step(self) -> str:
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        self.grads.append([p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in params])
        self.lrs.append(float(self.optimizer.param_groups[0]["lr"]))
        self.optimizer.step()
        self.step_count += 1
        return "stats"

    def zero_grad(self) -> None:
        self.optimizer.zero_grad()


# the same initial parameters on every member, also when members are built on threads at once
_INIT = threading.Lock()


def data(seed: int = 0, n: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    return x, x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]]) + 0.3


def mse(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return nn.functional.mse_loss(model(x), y)


def model() -> nn.Module:
    with _INIT:  # members built on threads share torch's global RNG: one seeded init at a time
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))


def recipe(data_source: Any, lr: float = 0.05, **kw: Any) -> Recipe:
    m = model()
    return Recipe(m, torch.optim.SGD(m.parameters(), lr=lr), mse, data_source, **kw)


def run(training: Training, sync: Any, steps: int, start: int = 0) -> list[float]:
    out = []
    for step in range(start, start + steps):
        out.append(training.step(sync, step).loss)
        sync.zero_grad()
    return out


def test_accumulation_sums_micro_batches_into_the_whole_batchs_gradient() -> None:
    x, y = data()
    halves = [(x[:32], y[:32]), (x[32:], y[32:])]
    training = Training(recipe(lambda start: iter(halves[start % 2 :] + halves)), TrainConfig(accumulation=2))
    sync = FakeSync(training.optimizer)
    result = training.step(sync, 0)
    whole = model()
    mse(whole, (x, y)).backward()
    for got, p in zip(sync.grads[0], whole.parameters(), strict=True):
        assert p.grad is not None and torch.allclose(got, p.grad, atol=1e-6)
    assert result.loss == pytest.approx(float(mse(model(), (x, y)).detach()), rel=1e-5)
    assert training.batches.position == 2


@pytest.mark.parametrize("clip", [0.01, 0.1])
def test_clipping_bounds_the_global_norm_the_optimizer_sees(clip: float) -> None:
    batch = data()
    free = Training(recipe(lambda start: iter([batch])), TrainConfig())
    free_sync = FakeSync(free.optimizer)
    free.step(free_sync, 0)
    clipped = Training(recipe(lambda start: iter([batch])), TrainConfig(grad_clip=clip))
    sync = FakeSync(clipped.optimizer)
    clipped.step(sync, 0)
    assert float(total_norm(free_sync.grads[0])) > clip * 10  # clipping really acted
    assert float(total_norm(sync.grads[0])) == pytest.approx(clip, rel=1e-4)


def test_bf16_autocast_runs_on_the_cpu_and_the_loss_falls() -> None:
    dtypes: list[torch.dtype] = []

    def loss(m: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        out = m(batch[0])
        dtypes.append(out.dtype)
        return nn.functional.mse_loss(out.float(), batch[1])

    batch = data()
    m = model()
    training = Training(
        Recipe(m, torch.optim.SGD(m.parameters(), lr=0.05), loss, lambda s: iter(lambda: batch, None)),
        TrainConfig(amp="bf16", accumulation=2, grad_clip=5.0),
    )
    losses = run(training, FakeSync(training.optimizer), 30)
    assert set(dtypes) == {torch.bfloat16}
    assert all(p.dtype == torch.float32 for p in m.parameters())  # autocast, not a bf16 model
    assert losses[-1] < 0.5 * losses[0]


def test_fp16_is_refused_on_the_cpu() -> None:
    with pytest.raises(ValueError, match=r"train\.amp = 'fp16' needs CUDA"):
        Training(recipe(lambda s: iter([data()])), TrainConfig(amp="fp16"), "cpu")


def test_an_fp16_overflow_zeroes_the_gradients_and_still_advances_the_sync() -> None:
    """The GradScaler path (CUDA in the daemon; a CPU scaler here): a step that overflows moves nothing."""
    x, y = data()
    training = Training(recipe(lambda s: iter(lambda: (1e3 * x, y), None)), TrainConfig())
    training.scaler = torch.amp.GradScaler("cpu", init_scale=3e38)  # any real gradient overflows fp32
    before = [p.detach().clone() for p in training.model.parameters()]
    sync = FakeSync(training.optimizer)
    result = training.step(sync, 0)
    assert result.overflowed and training.overflows == 1
    assert sync.step_count == 1  # the strategy stepped: every member counts the same steps
    assert all(float(g.abs().sum()) == 0 for g in sync.grads[0])
    assert all(torch.equal(a, b) for a, b in zip(before, training.model.parameters(), strict=True))
    assert training.scaler.get_scale() < 3e38  # the scaler backed off
    assert "scaler" in training.state()


def test_fp16_scaled_gradients_are_unscaled_before_the_optimizer() -> None:
    batch = data()
    plain = Training(recipe(lambda s: iter([batch])), TrainConfig())
    plain_sync = FakeSync(plain.optimizer)
    plain.step(plain_sync, 0)
    scaled = Training(recipe(lambda s: iter([batch])), TrainConfig())
    scaled.scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    sync = FakeSync(scaled.optimizer)
    assert not scaled.step(sync, 0).overflowed
    for got, want in zip(sync.grads[0], plain_sync.grads[0], strict=True):
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("strategy", ["none", "localsgd", "ssgd"])
def test_a_grad_scaler_overflow_on_one_member_keeps_every_members_step_count(strategy: str) -> None:
    """Through a real strategy (scaler.step(sync) where the strategy supports it, else the daemon's fallback)."""
    hub = InProcessHub(2)
    cfg = SyncConfig(strategy=strategy, period=2)

    def member(rank: int) -> tuple[Training, Any, list[torch.Tensor], list[torch.Tensor]]:
        x, y = data(rank)

        def batches(start: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
            # member 0's first batch overflows any fp32 gradient under the scale
            return ((x, y * (1e36 if rank == 0 and i == 0 else 1.0)) for i in range(start, 10**9))

        training = Training(recipe(batches), TrainConfig(grad_clip=10.0))
        training.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
        sync = strategy_class(strategy)(training.model, training.optimizer, hub.member(rank), cfg)
        before = [p.detach().clone() for p in training.model.parameters()]
        training.step(sync, 0)
        sync.zero_grad()
        after = [p.detach().clone() for p in training.model.parameters()]
        run(training, sync, 3, start=1)
        return training, sync, before, after

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        results = list(pool.map(member, range(2)))
    assert [t.overflows for t, *_ in results] == [1, 0]
    assert [s.step_count for _, s, *_ in results] == [4, 4]
    scales = [t.scaler.get_scale() for t, *_ in results if t.scaler is not None]
    assert scales[0] < scales[1]  # only the member that overflowed backed off
    if strategy == "none":  # no averaging: the overflowing member's parameters did not move in that step
        _, _, before, after = results[0]
        assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    if strategy == "ssgd":
        a, b = (torch.cat([p.detach().flatten() for p in s.model.parameters()]) for _, s, *_ in results)
        assert torch.equal(a, b) and bool(torch.isfinite(a).all())


class TinyTask:
    """A Task (the protocol the embedded task follows) over a fixed regression set."""

    tokens_per_batch = 16

    def __init__(self) -> None:
        self.starts: list[int] = []
        self.x, self.y = data(1, 256)

    def model(self) -> nn.Module:
        return model()

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        i = (step * 16) % 256
        return self.x[i : i + 16], self.y[i : i + 16]

    def loss(self, m: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return mse(m, batch)

    def evaluate(self, m: nn.Module) -> float:
        with torch.no_grad():
            return float(mse(m, (self.x, self.y)))


def daemon_config(**train: Any) -> DaemonConfig:
    return DaemonConfig.from_dict({"node": {"node_id": "a"}, "task": {"lr": 0.1, "steps": 20}, "train": train})


def test_the_embedded_schedule_warms_up_then_follows_the_cosine_and_quiet_steps_run_at_zero() -> None:
    cfg = daemon_config(schedule="cosine", warmup_steps=4, lr_min=0.01)
    training = Training(task_recipe(TinyTask(), cfg), cfg.train)
    assert isinstance(training.optimizer, torch.optim.AdamW) and training.scheduler is not None
    sync = FakeSync(training.optimizer)
    used = []
    for step in range(20):
        used.append(training.step(sync, step, quiet=step in (10, 11)).lr)
        sync.zero_grad()
    expected = [scheduled_lr(s, 0.1, 20, 4, 0.01) for s in range(20)]
    assert sync.lrs == pytest.approx([0.0 if s in (10, 11) else e for s, e in enumerate(expected)])
    assert used == sync.lrs  # the learning rate reported is the one the optimizer stepped with
    # a quiet step did not disturb the schedule: the learning rate between steps is the scheduled one
    assert training.lr == pytest.approx(scheduled_lr(20, 0.1, 20, 4, 0.01))
    assert training.evaluate() is not None and training.tokens_per_step == 16


def test_without_schedule_knobs_the_embedded_optimizer_keeps_its_lr() -> None:
    cfg = daemon_config()
    training = Training(task_recipe(TinyTask(), cfg), cfg.train)
    assert training.scheduler is None
    sync = FakeSync(training.optimizer)
    run(training, sync, 3)
    assert sync.lrs == [0.1, 0.1, 0.1]


@pytest.mark.parametrize("how", ["resume", "join"])
def test_a_resumed_or_joining_node_continues_the_schedule_and_the_data(how: str) -> None:
    """A resume loads the scheduler from the checkpoint; a join moves it to the step (the optimizer came along)."""

    def user_recipe(starts: list[int]) -> Recipe:
        x, y = data(2, 512)

        def batches(start: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
            starts.append(start)
            return ((x[i % 32 * 16 : i % 32 * 16 + 16], y[i % 32 * 16 : i % 32 * 16 + 16]) for i in range(start, 10**9))

        m = model()
        opt = torch.optim.SGD(m.parameters(), lr=0.2, momentum=0.9)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
        return Recipe(m, opt, mse, batches, scheduler=sched)

    whole_starts: list[int] = []
    whole = Training(user_recipe(whole_starts), TrainConfig(accumulation=2))
    whole_sync = FakeSync(whole.optimizer)
    run(whole, whole_sync, 7)
    saved = {"optimizer": whole.optimizer.state_dict(), **whole.state()}
    run(whole, whole_sync, 5, start=7)

    starts: list[int] = []
    again = Training(user_recipe(starts), TrainConfig(accumulation=2))
    again.optimizer.load_state_dict(saved["optimizer"])
    again.restore(7, saved if how == "resume" else None)
    sync = FakeSync(again.optimizer)
    run(again, sync, 5, start=7)
    assert starts == [14]  # batch 7 * accumulation, positioned at once (a data function)
    assert sync.lrs == whole_sync.lrs[7:]
    assert again.scheduler is not None and again.scheduler.last_epoch == 12


def test_an_iterable_is_skipped_to_the_position_across_passes() -> None:
    x, y = data(3, 48)
    loader = DataLoader(TensorDataset(x, y), batch_size=16, shuffle=True, generator=torch.Generator().manual_seed(5))
    reader = Batches(loader)
    continuous = [reader.next()[0] for _ in range(8)]  # 3 batches a pass: crosses two new passes
    # a new process builds the same seeded loader and skips to batch 5
    loader2 = DataLoader(TensorDataset(x, y), batch_size=16, shuffle=True, generator=torch.Generator().manual_seed(5))
    resumed = Batches(loader2)
    resumed.seek(5)
    assert all(torch.equal(resumed.next()[0], continuous[i]) for i in (5, 6, 7))


def test_empty_data_is_an_error() -> None:
    with pytest.raises(RuntimeError, match="yields no batches"):
        Batches([]).next()


def test_an_entry_recipe_with_the_daemons_schedule_knobs_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    module = types.ModuleType("dp2p_test_recipe_entry")

    def make(cfg: Any, rank: int, world: int, device: str) -> Recipe:
        return recipe(lambda s: iter([data()]))

    module.make = make  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, module.__name__, module)
    base = {"node": {"node_id": "a"}, "task": {"entry": "dp2p_test_recipe_entry:make", "steps": 20}}
    training = make_training(DaemonConfig.from_dict(base), 0, 1)
    assert isinstance(training.optimizer, torch.optim.SGD)  # the entry's own
    with pytest.raises(ValueError, match="give the entry's Recipe a scheduler instead"):
        make_training(DaemonConfig.from_dict({**base, "train": {"warmup_steps": 5}}), 0, 1)


@pytest.mark.parametrize("strategy", ["ssgd", "dreamddp"])
def test_accumulation_clipping_and_bf16_through_real_strategies(strategy: str) -> None:
    """Two members on the in-process collective: every knob at once, the loss falls, the steps stay equal."""
    hub = InProcessHub(2)
    cfg = SyncConfig(strategy=strategy, period=4, warmup_steps=2, control_every=4, max_delay=1)
    knobs = TrainConfig(accumulation=3, grad_clip=1.0, amp="bf16")

    def member(rank: int) -> tuple[list[float], Any]:
        x, y = data(10 + rank, 96)
        batches = [(x[i : i + 16], y[i : i + 16]) for i in range(0, 96, 16)]
        r = recipe(lambda s: (batches[i % 6] for i in range(s, 10**9)), lr=0.2)
        training = Training(r, knobs)
        sync = strategy_class(strategy)(training.model, training.optimizer, hub.member(rank), cfg)
        return run(training, sync, 40), sync

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        results = list(pool.map(member, range(2)))
    for losses, sync in results:
        assert sync.step_count == 40
        assert sum(losses[-4:]) < 0.5 * sum(losses[:4]), losses
    if strategy == "ssgd":  # gradients averaged every step: the replicas stay identical
        a, b = (torch.cat([p.detach().flatten() for p in s.model.parameters()]) for _, s in results)
        assert torch.equal(a, b)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="fp16 with a GradScaler needs a CUDA device")
def test_fp16_with_a_grad_scaler_trains_on_cuda() -> None:
    """Not run where this was written (no GPU there): the daemon's fp16 path end to end on one device."""
    strategy = "none"
    hub = InProcessHub(1)
    dtypes: list[torch.dtype] = []

    def loss(m: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        out = m(batch[0])
        dtypes.append(out.dtype)
        return nn.functional.mse_loss(out.float(), batch[1])

    x, y = data()
    m = model().cuda()
    r = Recipe(m, torch.optim.SGD(m.parameters(), lr=0.05), loss, lambda s: iter(lambda: (x, y), None))
    training = Training(r, TrainConfig(amp="fp16", grad_clip=5.0, accumulation=2), "cuda")
    sync = strategy_class(strategy)(m, training.optimizer, hub.member(0), SyncConfig(strategy=strategy, period=4))
    losses = run(training, sync, 40)
    assert set(dtypes) == {torch.float16} and sync.step_count == 40
    assert losses[-1] < 0.5 * losses[0]
    assert training.state()["scaler"]["scale"] > 0
