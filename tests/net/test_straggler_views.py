"""Stragglers in one process: every member reaches the same verdict from the same votes, and the view follows.

Three peers on loopback, p2's sends paced to 80 kB/s: each round with it runs past its deadline (a floor
of 0.8 s; the others' links carry the round's bytes in milliseconds). After two such rounds all three
views leave p2 out at once (p2's own view is itself alone), the others' next round runs without it, and
when its probation ends (counted in heartbeat passes) it takes part again and the mean is of all three.
"""

from __future__ import annotations

import asyncio

import torch
from conftest import ring_configs, start_ring

from dreamp2p.config import PeerConfig, TransportConfig
from dreamp2p.errors import PeerError, Status
from dreamp2p.peer import Peer

NUMEL = 32 << 10
PROBE = 32 << 10


async def _round(peers: list[Peer], round_id: int) -> list[torch.Tensor]:
    data = [torch.full((NUMEL,), float(int(p.config.node_id[1:]))) for p in peers]
    rounds = (p.allreduce([d], round_id=round_id, guard_norm=False) for p, d in zip(peers, data, strict=True))
    await asyncio.gather(*rounds)
    return data


async def test_a_slow_member_leaves_every_view_at_the_same_round_and_returns_after_probation() -> None:
    t = TransportConfig(
        heartbeat_s=0.2,
        round_timeout_s=60.0,
        round_retries=0,
        probe_interval_s=60.0,
        probe_burst_bytes=PROBE,
        straggler_margin=3.0,
        straggler_floor_s=0.8,
        straggler_strikes=2,
        straggler_probation_s=1.0,
    )
    peers = await start_ring(ring_configs(3, transport=t))
    try:
        p0, p1, p2 = peers
        p2.set_rate_limit(80_000.0)
        await asyncio.gather(*(p.probe_now(PROBE) for p in peers))
        await _round(peers, 1)  # late once: a strike, still in
        assert all(p.view == ("p0", "p1", "p2") for p in peers)
        await _round(peers, 2)  # late twice: out, in every view at once
        assert [p.view for p in peers] == [("p0", "p1"), ("p0", "p1"), ("p2",)]
        assert all(p.status().excluded == ("p2",) and p.status().straggler_evictions == 1 for p in peers)
        # the others step on without it; it runs its rounds alone
        pair = await _round([p0, p1], 3)
        assert all(torch.all(d == 0.5) for d in pair)
        (alone,) = await _round([p2], 3)
        assert torch.all(alone == 2.0)
        # the slowdown ends; once its probation is over every member lets it back in
        p2.set_rate_limit(None)
        await p2.probe_now(PROBE)
        start = [p.heartbeat_rounds for p in peers]
        while not all(p.status().straggler_returns == 1 for p in peers):
            passed = min(p.heartbeat_rounds - s for p, s in zip(peers, start, strict=True))
            assert passed < 50, [p.status() for p in peers]
            await asyncio.sleep(0.05)
        assert all(p.view == ("p0", "p1", "p2") for p in peers)
        data = await _round(peers, 4)
        assert all(torch.all(d == 1.0) for d in data)  # the mean of all three again
        assert all(p.status().excluded == () for p in peers)
    finally:
        await asyncio.gather(*(p.close() for p in peers))


async def test_members_with_other_straggler_rules_refuse_each_other() -> None:
    # members that judged by other rules would exclude at other rounds: their views would differ
    t0 = TransportConfig(heartbeat_s=0.2, straggler_margin=3.0)
    t1 = TransportConfig(heartbeat_s=0.2, straggler_margin=4.0)
    peers = await start_ring([PeerConfig(node_id="p0", transport=t0), PeerConfig(node_id="p1", transport=t1)])
    try:
        results = await asyncio.gather(*(p.agree({"strategy": "ssgd"}, 5.0) for p in peers), return_exceptions=True)
        assert all(isinstance(r, PeerError) and r.status == Status.CONFIG_MISMATCH for r in results), results
        assert all("transport.stragglers" in str(r) and "margin 3" in str(r) and "margin 4" in str(r) for r in results)
    finally:
        await asyncio.gather(*(p.close() for p in peers))
