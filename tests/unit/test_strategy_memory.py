"""The strategies' host memory: one-buffer groups, the global copy shared with the outer optimizer, the
gradient lent to it, CO2's launch snapshot not copied, each bit-identical to what the copies computed; and
`Strategy.held`, which names every buffer a strategy keeps (found by walking its attributes) and none of the
model's, with each strategy's bytes per parameter at steady state."""

from __future__ import annotations

import concurrent.futures
import copy
from collections.abc import Iterable
from typing import Any

import pytest
import torch
from torch import nn

from dreamp2p.config.sync import STRATEGIES, SyncConfig
from dreamp2p.sync.comm.inprocess import InProcessHub
from dreamp2p.sync.model.groups import GROUP_PARAMS
from dreamp2p.sync.model.layers import FlatGroup
from dreamp2p.sync.strategies.base import Strategy
from dreamp2p.sync.strategies.registry import strategy_class


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))


def loss_backward(model: nn.Module, rank: int, step: int) -> None:
    g = torch.Generator().manual_seed(1000 * rank + step)
    x = torch.randn(8, 6, generator=g)
    nn.functional.mse_loss(model(x), torch.sin(x[:, :3]) + 0.1 * rank).backward()


def members(world: int, cfg: SyncConfig) -> list[Strategy]:
    hub = InProcessHub(world)
    out = []
    for rank in range(world):
        model = make_model()
        out.append(
            strategy_class(cfg.strategy)(model, torch.optim.AdamW(model.parameters(), lr=1e-2), hub.member(rank), cfg)
        )
    return out


def train(strategies: list[Strategy], steps: int) -> None:
    def run(rank: int, s: Strategy) -> None:
        for _ in range(steps):
            loss_backward(s.model, rank, s.step_count)
            s.step()
            s.zero_grad()

    with concurrent.futures.ThreadPoolExecutor(len(strategies)) as pool:
        list(pool.map(run, range(len(strategies)), strategies))


def flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def test_a_one_buffer_group_is_averaged_in_place_and_refuses_a_merge() -> None:
    hub = InProcessHub(2)
    groups = [FlatGroup([torch.full((3, 2), float(rank + 1))], one_buffer=True) for rank in range(2)]
    assert all(g.snap is g.work and g.buffers == (g.work,) for g in groups)
    assert len(FlatGroup([torch.zeros(4)]).buffers) == 2
    futs = []
    for rank, g in enumerate(groups):
        g.snapshot()
        futs.append(hub.member(rank).allreduce_group(g, GROUP_PARAMS, "fp32", round_id=1))
    for g, fut in zip(groups, futs, strict=True):
        fut.result(5)
        assert torch.equal(g.work, torch.full((6,), 1.5))
    with pytest.raises(RuntimeError, match="one-buffer"):
        groups[0].merge()


def test_diloco_outer_step_is_nesterov_sgd_on_the_global_copy_with_the_pseudo_gradient() -> None:
    """One member: the mean pseudo-gradient is its own, so a period ends exactly as torch's Nesterov SGD over a
    copy of the starting parameters, with global - local as the gradient, leaves them (bit for bit)."""
    (s,) = members(1, SyncConfig(strategy="diloco", period=2))
    ref = make_model()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    start = flat(ref).clone()
    for step in range(2):
        loss_backward(ref, 0, step)
        ref_opt.step()
        ref_opt.zero_grad()
    shadow = nn.Parameter(start.clone())
    shadow.grad = start - flat(ref)
    outer = torch.optim.SGD([shadow], lr=0.7, momentum=0.9, nesterov=True)
    outer.step()
    train([s], 2)
    assert torch.equal(flat(s.model).view(torch.int32), shadow.detach().view(torch.int32))
    glob, momentum = s.outer_state()  # type: ignore[attr-defined]
    assert torch.equal(glob, shadow.detach())
    assert torch.equal(momentum, outer.state[shadow]["momentum_buffer"])


@pytest.mark.parametrize("strategy", ["co2", "streaming"])
def test_state_taken_with_a_round_in_flight_continues_bit_identically(strategy: str) -> None:
    """A joiner's state is taken between two steps, rounds in flight (CO2's launch snapshot, a Streaming
    fragment's mean): loaded into fresh members it continues the same trajectory."""
    cfg = SyncConfig(strategy=strategy, period=3, stream_delay=2)
    straight = members(2, cfg)
    train(straight, 4)  # CO2: the round launched at step 3 lands at step 6; Streaming: a fragment travels
    # copies, as a transfer or a checkpoint makes (a state dict holds the live optimizer state itself)
    saved: list[dict[str, Any]] = [copy.deepcopy(s.state_dict()) for s in straight]
    assert all("pending" in st["extra"] or st["extra"].get("inflight") for st in saved)
    resumed = members(2, cfg)
    for s, st in zip(resumed, saved, strict=True):
        s.load_state_dict(st)
    train(straight, 5)
    train(resumed, 5)
    for a, b in zip(straight, resumed, strict=True):
        assert torch.equal(flat(a.model), flat(b.model))
        assert a.outer_digest() == b.outer_digest()  # type: ignore[attr-defined]


# --- what Strategy.held names ------------------------------------------------------------------------------

SMALL = 1024  # bytes: rounds of a fixed few elements (checks, control rounds, CO2's gap) are not listed


def wide_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 8))


def storages(tensors: Iterable[torch.Tensor]) -> dict[int, int]:
    """Storage address -> bytes, each storage once (views and aliases included)."""
    return {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}


def reachable(obj: object, skip: set[int], out: dict[int, int], seen: set[int] | None = None) -> dict[int, int]:
    """Every storage reachable from ``obj`` through attributes of dreamp2p objects, containers and the outer
    optimizers' state; ``skip`` (ids) not entered: the model, the user's optimizer, the collective."""
    seen = set() if seen is None else seen
    if id(obj) in seen or id(obj) in skip or isinstance(obj, nn.Module):
        return out
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        out.update(storages([obj]))
    elif isinstance(obj, dict):
        for value in obj.values():
            reachable(value, skip, out, seen)
    elif isinstance(obj, list | tuple | set):
        for value in obj:
            reachable(value, skip, out, seen)
    elif isinstance(obj, torch.optim.Optimizer) and not isinstance(obj, Strategy):
        reachable([obj.state, [g["params"] for g in obj.param_groups]], skip, out, seen)
    elif type(obj).__module__.startswith("dreamp2p") and hasattr(obj, "__dict__"):
        reachable(list(vars(obj).values()), skip, out, seen)
    return out


def attached(strategy: str, steps: int) -> tuple[Strategy, int]:
    """One member of ``strategy`` on `wide_model` after ``steps`` steps (period 4), and its parameter count."""
    model = wide_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    cfg = SyncConfig(strategy=strategy, period=4, warmup_steps=2, control_every=4)
    s = strategy_class(strategy)(model, opt, InProcessHub(1).member(0), cfg)
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        nn.functional.mse_loss(model(torch.randn(8, 32, generator=g)), torch.zeros(8, 8)).backward()
        s.step()
        s.zero_grad()
    return s, sum(p.numel() for p in model.parameters())


def model_side(s: Strategy) -> dict[int, int]:
    """The storages of the model, its gradients and the user's optimizer state."""
    params = list(s.model.parameters())
    grads = [p.grad for p in params if p.grad is not None]
    state = [t for st in s.optimizer.state.values() for t in st.values() if isinstance(t, torch.Tensor)]
    return storages([*params, *grads, *state, *s.model.buffers()])


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_held_names_every_buffer_the_strategy_keeps_and_none_of_the_models(strategy: str) -> None:
    s, _ = attached(strategy, 10)
    mine = model_side(s)
    held = storages(t for h in s.held() for t in h.tensors)
    found = reachable(s, {id(s.comm), id(s.optimizer), id(s.model)}, {})
    kept = {ptr for ptr, nbytes in found.items() if ptr not in mine and nbytes >= SMALL}
    assert kept <= held.keys(), "buffers the strategy keeps that held() does not name"
    assert not held.keys() & mine.keys()
    assert all(h.name and h.why for h in s.held())


@pytest.mark.parametrize(
    ("strategy", "per_param"),
    [
        ("none", 0),
        ("ssgd", 4),  # the gradients, averaged in place
        ("localsgd", 8),  # snapshot + mean
        ("diloco", 12),  # pseudo-gradient + global copy + outer momentum (AdamW inner: Nesterov 0.7/0.9)
        ("streaming", 12),  # the same per fragment
        ("co2", 16),  # snapshot + mean + outer parameters + outer momentum
        # theta + momentum; a sync's snapshot and mean only while it travels (in a ring of one every sync lands
        # in the step that launched it)
        ("dreamddp", 8),
    ],
)
def test_held_bytes_per_parameter_at_steady_state(strategy: str, per_param: int) -> None:
    s, n = attached(strategy, 13)  # past DreamDDP's first measured plan (adopted at step 8)
    assert sum(storages(t for h in s.held() for t in h.tensors).values()) == per_param * n
