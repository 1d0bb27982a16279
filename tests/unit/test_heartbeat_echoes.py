"""Heartbeat echoes count one miss per tick a member stays silent, whatever one echo's deadline (no sockets).

The links here are stand-ins whose answers the test releases by hand, so each case is a sequence of ticks
and answers, not of seconds: the detector under test is `Echoes`, the links are only its input.
"""

from __future__ import annotations

import asyncio

import pytest

from dreamp2p.errors import PeerError, Status
from dreamp2p.peer.heartbeat import Echoes
from dreamp2p.peer.membership import Membership


class _Link:
    """A member's end of the echo: each echo waits until the test answers, refuses or lets it time out."""

    def __init__(self) -> None:
        self.waiting: list[asyncio.Future[None]] = []
        self.sent = 0

    async def heartbeat(self, timeout: float) -> float:
        self.sent += 1
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.waiting.append(fut)
        await fut
        return 0.001

    def answer_all(self) -> None:
        for fut in self.waiting:
            if not fut.done():
                fut.set_result(None)
        self.waiting.clear()

    def fail_all(self, grpc_code: str) -> None:
        for fut in self.waiting:
            if not fut.done():
                fut.set_exception(PeerError(Status.TIMEOUT, "echo failed", grpc_code=grpc_code))
        self.waiting.clear()

    def in_flight(self) -> int:
        return sum(not f.done() for f in self.waiting)


async def _settle() -> None:
    for _ in range(5):  # let the echo tasks run up to their next await
        await asyncio.sleep(0)


class _Harness:
    def __init__(self, misses: int) -> None:
        self.membership = Membership("me", ["me", "a"], misses=misses, dead_after_s=1e9)
        self.membership.start(0.0)
        self.link = _Link()
        self.changes = 0
        self.reintroduced = 0
        self.echoes = Echoes(self.membership, 1.0, self._reintroduce, self._changed)

    async def _reintroduce(self, link: object) -> None:
        self.reintroduced += 1

    def _changed(self) -> None:
        self.changes += 1

    async def tick(self) -> None:
        self.echoes.tick({"a": self.link})  # type: ignore[dict-item]
        await _settle()


@pytest.mark.parametrize("misses", [1, 2, 3, 5])
async def test_a_silent_member_is_dead_after_exactly_misses_ticks(misses: int) -> None:
    h = _Harness(misses)
    await h.tick()  # the first echo goes out
    for _ in range(misses - 1):
        await h.tick()
        assert h.membership.is_alive("a")
    await h.tick()
    assert not h.membership.is_alive("a")
    await h.echoes.close()


@pytest.mark.parametrize("misses", [2, 3])
async def test_timed_out_echoes_still_count_one_miss_per_tick_not_per_deadline(misses: int) -> None:
    h = _Harness(misses)
    await h.tick()
    for _ in range(misses - 1):
        h.link.fail_all("DEADLINE_EXCEEDED")  # each echo times out before the next tick
        await _settle()
        assert h.membership.is_alive("a")  # a deadline alone counts nothing: the ticks do
        await h.tick()
    assert h.membership.is_alive("a")
    await h.tick()
    assert not h.membership.is_alive("a")
    await h.echoes.close()


async def test_a_late_answer_clears_the_misses() -> None:
    h = _Harness(3)
    await h.tick()
    await h.tick()
    await h.tick()  # two misses: one more tick of silence and it is dead
    h.link.answer_all()  # the answers of a queued link arrive late, but arrive
    await _settle()
    await h.tick()
    await h.tick()
    assert h.membership.is_alive("a")
    assert h.changes == 0
    await h.echoes.close()


async def test_echoes_in_flight_are_capped_at_misses() -> None:
    h = _Harness(3)
    for _ in range(10):
        await h.tick()
    assert h.link.in_flight() == 3
    assert h.link.sent == 3
    await h.echoes.close()
    assert h.link.in_flight() == 0  # cancelled


async def test_a_refused_echo_is_fatal_at_once_and_reported() -> None:
    h = _Harness(3)
    await h.tick()
    h.link.fail_all("UNAVAILABLE")
    await _settle()
    assert not h.membership.is_alive("a")
    assert h.changes == 1
    await h.echoes.close()


async def test_a_dead_member_that_answers_is_revived_and_introduced_to_again() -> None:
    h = _Harness(1)
    await h.tick()
    await h.tick()
    assert not h.membership.is_alive("a")
    h.link.answer_all()
    await _settle()
    assert h.membership.is_alive("a")
    assert (h.changes, h.reintroduced) == (1, 1)
    await h.echoes.close()
