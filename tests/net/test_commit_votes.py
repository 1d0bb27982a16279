"""Commit votes that go astray: a vote to a process that does not know its sender yet, and a late one.

A restarted member's new process has admitted none of the others until they introduce themselves again:
a member whose frames never reach it (it is not its ring successor) still sends it votes, and those must
make the sender handshake and vote again (NEEDS_HANDSHAKE), not vanish as from an unknown sender. A chaos
run had rounds held for their whole 120 s deadline, waiting for a vote refused that way.

A member that gave a round up after voting commit applies it after all when another member applied it.

Two generals: p0 votes commit, p1 gets that vote and applies the round, but p1's own commit reaches p0
only after p0's deadline for it (a late vote, or a member p0's heartbeats wrongly took for gone under
load: a CI run left two regions' replicas different that way). p0's retry meets p1's ROUND_COMPLETED
refusal and applies its own result of the round, identical to p1's, instead of keeping its tensors as
they were. A round p1 never ran stays applied nowhere at p0, its retry included.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

import pytest
import torch
from conftest import ring_configs, running_ring

from dreamp2p.config import PeerConfig, PeerInfo, TransportConfig
from dreamp2p.errors import RoundFailed, Status
from dreamp2p.messages import RoundEvidence
from dreamp2p.peer import Peer
from dreamp2p.peer.links import RingLinks

LATE_S = 3.0  # how late p1's commit reaches p0: past p0's whole round deadline
P0_TIMEOUT_S = 1.5


def _late_commits_from_p1(monkeypatch: pytest.MonkeyPatch, round_id: int) -> None:
    """p1's commit votes on round ``round_id`` reach p0 ``LATE_S`` late (the link holds them; votes to
    others, other rounds and failure votes go as usual)."""
    real = RingLinks.send_vote

    def late(
        self: RingLinks, node: str, key: tuple[int, int], vid: int, commit: bool, evidence: RoundEvidence | None = None
    ) -> Coroutine[Any, Any, None] | None:
        if self.config.node_id != "p1" or node != "p0" or key[1] != round_id or not commit:
            return real(self, node, key, vid, commit, evidence)

        async def held() -> None:
            await asyncio.sleep(LATE_S)
            coro = real(self, node, key, vid, commit, evidence)
            if coro is not None:
                await coro

        return held()

    monkeypatch.setattr(RingLinks, "send_vote", late)


async def test_a_round_given_up_after_committing_is_applied_when_a_member_applied_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _late_commits_from_p1(monkeypatch, round_id=7)
    async with running_ring(ring_configs(2), grace=2.0) as peers:
        data = [[torch.full((1024,), float(r)), torch.arange(8, dtype=torch.float32) * (r + 1)] for r in range(2)]
        timeouts = (P0_TIMEOUT_S, 30.0)
        outcomes = await asyncio.gather(
            *(p.allreduce(d, round_id=7, timeout=t) for p, d, t in zip(peers, data, timeouts, strict=True)),
            return_exceptions=True,
        )
        assert not any(isinstance(o, BaseException) for o in outcomes), outcomes
        # both hold the mean: p1 applied it on p0's commit, p0 on p1's refusal of its retry
        for d in data:
            assert torch.equal(d[0], torch.full((1024,), 0.5))
            assert torch.equal(d[1], torch.arange(8, dtype=torch.float32) * 1.5)
        assert outcomes[0].round_id == outcomes[1].round_id == 7  # type: ignore[union-attr]
        # the next round runs as usual
        await asyncio.gather(*(p.allreduce(d, round_id=8, timeout=20.0) for p, d in zip(peers, data, strict=True)))
        assert all(torch.equal(d[0], torch.full((1024,), 0.5)) for d in data)


async def test_a_retry_of_a_round_that_failed_everywhere_is_not_taken_for_a_completed_one() -> None:
    async with running_ring(ring_configs(2), grace=2.0) as peers:
        p0, p1 = peers
        # p1 never takes part in round 3: p0's round and its retry fail, and nothing is applied at p0
        data = [torch.full((64,), 2.0)]
        with pytest.raises(RoundFailed) as failed:
            await p0.allreduce(data, round_id=3, timeout=1.0)
        assert failed.value.status != Status.ROUND_COMPLETED
        assert torch.equal(data[0], torch.full((64,), 2.0))
        # and the ring is fine afterwards
        pair = [[torch.full((64,), 2.0)], [torch.full((64,), 4.0)]]
        await asyncio.gather(*(p.allreduce(d, round_id=4, timeout=20.0) for p, d in zip(peers, pair, strict=True)))
        assert all(torch.equal(d[0], torch.full((64,), 3.0)) for d in pair)
        del p1


async def test_a_vote_to_a_restarted_member_that_never_saw_the_sender_makes_it_handshake_again() -> None:
    # heartbeats so rare that none runs during the test: only the round's own calls reach the new process
    t = TransportConfig(heartbeat_s=600.0, round_timeout_s=20.0, round_retries=0)
    async with running_ring(ring_configs(3, transport=t), grace=2.0) as peers:
        ring = [PeerInfo(p.config.node_id, p.address) for p in peers]
        await peers[2].close(grace=0.1)
        # p2 restarts on its address: it introduces itself to p0 and p1, but neither has to p2's new process
        fresh = Peer(PeerConfig(node_id="p2", listen=peers[2].address, transport=t))
        await fresh.start()
        try:
            await fresh.connect(ring)
            members = [peers[0], peers[1], fresh]
            data = [[torch.full((512,), float(r))] for r in range(3)]
            # ring p0 -> p1 -> p2 -> p0: p0 sends p2 no frame, only its vote
            await asyncio.gather(*(p.allreduce(d, round_id=5) for p, d in zip(members, data, strict=True)))
            assert all(torch.equal(d[0], torch.full((512,), 1.0)) for d in data)
            assert fresh.rounds_failed == 0  # p0's vote came in: nobody waited for it to the deadline
        finally:
            await fresh.close(grace=0.1)


async def test_a_round_given_up_after_committing_is_applied_when_the_member_that_applied_it_is_gone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The last round of a run: p1 applies it on p0's commit and closes (its run is over) before its own commit
    reaches p0. p0's retry would run among p0 alone, and its own tensors are not the round's mean: p0 applies
    its result of the first run instead (every member contributed to it), so both end with the same model."""
    _late_commits_from_p1(monkeypatch, round_id=7)
    async with running_ring(ring_configs(2), grace=2.0) as peers:
        p0, p1 = peers
        data = [[torch.full((1024,), float(r))] for r in range(2)]

        async def p1_runs_its_last_round() -> None:
            await p1.allreduce(data[1], round_id=7, timeout=30.0)
            await p1.close(grace=0.5)

        outcome, _ = await asyncio.gather(
            p0.allreduce(data[0], round_id=7, timeout=P0_TIMEOUT_S), p1_runs_its_last_round()
        )
        assert torch.equal(data[1][0], torch.full((1024,), 0.5))
        assert torch.equal(data[0][0], torch.full((1024,), 0.5)), data[0][0][:4]
        assert outcome.round_id == 7
