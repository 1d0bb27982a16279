"""ShardedCollective over the in-memory hub, in a gloo process group of one rank (file store, loopback).

The shard and gather paths of a region with one rank per process: results, a round's ``prepare``, and a
failed WAN round failing on every member. Regions of several ranks run in tests/net/test_regions.py.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from dreamp2p.config import PeerConfig
from dreamp2p.errors import RoundFailed
from dreamp2p.node import Node
from dreamp2p.sync.comm.inprocess import InProcessHub
from dreamp2p.sync.comm.regiondrift import DriftVerdict
from dreamp2p.sync.comm.sharded import ShardedCollective, region_group
from dreamp2p.sync.model.layers import FlatGroup


@pytest.fixture
def hub() -> InProcessHub:
    return InProcessHub(2)  # two regions, one rank each


@pytest.fixture
def members(tmp_path: Path, hub: InProcessHub) -> Iterator[list[ShardedCollective]]:
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    group = region_group(dist.group.WORLD)
    assert group is not None
    out = [ShardedCollective(hub.member(i), group) for i in range(2)]
    try:
        yield out
    finally:
        for m in out:
            m.close()
        dist.destroy_process_group()


def groups(values: list[float], n: int = 7) -> list[FlatGroup]:
    out = []
    for v in values:
        g = FlatGroup([torch.full((n,), v)])
        g.snapshot()
        out.append(g)
    return out


def test_region_group_detects_only_a_job_of_many_ranks(members: list[ShardedCollective]) -> None:
    assert region_group(None) is None  # initialized, but one rank: the one-process path
    assert region_group(False) is None


def test_rounds_average_through_the_shard_and_the_gather(members: list[ShardedCollective]) -> None:
    gs = groups([1.0, 3.0])
    futs = [m.allreduce_group(g, 2, "fp32", round_id=1) for m, g in zip(members, gs, strict=True)]
    results = [f.result(30) for f in futs]
    for g, r in zip(gs, results, strict=True):
        assert torch.equal(g.work, torch.full((7,), 2.0))
        assert r.elements == 7 and r.bytes_sent > 0


def test_prepare_fills_the_round_before_the_shard_is_taken(members: list[ShardedCollective]) -> None:
    gs = groups([1.0, 3.0])

    def pseudo(g: FlatGroup) -> Callable[[], None]:
        def fill() -> None:  # as DreamDDP's pseudo-gradient: the whole group's work, from its snapshot
            g.work.copy_(g.snap).mul_(-1)

        return fill

    futs = [m.allreduce_group(g, 2, "fp32", round_id=1, prepare=pseudo(g)) for m, g in zip(members, gs, strict=True)]
    for f in futs:
        f.result(30)
    assert all(torch.equal(g.work, torch.full((7,), -2.0)) for g in gs)


def test_a_failed_wan_round_fails_on_every_member(hub: InProcessHub, members: list[ShardedCollective]) -> None:
    hub.fail(lambda group_id, round_id: round_id == 2)
    gs = groups([1.0, 3.0])
    ok = [m.allreduce_group(g, 2, "fp32", round_id=1) for m, g in zip(members, gs, strict=True)]
    bad = [m.allreduce_group(g, 2, "fp32", round_id=2) for m, g in zip(members, gs, strict=True)]
    after = [m.allreduce_group(g, 2, "fp32", round_id=3) for m, g in zip(members, gs, strict=True)]
    for f in ok + after:
        f.result(30)  # the gather thread goes on after a failed round
    for f in bad:
        with pytest.raises(RoundFailed):
            f.result(30)


def test_time_periods_are_refused_in_a_region_of_ranks(tmp_path: Path) -> None:
    """Each rank would follow the cluster's clock on its own and take other DDP steps than its neighbours:
    refused at attach with the reason, before anything is sent."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        model = torch.nn.Linear(4, 2)
        node = Node(PeerConfig(node_id="r0"), model, region=dist.group.WORLD)
        try:
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            with pytest.raises(ValueError, match="one rank per region"):
                node.attach(model, opt, strategy="streaming", periods="time")
        finally:
            node.close()
    finally:
        dist.destroy_process_group()


def test_the_drift_verdict_reaches_the_region_one_step_later(members: list[ShardedCollective]) -> None:
    """Local rank 0's verdict, posted at one step, is what every rank reads at the next (here: one rank)."""
    verdict = DriftVerdict(members[0].group, 0, 0)
    assert verdict.exchange(("b",)) == ()  # nothing posted before the first step
    assert verdict.exchange(()) == ("b",)
    assert verdict.exchange(("b", "c")) == ()
    verdict.discard()  # the region just took the state: the verdict in flight is dropped
    assert verdict.exchange(()) == ()
    verdict.close(5.0)
    # a rank other than local rank 0 reports that rank 0's members are ahead, never names of its own ring
    other = DriftVerdict(members[0].group, 0, 1)
    other.exchange(("b.1",))
    assert other.exchange(()) == ()  # its own verdict is not the region's
    other.close(5.0)
