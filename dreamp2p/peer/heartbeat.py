"""Failure detection's echoes: an echo to every member each tick, and a miss for each tick one went unanswered.

Every tick (``heartbeat_s`` apart) sends each member an echo, unless ``misses`` of its echoes are in flight
already. At a tick, a member whose oldest unanswered echo was sent at an earlier tick counts one miss,
whether that echo is still in flight or timed out; any answer clears its count. So a silent member (a cut
link, a stopped process) is counted dead ``misses`` ticks after it fell silent, the time the configuration
names, and a slow answer (a link queueing behind bulk data) still arrives in time to clear its misses. An
earlier design waited for a whole pass of echoes before the next one: with the echo's 2-interval deadline
a silent member then took three times as long to be counted dead (9 s for 1 s x 3 misses).

A tick taken while this node's own uplink is saturated (`uplink_saturated`: a link holds more than one
interval of unacknowledged round bytes at its measured goodput) counts no miss; only the membership's
``dead_after_s`` bound on silence applies then. Measured at 2 Mbit/s (tbf, as `bench lm`): while both
members' round frames filled the link, the echoes on the control connection took up to 2-9 s (its
segments dropped again and again at the full bottleneck queue) instead of 0.1-0.3 s, and members counted
each other dead after 3 ticks.

A member that is sending us a round's frames over a slow path (`SenderPace`: frames of one round arriving
further apart than heartbeats) answers behind them on the same path: its silence counts no miss either,
for twice the widest gap between its frames of that round. Seen in `tests/net/test_saturated_link.py` (2
Mbit/s, 256 KiB frames ~1 s apart): at the very end of a round, our uplink no longer saturated (so misses
counted) while the member's last frames still crossed, its answers stayed out for over 3 heartbeats and it
was counted dead, then answered again 0.1 s later.

Only a refused connection (the member's host says nothing listens: its process is gone) marks a member
dead at once. A connection that broke under an echo (reset, closed, or given up by our own kernel: at
2 Mbit/s a control connection starved for ~8-10 s ends with ETIMEDOUT, on TCP's probe limit or gRPC's
TCP_USER_TIMEOUT, and the member's side then sees a reset) is echoed again at once on a new connection
(`echo`): a killed process refuses it, a live member answers or stays silent for the ticks to count. A
member that answers again after being counted dead is introduced to once more (a restarted process admits
nobody yet). Runs on the peer's event loop; `peer.liveness` owns the loop that ticks it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Collection, Iterable, Mapping

from dreamp2p.errors import Connection, PeerError
from dreamp2p.peer.membership import Membership
from dreamp2p.transport.client import Link

log = logging.getLogger(__name__)

# echoes in all to a member whose connection broke under the previous one: the first call after a process
# was killed may still meet its old connection ("Broken pipe": gRPC had not seen the close yet), the next
# one connects anew and is refused
BROKEN_TRIES = 3


def uplink_saturated(backlogs_s: Iterable[float], heartbeat_s: float) -> bool:
    """Whether an unanswered echo says nothing now: one of our links holds ``heartbeat_s`` or more of its
    measured goodput in round bytes we handed it and the member has not acknowledged (``backlogs_s``, see
    `Link.backlog_s`; inf while bytes wait on a link not measured yet), so our own echoes wait behind them,
    or starve beside them at the bottleneck's full queue, and so do the answers that leave the member while
    ours fill the link."""
    return max(backlogs_s, default=0.0) >= heartbeat_s


class SenderPace:
    """Whether a member is sending us a round now, from when its frames arrive (pure: times are given).

    Per member: its last frame's time and round, and the widest gap between two of its frames of that round; it
    counts as sending for twice that gap after its last frame. On a fast path the gaps are far below a heartbeat
    and nothing changes; a frozen member stops sending and is counted again within two gaps."""

    def __init__(self) -> None:
        self._last: dict[str, tuple[float, tuple[int, int], float]] = {}  # member -> (time, round, widest gap)

    def frame(self, member: str, key: tuple[int, int], now: float) -> None:
        """A frame of round ``key`` (group id, round id) from ``member`` arrived at ``now``."""
        last = self._last.get(member)
        gap = max(last[2], now - last[0]) if last is not None and last[1] == key else 0.0
        self._last[member] = (now, key, gap)

    def sending(self, member: str, now: float) -> bool:
        last = self._last.get(member)
        return last is not None and now - last[0] < 2.0 * last[2]


async def echo(link: Link, timeout: float) -> PeerError | None:
    """One heartbeat echo to ``link``'s member within ``timeout``: None if it answered, else the failure.

    A connection that broke under the echo (`Connection.BROKEN`) is echoed again at once, up to
    `BROKEN_TRIES` echoes in all: the next call connects anew, which a member whose process is gone refuses
    (`Connection.REFUSED`) and a live one answers.
    """
    deadline = time.monotonic() + timeout
    failure: PeerError | None = None
    for _ in range(BROKEN_TRIES):
        try:
            await link.heartbeat(max(0.05, deadline - time.monotonic()))
            return None
        except PeerError as err:
            failure = err
        if failure.connection is not Connection.BROKEN or time.monotonic() >= deadline:
            break
    return failure


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

    def tick(
        self, links: Mapping[str, Link], saturated: bool = False, sending: Collection[str] = ()
    ) -> set[asyncio.Task[None]]:
        """Count a miss for every member still silent since an earlier tick, then echo every member.

        ``saturated``: our own uplink is saturated (`uplink_saturated`): silence counts no miss now, only
        the membership's bound on it; ``sending``: members whose silence counts none either (`SenderPace`).
        Returns the echoes this tick sent (the caller may give them a moment to answer before it publishes
        the view).
        """
        now = time.monotonic()
        sent: set[asyncio.Task[None]] = set()
        cap = self.membership.misses
        for node, link in links.items():
            asked = self._asked.get(node)
            quiet = saturated or node in sending
            if asked is not None and asked < self.ticks and self.membership.missed(node, now, counted=not quiet):
                if quiet:
                    log.warning(
                        "%s has been silent for %.0f s while the link was full: the ring re-forms without it",
                        node,
                        self.membership.dead_after_s,
                    )
                else:
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
        err = await echo(link, self.timeout)
        if err is not None:
            # a refused connection is a process that is gone; any other failure (a deadline, a connection
            # that broke again and again, an unreachable host) is silence, which the ticks count
            if err.connection is Connection.REFUSED and self.membership.missed(node, time.monotonic(), fatal=True):
                log.warning("%s refuses connections (%s): the ring re-forms without it", node, err)
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
