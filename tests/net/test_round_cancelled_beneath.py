"""A round whose gRPC stream is cancelled beneath it (not by its caller) fails like any other round.

gRPC cancels a streaming call locally when its request iterator raises; the call's awaiter then sees a
bare ``CancelledError`` although nobody cancelled the round. The stream must fail at once (so the
round fails on every member now, all-or-none, instead of running into its deadline) and never let a
``CancelledError`` out of ``allreduce``, which a trainer thread cannot tell from its own shutdown: a CI
run under load had a trainer die with a bare ``CancelledError`` in a stalled-peer test.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from dreamp2p.errors import RoundFailed
from dreamp2p.peer import Peer
from dreamp2p.transport.linkrate.linkstats import BusyMeter


async def test_a_stream_cancelled_beneath_its_round_fails_the_round_on_every_member(
    ring3: list[Peer], monkeypatch: pytest.MonkeyPatch
) -> None:
    real = BusyMeter.on_send
    left = [1]  # one frame's metering fails, in whichever stream sends first

    def failing_once(self: BusyMeter, now: float, nbytes: int, backlogged: bool) -> tuple[int, float] | None:
        if left[0]:
            left[0] -= 1
            raise RuntimeError("injected: metering a frame failed")
        return real(self, now, nbytes, backlogged)

    monkeypatch.setattr(BusyMeter, "on_send", failing_once)
    data = [[torch.full((4096,), float(r))] for r in range(3)]
    before = [d[0].clone() for d in data]
    outcomes = await asyncio.gather(
        *(p.allreduce(d, timeout=20.0) for p, d in zip(ring3, data, strict=True)), return_exceptions=True
    )
    assert left == [0]  # the fault was injected
    assert all(isinstance(o, RoundFailed) for o in outcomes), outcomes
    # failed by the broken stream, announced to the others: not left to run into the round's deadline
    assert not any("did not finish within" in str(o) for o in outcomes), outcomes
    assert any("cancelled locally" in str(o) for o in outcomes), outcomes
    assert all(torch.equal(d[0], b) for d, b in zip(data, before, strict=True))  # applied nowhere

    # the links are fine: the next round completes everywhere
    await asyncio.gather(*(p.allreduce(d, timeout=20.0) for p, d in zip(ring3, data, strict=True)))
    assert all(torch.equal(d[0], torch.full((4096,), 1.0)) for d in data)
