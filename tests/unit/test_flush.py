"""``flush()`` against the in-process collective: every parameter, frozen ones included, and every buffer end
bit-identical on every member, whatever changed them, for every strategy (issue 40, item 1)."""

from __future__ import annotations

import concurrent.futures
import hashlib

import pytest
import torch
from torch import nn

from dreamp2p.config.sync import SyncConfig
from dreamp2p.sync.base import Strategy
from dreamp2p.sync.inprocess import InProcessHub
from dreamp2p.sync.registry import strategy_class

# every strategy that averages anything; dreamddp's plan needs measured links, which the hub gives
STRATEGIES = ["ssgd", "localsgd", "diloco", "streaming", "co2", "dreamddp"]


class WithState(nn.Module):
    """A small net plus the state users keep beside it: an EMA held as a frozen parameter, updated in place
    by the user, and a running statistic held as a buffer."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
        self.ema = nn.Parameter(torch.zeros(16, 6), requires_grad=False)
        self.register_buffer("seen", torch.zeros(3))
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.body(x)
        return out


def digest(model: nn.Module) -> str:
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def local_step(s: Strategy, model: WithState, rank: int) -> None:
    g = torch.Generator().manual_seed(1000 * rank + s.step_count)
    x = torch.randn(8, 6, generator=g)
    nn.functional.mse_loss(model(x), torch.sin(x[:, :3])).backward()
    s.step()
    s.zero_grad()
    with torch.no_grad():  # the user's own in-place updates, different on every rank
        first: torch.Tensor = model.body[0].weight  # type: ignore[assignment]
        model.ema.mul_(0.9).add_(first, alpha=0.1 * (rank + 1))
        model.seen.add_(float(rank + 1))
        model.calls.add_(rank + 1)


def run(strategy: str, steps: int) -> list[WithState]:
    hub = InProcessHub(3, goodput_Bps=50e6, rtt_s=0.001)
    cfg = SyncConfig(strategy=strategy, period=4, max_delay=2, warmup_steps=2, control_every=4)
    models = [WithState() for _ in range(3)]
    syncs = [
        strategy_class(strategy)(m, torch.optim.SGD(m.body.parameters(), lr=0.05), hub.member(r), cfg)
        for r, m in enumerate(models)
    ]

    def train(rank: int) -> None:
        for _ in range(steps):
            local_step(syncs[rank], models[rank], rank)
        syncs[rank].flush()

    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        list(pool.map(train, range(3)))
    return models


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_flush_leaves_frozen_parameters_and_buffers_identical(strategy: str) -> None:
    models = run(strategy, 10)
    assert len({float(m.ema.abs().sum()) for m in models}) == 1
    assert float(models[0].ema.abs().sum()) > 0  # it moved, so equality says something
    assert len({digest(m) for m in models}) == 1  # the whole state, bit for bit
    # the buffers hold the mean of the members' own values (each rank added r + 1 per step), not rank 0's
    assert torch.equal(models[0].seen, torch.full((3,), 2.0 * 10))
    assert int(models[0].calls) == 20
