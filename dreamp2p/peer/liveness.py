"""Who the peer runs rounds with: its `Membership`, the view of live members and the heartbeat loop.

The loop ticks the heartbeat echoes (`peer.heartbeat`) every ``heartbeat_s`` and publishes the view they
leave; a tick taken while one of our links holds a heartbeat interval or more of round bytes we handed it
and the member has not acknowledged (`Link.backlog_s`) counts no miss, so a member is dropped for silence
after ``heartbeat_misses`` ticks on an unsaturated uplink and after ``dead_after_s`` at most while ours
is saturated; a view change is handed to ``on_change`` (the peer fails the rounds that need a member that
is gone). Callers that learned of a loss first take a member out at once (`mark_unreachable`); a member
whose stream to us broke is echoed at once (`check`), so a dead one leaves the view without waiting for
the next pass; a member that introduces itself while counted dead (a restarted process) is echoed at once
too (`welcome`), so it is back in the view within a round trip; a retry waits for one more heartbeat tick
(`next_heartbeat`). A live member judged a straggler (`peer.straggler`, from the evidence on a completed
round's commit votes) is left out of the view until its probation ends; a straggler's own view is itself
alone meanwhile. A live member whose last echo said it is still joining (it starts up and has not asked
in, see `Peer.ask_in`) is left out of the view too, so rounds do not fail on it while it starts; it asks
in by introducing itself again, which `welcome` answers with an echo at once. Runs on the peer's event
loop only.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Mapping, Sequence
from typing import Any

from dreamp2p.config import TransportConfig
from dreamp2p.errors import Connection, PeerError
from dreamp2p.messages import RoundEvidence
from dreamp2p.peer.heartbeat import Echoes, SenderPace, echo, uplink_saturated
from dreamp2p.peer.membership import Membership
from dreamp2p.peer.straggler import StragglerPolicy, rule_of
from dreamp2p.transport.client import Link

log = logging.getLogger(__name__)


class Liveness:
    """The membership of one peer and the loop that keeps it current."""

    def __init__(
        self,
        node_id: str,
        transport: TransportConfig,
        links: Callable[[], Mapping[str, Link]],
        reintroduce: Callable[[Link], Awaitable[object]],
        on_change: Callable[[tuple[str, ...]], None],
        after_tick: Callable[[], None] | None = None,
    ) -> None:
        self.node_id = node_id
        self.transport = transport
        self.membership: Membership | None = None
        self.stragglers: StragglerPolicy | None = None
        # live members in ring order; replaced whole on every change, so other threads may read it
        self.view: tuple[str, ...] = ()
        self.view_changes = 0
        self.heartbeat_rounds = 0  # heartbeat ticks so far: tests count time in them
        self._links = links
        self._reintroduce = reintroduce
        self._on_change = on_change
        self._after_tick = after_tick  # told after every tick, once the view it leaves is published
        self._heart: asyncio.Task[None] | None = None
        self._echoes: Echoes | None = None
        self._beat = asyncio.Event()  # set (and replaced) after each heartbeat tick
        self._checks: dict[str, asyncio.Task[None]] = {}  # one out-of-turn echo per member at a time
        self.saturated = False  # the last tick found our uplink saturated (its silences counted no miss)
        self._pace = SenderPace()  # which members are sending us a round over a slow path now

    def begin(self, members: Sequence[str], unreachable: Iterable[str]) -> None:
        """A new membership over ``members``, all alive but ``unreachable`` (they count as dead at once)."""
        t = self.transport
        self.membership = Membership(self.node_id, members, misses=t.heartbeat_misses, dead_after_s=t.dead_after_s)
        self.stragglers = StragglerPolicy(rule_of(t), members)
        now = time.monotonic()
        self.membership.start(now)
        self._echoes = Echoes(
            self.membership, max(0.5, 2 * t.heartbeat_s), self._reintroduce, lambda: self._set_view(self._compose())
        )
        for node in unreachable:
            self.membership.missed(node, now, fatal=True)
        self.view = self._compose()

    def start_heartbeats(self) -> None:
        """Start the heartbeat loop (once; not without a heartbeat interval)."""
        if self._heart is None and self.transport.heartbeat_s > 0:
            self._heart = asyncio.create_task(self._loop(), name=f"heartbeat-{self.node_id}")

    async def stop(self) -> None:
        """Cancel the heartbeat loop and wait for it to end (a cancel of our caller still propagates)."""
        if self._heart is not None:
            self._heart.cancel()
            await asyncio.wait({self._heart})
            self._heart = None
        if self._echoes is not None:
            await self._echoes.close()
        checks = list(self._checks.values())
        for task in checks:
            task.cancel()
        if checks:
            await asyncio.wait(checks)

    def heard(self, node: str, frame_of: tuple[int, int] | None = None) -> None:
        """``node`` sent us something: it is alive (but a dead member is revived only by a heartbeat).
        ``frame_of``: a frame of that round (group id, round id), whose pace `SenderPace` follows."""
        now = time.monotonic()
        if frame_of is not None:
            self._pace.frame(node, frame_of, now)
        if self.membership is not None:
            self.membership.heard(node, now, revive=False)

    def is_alive(self, node: str) -> bool:
        return self.membership is None or self.membership.is_alive(node)

    async def _loop(self) -> None:
        t = self.transport
        loop = asyncio.get_running_loop()
        last = loop.time()
        while True:
            await asyncio.sleep(max(0.0, t.heartbeat_s - (loop.time() - last)))
            last = loop.time()
            assert self._echoes is not None
            links = self._links()
            now = time.monotonic()
            sending = [n for n in links if self._pace.sending(n, now)]
            sent = self._echoes.tick(links, self._saturated(links), sending)
            # a tick waits at most one interval for its own echoes (a refusal or a revival then shows in
            # the view it publishes, which a retry waiting on `next_heartbeat` runs among); a silent
            # member's echo never holds the next tick back, so ticks, and misses, keep their pace
            if sent:
                await asyncio.wait(sent, timeout=t.heartbeat_s)
            self.refresh()
            self._set_view(self._compose())
            if self._after_tick is not None:
                self._after_tick()
            self.heartbeat_rounds += 1
            done, self._beat = self._beat, asyncio.Event()
            done.set()

    def _saturated(self, links: Mapping[str, Link]) -> bool:
        """Whether our uplink is saturated now (`uplink_saturated`); a change is logged."""
        saturated = uplink_saturated((link.backlog_s() for link in links.values()), self.transport.heartbeat_s)
        if saturated != self.saturated:
            self.saturated = saturated
            log.debug(
                "our uplink is %s: %s",
                "saturated" if saturated else "clear",
                f"silence counts no heartbeat miss, at most {self.transport.dead_after_s:g} s of it"
                if saturated
                else "heartbeat misses count again",
            )
        return saturated

    async def next_heartbeat(self) -> None:
        """Wait for the heartbeat loop's next tick, which counts every silent member once more (none: no wait)."""
        t = self.transport
        if self._heart is None or self._heart.done():
            return
        tick = self._beat
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(tick.wait(), t.heartbeat_s + max(0.5, 2 * t.heartbeat_s) + 1.0)

    def check(self, node: str) -> None:
        """Evidence that ``node`` may be gone (its stream broke): echo it now, not at the next pass.

        A refused connection takes it out of the view at once (which fails the rounds that need it); an
        answer or a slow one changes nothing (the heartbeat loop counts misses). Only with heartbeats on
        (the same echo they send), once per member at a time.
        """
        self._echo_soon(node, self._check, "check")

    async def _check(self, node: str, link: Link) -> None:
        # only a refused connection counts: a slow answer is no miss here (the loop counts those)
        err = await echo(link, max(0.5, 2 * self.transport.heartbeat_s))
        if err is not None and err.connection is Connection.REFUSED and self.membership is not None:
            if self.membership.missed(node, time.monotonic(), fatal=True):
                log.warning("%s refused a connection after its stream broke: the ring re-forms without it", node)
            self._set_view(self._compose())

    def welcome(self, node: str) -> None:
        """``node`` introduced itself (a handshake): if it is out of the view (we count it dead, or its last
        echo said it was joining), echo it now, not at the next tick.

        A restarted member handshakes every other member first thing, and again when it asks in;
        echoing it at once lets it into the view within a round trip instead of up to a heartbeat tick
        later, which is most of a rejoining member's wait to be admitted. As in the loop, only our own
        echo getting through revives it (its handshake shows it runs, not that we reach it). Only with
        heartbeats on, one out-of-turn echo per member at a time.
        """
        if self.membership is not None and (not self.membership.is_alive(node) or self._is_joining(node)):
            self._echo_soon(node, self._welcome, "welcome")

    def _echo_soon(self, node: str, echo: Callable[[str, Link], Coroutine[Any, Any, None]], kind: str) -> None:
        """Run ``echo(node, link)`` now: only with heartbeats on, one out-of-turn echo per member at a time."""
        link = self._links().get(node)
        if self._heart is None or self.membership is None or link is None or node in self._checks:
            return
        task = asyncio.create_task(echo(node, link), name=f"{kind}-{node}")
        self._checks[node] = task
        task.add_done_callback(lambda _: self._checks.pop(node, None))

    async def _welcome(self, node: str, link: Link) -> None:
        if await echo(link, max(0.5, 2 * self.transport.heartbeat_s)) is not None:
            return  # not reachable from here yet: the heartbeat loop keeps trying
        if self.membership is not None and self.membership.heard(node, time.monotonic()):
            log.warning("%s introduced itself and answers: it rejoins the ring", node)
            # a restarted process admits nobody yet: introduce ourselves before our frames come
            with contextlib.suppress(PeerError):
                await self._reintroduce(link)
        self._set_view(self._compose())  # revived, or it asked in (its echo no longer says joining)

    def mark_unreachable(self, node: str) -> None:
        """Take ``node`` out of the view now, as a refused heartbeat would; a later answer brings it back.

        Rounds that need it fail at once. For an operator or a caller that learned of the loss first
        (and for tests that partition the view on one member only).
        """
        if self.membership is None:
            raise RuntimeError("mark_unreachable before connect: there is no membership yet")
        self.membership.missed(node, time.monotonic(), fatal=True)
        self._set_view(self._compose())

    def judge(self, evidence: Mapping[str, RoundEvidence]) -> None:
        """A round completed with ``evidence`` from each of its members: exclude a straggler it shows."""
        if self.stragglers is not None and self.stragglers.observe(evidence, time.monotonic()):
            self._set_view(self._compose())

    def refresh(self) -> None:
        """Let back in the stragglers whose probation ended (before a round opens, and on every heartbeat tick)."""
        if self.stragglers is not None and self.stragglers.expire(time.monotonic()):
            self._set_view(self._compose())

    @property
    def excluded(self) -> frozenset[str]:
        """Live members left out of the rounds as stragglers now."""
        return self.stragglers.excluded if self.stragglers is not None else frozenset()

    def _joining(self) -> set[str]:
        """Members whose last echo said they are still joining (up, but not asking to take part yet)."""
        return {node for node, link in self._links().items() if link.joining}

    def _is_joining(self, node: str) -> bool:
        link = self._links().get(node)
        return link is not None and link.joining

    def _compose(self) -> tuple[str, ...]:
        """The view: live members in ring order without the stragglers and the members still joining; a
        straggler's own view is itself alone."""
        assert self.membership is not None
        out = self.excluded
        if self.node_id in out:
            return (self.node_id,)
        out = out | self._joining()
        return tuple(m for m in self.membership.view() if m not in out)

    def _set_view(self, view: tuple[str, ...]) -> None:
        if view == self.view:
            return
        self.view = view
        self.view_changes += 1
        log.info("members alive: %s", ", ".join(view))
        self._on_change(view)
