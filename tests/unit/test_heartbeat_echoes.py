"""Heartbeat echoes count one miss per tick a member stays silent, whatever one echo's deadline (no sockets).

The links here are stand-ins whose answers the test releases by hand, so each case is a sequence of ticks
and answers, not of seconds: the detector under test is `Echoes`, the links are only its input. Ticks
taken while our uplink is saturated count no miss; only a refused connection is fatal at once, and a
connection that broke under an echo is echoed again at once.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from dreamp2p.errors import Connection, PeerError, Status
from dreamp2p.peer.heartbeat import Echoes, SenderPace
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

    def fail_all(self, grpc_code: str, connection: Connection | None = None) -> None:
        waiting, self.waiting = self.waiting, []
        for fut in waiting:
            if not fut.done():
                fut.set_exception(PeerError(Status.TIMEOUT, "echo failed", grpc_code=grpc_code, connection=connection))

    def in_flight(self) -> int:
        return sum(not f.done() for f in self.waiting)


async def _settle() -> None:
    for _ in range(5):  # let the echo tasks run up to their next await
        await asyncio.sleep(0)


class _Harness:
    def __init__(self, misses: int, dead_after_s: float = 1e9) -> None:
        self.membership = Membership("me", ["me", "a"], misses=misses, dead_after_s=dead_after_s)
        self.membership.start(0.0)
        self.link = _Link()
        self.changes = 0
        self.reintroduced = 0
        self.echoes = Echoes(self.membership, 1.0, self._reintroduce, self._changed)

    async def _reintroduce(self, link: object) -> None:
        self.reintroduced += 1

    def _changed(self) -> None:
        self.changes += 1

    async def tick(self, saturated: bool = False, sending: tuple[str, ...] = ()) -> None:
        self.echoes.tick({"a": self.link}, saturated, sending)  # type: ignore[dict-item]
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
    h.link.fail_all("UNAVAILABLE", Connection.REFUSED)
    await _settle()
    assert not h.membership.is_alive("a")
    assert h.changes == 1
    await h.echoes.close()


@pytest.mark.parametrize("saturated", [False, True])
async def test_a_killed_process_is_dead_within_the_echo_that_met_its_broken_connection(saturated: bool) -> None:
    """Measured on a SIGKILLed server: "Socket closed" for the call in flight, "Broken pipe" for the next one
    on the stale connection, then "Connection refused"; all within one echo, saturated uplink or not."""
    h = _Harness(3)
    await h.tick(saturated)
    h.link.fail_all("UNAVAILABLE", Connection.BROKEN)
    await _settle()
    h.link.fail_all("UNAVAILABLE", Connection.BROKEN)
    await _settle()
    assert h.membership.is_alive("a")
    h.link.fail_all("UNAVAILABLE", Connection.REFUSED)
    await _settle()
    assert not h.membership.is_alive("a")
    assert (h.changes, h.link.sent) == (1, 3)  # three echoes, one tick
    await h.echoes.close()


async def test_a_member_whose_starved_connection_broke_answers_on_a_new_one() -> None:
    h = _Harness(3)
    await h.tick()
    h.link.fail_all("UNAVAILABLE", Connection.BROKEN)  # our kernel gave the connection up (ETIMEDOUT)
    await _settle()
    h.link.answer_all()
    await _settle()
    assert h.membership.is_alive("a") and h.changes == 0
    await h.echoes.close()


@pytest.mark.parametrize(
    ("connection", "echoes"),
    [
        (Connection.BROKEN, 3),  # broken again and again (a reset on every new connection): BROKEN_TRIES
        (None, 1),  # UNAVAILABLE with no fate: a connection never made (an unreachable host, a TLS failure)
    ],
)
async def test_an_echo_failing_without_a_refusal_is_silence_for_the_ticks(
    connection: Connection | None, echoes: int
) -> None:
    h = _Harness(2)
    await h.tick()
    for _ in range(echoes):
        h.link.fail_all("UNAVAILABLE", connection)
        await _settle()
    assert h.membership.is_alive("a") and h.link.sent == echoes
    await h.tick()
    await h.tick()  # the ticks count the silence: two misses
    assert not h.membership.is_alive("a")
    await h.echoes.close()


@pytest.mark.parametrize("misses", [1, 3])
async def test_ticks_on_a_saturated_uplink_count_no_miss(misses: int) -> None:
    h = _Harness(misses)
    await h.tick(saturated=True)
    for _ in range(20):
        await h.tick(saturated=True)
    assert h.membership.is_alive("a")
    assert h.link.in_flight() == misses  # echoes still go out (capped): an answer would clear the silence
    for _ in range(misses - 1):
        await h.tick()  # the link cleared: misses count again, from where they were
        assert h.membership.is_alive("a")
    await h.tick()
    assert not h.membership.is_alive("a")
    await h.echoes.close()


async def test_silence_on_a_saturated_uplink_is_bounded_by_dead_after_s() -> None:
    dead_after_s = 0.2
    h = _Harness(3, dead_after_s=dead_after_s)
    h.membership.start(time.monotonic())
    start = time.monotonic()
    for _ in range(1000):  # a bound on ticks, not on seconds: the loop only ends once the member is gone
        if not h.membership.is_alive("a"):
            break
        await h.tick(saturated=True)
        await asyncio.sleep(0.02)
    assert not h.membership.is_alive("a")
    assert time.monotonic() - start >= dead_after_s  # never before the bound on silence
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


async def test_ticks_while_the_member_sends_us_a_round_count_no_miss() -> None:
    h = _Harness(3)
    for _ in range(10):
        await h.tick(sending=("a",))
    assert h.membership.is_alive("a")
    for _ in range(3):
        await h.tick()  # its frames stopped: misses count again
    assert not h.membership.is_alive("a")
    await h.echoes.close()


@pytest.mark.parametrize(
    ("frames", "now", "sending"),
    [
        ([], 1.0, False),  # never heard
        ([(0.0, (5, 1))], 0.1, False),  # one frame: no gap known yet
        ([(0.0, (5, 1)), (1.0, (5, 1))], 2.9, True),  # frames 1 s apart: sending for 2 s after the last
        ([(0.0, (5, 1)), (1.0, (5, 1))], 3.1, False),  # ... and no longer
        ([(0.0, (5, 1)), (1.0, (5, 1)), (1.1, (5, 1))], 3.0, True),  # the widest gap of the round counts
        ([(0.0, (5, 1)), (1.0, (5, 1)), (1.1, (6, 1))], 1.2, False),  # another round: its gap starts over
        ([(0.0, (5, 1)), (0.001, (5, 1))], 0.01, False),  # a fast path: far below a heartbeat, no change
    ],
)
def test_a_member_counts_as_sending_for_twice_its_widest_frame_gap(
    frames: list[tuple[float, tuple[int, int]]], now: float, sending: bool
) -> None:
    pace = SenderPace()
    for t, key in frames:
        pace.frame("a", key, t)
    assert pace.sending("a", now) is sending
    assert not pace.sending("b", now)
