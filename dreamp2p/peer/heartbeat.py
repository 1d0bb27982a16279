"""Failure detection: one heartbeat echo to every member, and what its answers change in the membership.

A member that answers again after missing beats is introduced to once more (a restarted process admits
nobody yet); a refused connection marks a member dead at once, a silent one after the membership's
allowance of missed beats. Runs on the peer's event loop; the peer owns the loop that repeats it.
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


async def beat_once(
    links: Mapping[str, Link],
    membership: Membership,
    timeout: float,
    reintroduce: Callable[[Link], Awaitable[object]],
) -> None:
    """Echo every link once (``timeout`` each, all at once) and record who answered in ``membership``."""
    items = list(links.items())
    results = await asyncio.gather(*(link.heartbeat(timeout) for _, link in items), return_exceptions=True)
    now = time.monotonic()
    for (node, link), res in zip(items, results, strict=True):
        if isinstance(res, asyncio.CancelledError):
            raise res
        if not isinstance(res, BaseException):
            if membership.heard(node, now):
                log.warning("%s answers again: it rejoins the ring", node)
                # a restarted process admits nobody yet: introduce ourselves before our frames come
                with contextlib.suppress(PeerError):
                    await reintroduce(link)
            continue
        # typed, not parsed from the message: a refused connection is a process that is gone
        refused = isinstance(res, PeerError) and res.grpc_code == "UNAVAILABLE"
        if membership.missed(node, now, fatal=refused):
            log.warning("%s is not answering (%s): the ring re-forms without it", node, res)
