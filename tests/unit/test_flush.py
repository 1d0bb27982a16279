"""``flush()`` and attach's broadcast against the in-process collective: every parameter, frozen ones included,
and every buffer end bit-identical on every member, whatever changed them, for every strategy (issue 40,
item 1); state the members already share does not cross the network again, and DreamDDP's flush sends its
pseudo-gradients compressed (issue 34, item 3)."""

from __future__ import annotations

import concurrent.futures
import hashlib

import pytest
import torch
from torch import nn

from dreamp2p.config.sync import SyncConfig
from dreamp2p.sync.comm.inprocess import InProcessHub
from dreamp2p.sync.model.groups import GROUP_AGREE, GROUP_FLUSH, GROUP_FLUSH_DELTA, GROUP_INIT
from dreamp2p.sync.strategies.base import Strategy
from dreamp2p.sync.strategies.registry import strategy_class
from dreamp2p.sync.strategies.replicas import broadcast_state

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


def test_attach_sends_no_model_where_every_member_holds_it_already() -> None:
    """Issue 34, item 3: replicas seeded alike need no copy of rank 0's state; one 64-float round says so."""
    hub = InProcessHub(3)
    same = [WithState() for _ in range(3)]  # seeded alike
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        list(pool.map(lambda r: broadcast_state(hub.member(r), same[r], 10.0), range(3)))
    assert [r.group_id for r in hub.rounds] == [GROUP_AGREE]
    assert hub.rounds[0].elements == 64

    hub = InProcessHub(3)
    apart = [WithState() for _ in range(3)]
    with torch.no_grad():
        apart[1].ema.add_(1.0)  # one member's frozen state differs: everything comes from rank 0
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        list(pool.map(lambda r: broadcast_state(hub.member(r), apart[r], 10.0), range(3)))
    assert [r.group_id for r in hub.rounds] == [GROUP_AGREE, GROUP_INIT]
    assert len({digest(m) for m in apart}) == 1


def _dreamddp(hub: InProcessHub, models: list[WithState]) -> list[Strategy]:
    cfg = SyncConfig(strategy="dreamddp", period=4, max_delay=2, warmup_steps=2, control_every=4)
    return [
        strategy_class("dreamddp")(m, torch.optim.SGD(m.body.parameters(), lr=0.05), hub.member(r), cfg)
        for r, m in enumerate(models)
    ]


def _train_and_flush(
    syncs: list[Strategy], models: list[WithState], steps: int
) -> list[tuple[list[torch.Tensor], torch.Tensor | None]]:
    """Train, then flush; each member's trainable parameters just before the flush, and its outer weights
    then (every layer's theta, flat in layer order; None where it holds none)."""

    def run(rank: int) -> tuple[list[torch.Tensor], torch.Tensor | None]:
        for _ in range(steps):
            local_step(syncs[rank], models[rank], rank)
        syncs[rank].close()
        before = [p.detach().clone() for p in models[rank].body.parameters()]
        outer = syncs[rank].state_dict()["extra"].get("outer", {})
        theta = torch.cat([outer[li][0] for li in sorted(outer)]) if outer else None
        syncs[rank].flush()
        return before, theta

    with concurrent.futures.ThreadPoolExecutor(len(syncs)) as pool:
        return list(pool.map(run, range(len(syncs))))


def test_dreamddp_flush_averages_through_its_delta_codec_and_checks_the_result() -> None:
    """Issue 34, item 3: no full-model fp32 transfer in DreamDDP's flush when the outer weights agree."""
    hub = InProcessHub(3, goodput_Bps=50e6, rtt_s=0.001)
    models = [WithState() for _ in range(3)]
    syncs = _dreamddp(hub, models)
    ends = _train_and_flush(syncs, models, 13)  # mid-period: the replicas differ
    assert len({digest(m) for m in models}) == 1  # bit-identical, frozen state and buffers too
    flushes = [r for r in hub.rounds if r.group_id in (GROUP_FLUSH, GROUP_FLUSH_DELTA)]
    params = sum(p.numel() for p in models[0].body.parameters())
    delta = [r for r in flushes if r.group_id == GROUP_FLUSH_DELTA]
    assert len(delta) == 1 and delta[0].codec == "int4" and delta[0].elements == params
    # fp32 averages only of the small rest (the frozen EMA and the buffers differ per rank): never the body
    assert all(r.elements < params for r in flushes if r.group_id == GROUP_FLUSH), flushes
    # the result is the members' mean up to the codec's error on the mean pseudo-gradient theta - mean:
    # blockwise absmax int4 rounds to the nearest of 15 levels, at most absmax / 14 off
    theta = ends[0][1]
    assert theta is not None and theta.numel() == params
    assert all(t is not None and torch.equal(t, theta) for _, t in ends)  # the outer weights agreed
    mean = torch.stack([torch.cat([p.reshape(-1) for p in before]) for before, _ in ends]).mean(0)
    result = torch.cat([p.detach().reshape(-1) for p in models[0].body.parameters()])
    bound = float((theta - mean).abs().max()) / 14.0
    assert bound > 0.0
    assert float((result - mean).abs().max()) <= bound * (1 + 1e-4) + 1e-7


def test_dreamddp_flush_falls_back_to_fp32_where_the_outer_weights_differ() -> None:
    hub = InProcessHub(3, goodput_Bps=50e6, rtt_s=0.001)
    models = [WithState() for _ in range(3)]
    syncs = _dreamddp(hub, models)
    state = syncs[2].state_dict()
    state["extra"]["outer"][0][0].add_(1e-3)  # one member's theta drifted (a lost round, a partition)
    syncs[2].load_state_dict(state)
    _train_and_flush(syncs, models, 3)  # before the first check could repair it
    assert len({digest(m) for m in models}) == 1
    params = sum(p.numel() for p in models[0].body.parameters())
    assert any(r.group_id == GROUP_FLUSH and r.elements == params and r.codec == "fp32" for r in hub.rounds)
