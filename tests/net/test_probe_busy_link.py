"""A link busy with small rounds the whole time is still measured again (`dreamp2p.peer.probing`, issue 37).

Small rounds never back up our send queue, so the link yields no passive goodput sample; before the
stale-link burst it kept its first sample for good, and a link that slowed under it was never seen slower.
"""

from __future__ import annotations

import asyncio
import time

import torch
from conftest import ring_configs, running_ring

from dreamp2p.config import TransportConfig
from dreamp2p.peer.probing import STALE_TICKS

INTERVAL_S = 0.05


async def test_a_link_busy_with_small_rounds_gets_a_fresh_goodput_sample() -> None:
    transport = TransportConfig(probe_interval_s=INTERVAL_S)
    async with running_ring(ring_configs(2, transport=transport)) as peers:
        end = time.monotonic() + 6 * STALE_TICKS * INTERVAL_S
        data = [[torch.full((256,), float(r))] for r in range(2)]
        rounds = 0
        first: int | None = None
        while time.monotonic() < end:
            await asyncio.gather(*(p.allreduce(d) for p, d in zip(peers, data, strict=True)))
            rounds += 1
            samples = {s.peer: s.samples for s in peers[0].link_snapshots()}.get("p1", 0)
            first = samples if first is None and samples > 0 else first
        assert rounds > 6 * STALE_TICKS, f"only {rounds} rounds: the link was not kept busy"
        samples = {s.peer: s.samples for s in peers[0].link_snapshots()}["p1"]
        # the first burst, then one at least every STALE_TICKS intervals (the test waits six such spans)
        assert first is not None and samples >= first + 3, (first, samples, rounds)
