"""Membership: failure detection (pure), the ring re-forming among survivors, all-or-none rounds (issue 5)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest
import torch
from conftest import poll_until, ring_configs, start_ring

from dreamp2p.collective.ring import RoundAborted
from dreamp2p.config import PeerInfo, TransportConfig
from dreamp2p.errors import RoundFailed
from dreamp2p.peer import Peer
from dreamp2p.peer.commit import CommitVotes
from dreamp2p.peer.membership import Membership, view_id

# ---------------------------------------------------------------------------------------- pure bookkeeping


def test_view_starts_full_and_keeps_ring_order() -> None:
    m = Membership("b", ["a", "b", "c", "d"])
    m.start(0.0)
    assert m.view() == ("a", "b", "c", "d")
    assert m.dead() == ()


@pytest.mark.parametrize(
    ("misses", "events", "dead"),
    [
        (3, [("c", 1.0), ("c", 2.0)], ()),  # two misses: still alive
        (3, [("c", 1.0), ("c", 2.0), ("c", 3.0)], ("c",)),  # third miss: dead
        (1, [("a", 1.0)], ("a",)),
        (3, [("c", 20.0)], ("c",)),  # silent for longer than dead_after_s
    ],
)
def test_misses_make_a_member_dead(misses: int, events: list[tuple[str, float]], dead: tuple[str, ...]) -> None:
    m = Membership("b", ["a", "b", "c"], misses=misses, dead_after_s=10.0)
    m.start(0.0)
    for node, now in events:
        m.missed(node, now)
    assert m.dead() == dead
    assert m.view() == tuple(x for x in ("a", "b", "c") if x not in dead)


def test_fatal_miss_is_immediate_and_contact_revives() -> None:
    m = Membership("a", ["a", "b", "c"])
    m.start(0.0)
    assert m.missed("b", 0.1, fatal=True)
    assert m.view() == ("a", "c")
    assert m.heard("b", 0.2)  # back: it answers again
    assert m.view() == ("a", "b", "c")
    assert m.changes == 2


def test_contact_resets_misses_and_self_is_always_alive() -> None:
    m = Membership("a", ["a", "b"], misses=2)
    m.start(0.0)
    m.missed("b", 1.0)
    m.heard("b", 1.5)
    m.missed("b", 2.0)
    assert m.is_alive("b")
    assert not m.missed("a", 3.0, fatal=True)  # we never declare ourselves dead
    assert m.is_alive("a")


@pytest.mark.parametrize(
    ("me", "members", "kw"),
    [("x", ["a", "b"], {}), ("a", ["a", "a"], {}), ("a", ["a", "b"], {"misses": 0}), ("a", ["a"], {"dead_after_s": 0})],
)
def test_membership_rejects(me: str, members: list[str], kw: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        Membership(me, members, **kw)  # type: ignore[arg-type]


def test_view_ids_differ_by_members_and_order() -> None:
    ids = {view_id(v) for v in [("a", "b", "c"), ("a", "b"), ("b", "a", "c"), ("a",)]}
    assert len(ids) == 4 and 0 not in ids


# ------------------------------------------------------------------------------------ live peers on loopback


async def _ring(n: int, **transport: object) -> list[Peer]:
    t = TransportConfig(**{"heartbeat_s": 0.2, "round_timeout_s": 20.0, **transport})  # type: ignore[arg-type]
    return await start_ring(ring_configs(n, transport=t))


async def _wait_for(cond: object, peers: list[Peer], beats: int = 50) -> None:
    """Wait until ``cond()`` holds, for at most ``beats`` heartbeat rounds of every peer in ``peers``.

    Counted in heartbeat rounds, not seconds: failure detection works in rounds, and a loaded machine
    slows both alike.
    """
    start = [p.heartbeat_rounds for p in peers]
    while not cond():  # type: ignore[operator]
        passed = min(p.heartbeat_rounds - s for p, s in zip(peers, start, strict=True))
        assert passed < beats, f"condition not reached within {beats} heartbeat rounds"
        await asyncio.sleep(0.05)


async def test_ring_reforms_among_survivors_after_a_peer_dies() -> None:
    peers = await _ring(4)
    try:
        await peers[3].close(grace=0)
        survivors = peers[:3]
        await _wait_for(lambda: all(p.view == ("p0", "p1", "p2") for p in survivors), survivors)
        data = [[torch.full((1001,), float(r))] for r in range(3)]
        await asyncio.gather(*(p.allreduce(d, round_id=5) for p, d in zip(survivors, data, strict=True)))
        assert all(torch.all(d[0] == 1.0) for d in data)  # the mean of the three survivors
        assert all(p.status().live == ("p0", "p1", "p2") for p in survivors)
    finally:
        await asyncio.gather(*(p.close() for p in peers[:3]))


async def test_round_in_flight_fails_fast_when_a_member_dies_and_nothing_is_applied() -> None:
    # a slow link keeps the round in flight long enough to kill a member in the middle of it
    peers = await _ring(3, rate_limit=2e6, round_retries=0)
    try:
        data = [[torch.full((500_000,), float(r))] for r in range(3)]
        before = [d[0].clone() for d in data]
        tasks = [asyncio.ensure_future(p.allreduce(d, round_id=3)) for p, d in zip(peers, data, strict=True)]
        await asyncio.sleep(0.3)
        await peers[2].close(grace=0)
        results = await asyncio.gather(*tasks[:2], return_exceptions=True)
        assert all(isinstance(r, RoundFailed) for r in results), results
        # ended by the dead member's failure, not by the 20 s round deadline: each survivor names p2 or
        # learned of the failure from a member's announcement (p2's own, or the other survivor's)
        assert all("p2" in r.reason or "reports the round failed there" in r.reason for r in results), results
        assert not any("in time" in r.reason or "did not finish within" in r.reason for r in results), results
        for d, b in zip(data[:2], before[:2], strict=True):
            assert torch.equal(d[0], b)  # all or none: none
    finally:
        await asyncio.gather(*(p.close() for p in peers[:2]))
        tasks[2].cancel()


async def test_round_is_applied_nowhere_if_one_member_fails_after_its_part(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two members finish the ring; the third fails before committing: nobody applies the round."""
    peers = await _ring(3, round_retries=0)
    try:
        real_agree = CommitVotes.agree

        async def failing_agree(
            self: CommitVotes, key: tuple[int, int], vid: int, others: Sequence[str], t: float
        ) -> None:
            if self.node_id == "p1":
                raise RoundAborted("injected: p1 fails between its ring part and its commit")
            await real_agree(self, key, vid, others, t)

        monkeypatch.setattr(CommitVotes, "agree", failing_agree)
        data = [[torch.full((10_000,), float(r))] for r in range(3)]
        before = [d[0].clone() for d in data]
        results = await asyncio.gather(
            *(p.allreduce(d, round_id=7) for p, d in zip(peers, data, strict=True)), return_exceptions=True
        )
        assert all(isinstance(r, RoundFailed) for r in results), results
        for d, b in zip(data, before, strict=True):
            assert torch.equal(d[0], b)
        monkeypatch.setattr(CommitVotes, "agree", real_agree)
        # the next round is applied everywhere
        await asyncio.gather(*(p.allreduce(d, round_id=8) for p, d in zip(peers, data, strict=True)))
        assert all(torch.all(d[0] == 1.0) for d in data)
    finally:
        await asyncio.gather(*(p.close() for p in peers))


async def test_members_that_disagree_about_the_view_skip_the_round_then_agree() -> None:
    peers = await _ring(3, round_retries=0)
    try:
        # p0 alone believes p2 is dead (as after a transient partition): its frames carry another view
        peers[0].mark_unreachable("p2")
        assert peers[0].view == ("p0", "p1")
        data = [[torch.full((1000,), float(r))] for r in range(3)]
        before = [d[0].clone() for d in data]
        results = await asyncio.gather(
            *(p.allreduce(d, round_id=4) for p, d in zip(peers, data, strict=True)), return_exceptions=True
        )
        assert all(isinstance(r, RoundFailed) for r in results), results
        # ended by the disagreement itself, not by a deadline: a view mismatch, a failed vote, or (when a
        # frame arrives after its receiver already failed the round over the mismatch) a stale round
        ends = ("VIEW_MISMATCH", "reports the round failed there", "STALE_ROUND")
        assert all(any(e in r.reason for e in ends) for r in results), results
        assert all(torch.equal(d[0], b) for d, b in zip(data, before, strict=True))
        # heartbeats bring p2 back into p0's view; the next round runs among all three
        await _wait_for(lambda: peers[0].view == ("p0", "p1", "p2"), peers)
        await asyncio.gather(*(p.allreduce(d, round_id=5) for p, d in zip(peers, data, strict=True)))
        assert all(torch.all(d[0] == 1.0) for d in data)
    finally:
        await asyncio.gather(*(p.close() for p in peers))


async def test_a_round_whose_member_died_is_retried_among_the_survivors() -> None:
    peers = await _ring(3, rate_limit=2e6, round_retries=1)
    try:
        data = [[torch.full((500_000,), float(r))] for r in range(3)]
        tasks = [asyncio.ensure_future(p.allreduce(d, round_id=3)) for p, d in zip(peers, data, strict=True)]
        await asyncio.sleep(0.3)
        await peers[2].close(grace=0)
        results = await asyncio.gather(*tasks[:2], return_exceptions=True)
        # all or none, retry included: the survivors agree, and the retry among them gives their mean
        assert not any(isinstance(r, BaseException) for r in results), results
        assert all(torch.all(d[0] == 0.5) for d in data[:2])
        assert all(p.rounds_retried == 1 for p in peers[:2])
    finally:
        await asyncio.gather(*(p.close() for p in peers[:2]))
        tasks[2].cancel()


@pytest.mark.timeout(60)
async def test_a_member_counted_dead_is_back_in_the_view_as_soon_as_it_introduces_itself() -> None:
    # heartbeats so rare that no pass runs during the test: only the handshake can bring p2 back
    peers = await _ring(3, heartbeat_s=600.0)
    try:
        p0, _, p2 = peers
        p0.mark_unreachable("p2")
        assert p0.view == ("p0", "p1")
        # what a restarted process does first: introduce itself to every member (here: to p0)
        await p2.link("p0").handshake(p2.hello(), 10.0)
        await poll_until(lambda: p0.view == ("p0", "p1", "p2"))  # p0 echoes p2 at once
        assert p0.heartbeat_rounds == 0
        # and the ring works with it again
        data = [[torch.full((1001,), float(r))] for r in range(3)]
        await asyncio.gather(*(p.allreduce(d, round_id=3) for p, d in zip(peers, data, strict=True)))
        assert all(torch.all(d[0] == 1.0) for d in data)
    finally:
        await asyncio.gather(*(p.close() for p in peers))


async def _ring_with_joiner(n: int, **transport: object) -> list[Peer]:
    """``n`` peers on loopback, the last one started as a joining node is: out of the ring, without state."""
    t = TransportConfig(**{"heartbeat_s": 0.2, "round_timeout_s": 20.0, "round_retries": 0, **transport})  # type: ignore[arg-type]
    peers = [Peer(c) for c in ring_configs(n, transport=t)]
    peers[-1].ready = peers[-1].in_ring = False  # as CommThread sets a joiner up, before its server starts
    for p in peers:
        await p.start()
    ring = [PeerInfo(p.config.node_id, p.address) for p in peers]
    await asyncio.gather(*(p.connect(ring) for p in peers))
    return peers


@pytest.mark.timeout(60)
async def test_a_joining_member_stays_out_of_rounds_until_it_asks_in() -> None:
    peers = await _ring_with_joiner(3)
    try:
        p0, p1, p2 = peers
        # alive (it answers every echo) but out of the view while it starts up
        await _wait_for(lambda: p0.view == p1.view == ("p0", "p1"), [p0, p1])
        assert p0.membership is not None and p0.membership.is_alive("p2")
        data = [[torch.full((1001,), float(r))] for r in range(2)]
        await asyncio.gather(*(p.allreduce(d, round_id=3) for p, d in zip((p0, p1), data, strict=True)))
        assert all(torch.all(d[0] == 0.5) for d in data)  # the two members trained on without it
        assert p0.status().rounds_failed == 0 and p1.status().rounds_failed == 0

        # asking in: every member echoes it at once and counts it in; its rounds fail until it is admitted
        await p2.ask_in(5.0)
        await _wait_for(lambda: p0.view == p1.view == ("p0", "p1", "p2"), [p0, p1])
        data = [[torch.full((1001,), float(r))] for r in range(3)]
        results = await asyncio.gather(
            *(p.allreduce(d, round_id=4) for p, d in zip((p0, p1), data, strict=False)), return_exceptions=True
        )
        assert all(isinstance(r, RoundFailed) for r in results), results
        assert any("JOINING" in str(r) for r in results), results  # the other member may name the first
        p2.admit_from(5)
        await asyncio.gather(*(p.allreduce(d, round_id=5) for p, d in zip(peers, data, strict=True)))
        assert all(torch.all(d[0] == 1.0) for d in data)  # the mean of all three
    finally:
        await asyncio.gather(*(p.close() for p in peers))


@pytest.mark.timeout(60)
async def test_a_joiners_connect_does_not_wait_for_a_member_that_is_down() -> None:
    # a connect timeout far beyond the test's: only the grace after the first answer lets it finish
    t = TransportConfig(heartbeat_s=0.2, connect_timeout_s=3600.0)
    configs = ring_configs(4, transport=t)
    peers = [Peer(c) for c in configs]
    for p in peers:
        await p.start()
    ring = [PeerInfo(p.config.node_id, p.address) for p in peers]
    await asyncio.gather(*(p.connect(ring) for p in peers[:3]))
    await peers[2].close(grace=0)  # down for good: its port refuses connections
    joiner = peers[3]
    try:
        await joiner.connect(ring, require_all=False)
        assert joiner.view == ("p0", "p1", "p3")
    finally:
        await asyncio.gather(*(p.close() for p in (peers[0], peers[1], joiner)))
