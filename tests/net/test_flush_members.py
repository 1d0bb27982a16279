"""``flush()`` among real nodes on loopback (issue 40, item 1): every parameter (frozen ones the user updates
in place included) and buffer ends bit-identical, and a flush that cannot reach every member that trained with
us raises FlushIncomplete instead of returning as if it had averaged."""

from __future__ import annotations

import threading

import pytest
import torch
from conftest import SYNC_STRATEGIES
from test_commproc import on_threads, ring_of
from torch import nn

from dreamp2p.errors import FlushIncomplete
from dreamp2p.node import Node

SYNC = {"period": 4, "warmup_steps": 2, "control_every": 4}


class WithState(nn.Module):
    """A small net plus an EMA kept as a frozen parameter, updated in place by the user's loop."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.body = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))
        self.ema = nn.Parameter(torch.zeros(16, 8), requires_grad=False)
        self.register_buffer("seen", torch.zeros(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.body(x)
        return out


def step(s: object, m: WithState, rank: int, n: int) -> None:
    for _ in range(n):
        x = torch.randn(16, 8, generator=torch.Generator().manual_seed(1000 * rank + s.step_count))  # type: ignore[attr-defined]
        nn.functional.mse_loss(m(x), x[:, :2]).backward()
        s.step()  # type: ignore[attr-defined]
        s.zero_grad()  # type: ignore[attr-defined]
        with torch.no_grad():
            m.ema.mul_(0.5).add_(m.body[0].weight, alpha=rank + 1.0)  # type: ignore[arg-type]
            m.seen.add_(rank + 1.0)


def state(m: nn.Module) -> list[torch.Tensor]:
    return [t.detach().clone() for _, t in sorted(m.state_dict().items())]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy", SYNC_STRATEGIES)
def test_flush_averages_user_state_and_refuses_to_pass_for_whole_without_every_member(strategy: str) -> None:
    configs, ring = ring_of(("thread", "thread", "thread"))
    nodes = [Node(c) for c in configs]
    models = [WithState(i) for i in range(3)]
    flushed = threading.Barrier(3)
    stepped = threading.Barrier(3)
    gone = threading.Barrier(3)
    try:
        on_threads(lambda i: nodes[i].connect(ring), 3)

        def run(i: int) -> tuple[list[torch.Tensor], BaseException | None]:
            opt = torch.optim.SGD(models[i].body.parameters(), lr=0.05)
            s = nodes[i].attach(models[i], opt, strategy=strategy, **SYNC)
            step(s, models[i], i, 6)
            s.flush()  # all three: every tensor averaged, the frozen one too
            after = state(models[i])
            flushed.wait()
            step(s, models[i], i, 4)  # the replicas part again
            # nobody leaves before every member stepped: a round member 2 launched after the others left
            # would land among it alone, and a flush among the members of that round is whole
            stepped.wait()
            if i < 2:
                nodes[i].close()  # leave without the second flush
                gone.wait()
                return after, None
            gone.wait()
            try:
                s.flush()
            except FlushIncomplete as exc:
                return after, exc
            return after, None

        results = on_threads(run, 3)
    finally:
        for n in nodes:
            n.close()
    first = [r[0] for r in results]
    for tensors in first[1:]:
        assert all(torch.equal(a, b) for a, b in zip(first[0], tensors, strict=True))
    assert float(models[0].ema.abs().sum()) > 0
    err = results[2][1]
    assert isinstance(err, FlushIncomplete), f"the lone member's flush returned as if it had averaged: {err!r}"
    assert err.missing == ("n0", "n1") and err.averaged == ("n2",)
