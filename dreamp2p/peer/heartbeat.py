"""Failure detection's echoes: an echo to every member each tick, and a miss for each tick one went unanswered.

Every tick (``heartbeat_s`` apart) sends each member an echo, unless ``misses`` of its echoes are in flight
already. At a tick, a member whose oldest unanswered echo was sent at an earlier tick counts one miss,
whether that echo is still in flight or timed out; any answer clears its count. So a silent member (a cut
link, a stopped process) is counted dead ``misses`` ticks after it fell silent, the time the configuration
names, and a slow answer (a link queueing behind bulk data) still arrives in time to clear its misses. An
earlier design waited for a whole pass of echoes before the next one: with the echo's 2-interval deadline
a silent member then took three times as long to be counted dead (9 s for 1 s x 3 misses).

A refused connection marks a member dead at once; a member that answers again after being counted dead is
introduced to once more (a restarted process admits nobody yet). Runs on the peer's event loop;
`peer.liveness` owns the loop that ticks it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Mapping

from dreamp2p.errors import PeerError
from dreamp2p.peer.membership import Membership
from dreamp2p.transport.client import Link

log = logging.getLogger(__name__)


class Echoes:
    """The heartbeat echoes in flight to each member and the misses they count into ``membership``."""

    def __init__(
        self,
        membership: Membership,
        timeout: float,
        reintroduce: Callable[[Link], Awaitable[object]],
        on_change: Callable[[], None],
    ) -> None:
        self.membership = membership
        self.timeout = timeout  # one echo's deadline; misses are counted by ticks, not by it
        self._reintroduce = reintroduce
        self._on_change = on_change  # the membership changed outside a tick (a refusal, a revival)
        self.ticks = 0
        self._asked: dict[str, int] = {}  # member -> the tick its oldest unanswered echo was sent at
        self._flying: dict[str, set[asyncio.Task[None]]] = {}

    def tick(self, links: Mapping[str, Link]) -> set[asyncio.Task[None]]:
        """Count a miss for every member still silent since an earlier tick, then echo every member.

        Returns the echoes this tick sent (the caller may give them a moment to answer before it
        publishes the view).
        """
        now = time.monotonic()
        sent: set[asyncio.Task[None]] = set()
        cap = self.membership.misses
        for node, link in links.items():
            asked = self._asked.get(node)
            if asked is not None and asked < self.ticks and self.membership.missed(node, now):
                log.warning("%s has not answered for %d heartbeats: the ring re-forms without it", node, cap)
            flying = self._flying.setdefault(node, set())
            if len(flying) >= cap:  # enough echoes wait for it already: one more would only pile up
                continue
            self._asked.setdefault(node, self.ticks)
            task = asyncio.create_task(self._echo(node, link), name=f"heartbeat-{node}")
            flying.add(task)
            task.add_done_callback(flying.discard)
            sent.add(task)
        self.ticks += 1
        return sent

    async def _echo(self, node: str, link: Link) -> None:
        try:
            await link.heartbeat(self.timeout)
        except PeerError as err:
            # typed, not parsed from the message: a refused connection is a process that is gone; any
            # other failure (a deadline) is silence, which the ticks count
            if err.grpc_code == "UNAVAILABLE" and self.membership.missed(node, time.monotonic(), fatal=True):
                log.warning("%s is not answering (%s): the ring re-forms without it", node, err)
                self._on_change()
            return
        self._asked.pop(node, None)
        if self.membership.heard(node, time.monotonic()):
            log.warning("%s answers again: it rejoins the ring", node)
            # a restarted process admits nobody yet: introduce ourselves before our frames come
            with contextlib.suppress(PeerError):
                await self._reintroduce(link)
            self._on_change()

    async def close(self) -> None:
        """Cancel the echoes in flight and wait for them to end."""
        tasks = [t for flying in self._flying.values() for t in flying]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)
