"""A ``torch.compile``d model trains under dreamp2p without graph breaks caused by dreamp2p (issue 13,
deliver 4): DreamDDP's profiler hooks sit on every layer while it profiles, inside the compiled region.
CPU, ``backend="aot_eager"``, a tiny model and three steps (compiling is slow on two cores)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any, cast

import pytest
import torch
import torch._dynamo
from test_strategy_logic import batch, config, make_model
from torch import nn

from dreamp2p.node import unwrap
from dreamp2p.sync.comm.inprocess import InProcessHub
from dreamp2p.sync.strategies.dreamddp import DreamDDP


@pytest.fixture
def fresh_dynamo() -> Iterator[Any]:
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    yield torch._dynamo.utils.counters
    torch._dynamo.reset()


def graph_breaks(counters: Any) -> int:
    return sum(counters["graph_break"].values())


def train(model: nn.Module, steps: int = 3) -> DreamDDP:
    compiled = cast(nn.Module, torch.compile(model, backend="aot_eager"))
    inner = unwrap(compiled)
    assert inner is model  # the strategy holds the module itself: no "_orig_mod." in manifests or checkpoints
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    # a warm-up longer than the run: the profiler's hooks stay on every layer for all of it
    sync = DreamDDP(inner, opt, InProcessHub(1).member(0), config("dreamddp", warmup_steps=10))
    assert sync.profiler.active
    for step in range(steps):
        x, y = batch(0, step)
        nn.functional.mse_loss(compiled(x), y).backward()
        sync.step()
        sync.zero_grad()
    return sync


@pytest.mark.timeout(300)
def test_compiled_model_trains_without_graph_breaks(fresh_dynamo: Any) -> None:
    model = make_model()
    before = [p.detach().clone() for p in model.parameters()]
    sync = train(model)
    assert graph_breaks(fresh_dynamo) == 0, dict(fresh_dynamo["graph_break"])
    assert fresh_dynamo["stats"]["unique_graphs"] >= 1  # it really compiled
    assert sync.step_count == 3
    assert any(not torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))
    # backward is still profiled: the gradient hooks run outside the compiled graph
    assert sync.profiler.steps == 2  # the first step is skipped as unrepresentative
    assert any(c.bwd_s > 0 for c in sync.profiler.costs())
    assert not any(k.startswith("_orig_mod") for k in sync.state_dict()["model"])


@pytest.mark.timeout(300)
def test_a_timing_hook_in_the_compiled_region_is_counted(fresh_dynamo: Any) -> None:
    """The counter this file relies on sees the graph break a naive timing hook causes."""
    model = make_model()

    def clock(*_: Any) -> None:
        time.perf_counter()

    next(iter(model.children())).register_forward_hook(clock)
    train(model, steps=1)
    assert graph_breaks(fresh_dynamo) > 0
