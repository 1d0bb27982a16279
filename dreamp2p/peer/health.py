"""The node's health: its state (draining, the trainer's last step) and its status, kept current on its
grpc.health.v1 listener (`transport.health`).

`health_of` decides the status from the peer's state (joining, shutting down, draining, a stalled trainer);
`NodeHealth` holds the part of that state that is health's own (the drain flag, when the trainer last
published a step) and the publisher, if the node has a health listener; the publisher serves the status on
the listener and recomputes it every `HEALTH_INTERVAL_S`, so probes see a stall without anyone calling in.
Runs on the peer's event loop only.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from dreamp2p.transport.health import HealthListener

log = logging.getLogger(__name__)

# how often the health status is recomputed and published
HEALTH_INTERVAL_S = 0.5

Health = tuple[bool, str]  # serving, and why not


def health_of(closing: bool, ready: bool, idle_s: float | None, stall_s: float, draining: bool = False) -> Health:
    """Serving or not, and why: shutting down, draining (stopping after the current step), joining, or a
    trainer idle (no step published) for ``idle_s`` > ``stall_s`` seconds (``idle_s`` None: no trainer has
    published yet, so none stalled)."""
    if closing:
        return False, "shutting down"
    if draining:
        return False, "draining: stopping after the rounds in flight"
    if not ready:
        return False, "joining: no training state yet"
    if idle_s is not None and idle_s > stall_s:
        return False, f"trainer stalled: no step published for {idle_s:.0f} s"
    return True, "serving"


class HealthPublisher:
    """Serves ``status()`` on a health listener at ``listen`` while started."""

    def __init__(self, node_id: str, listen: str, status: Callable[[], Health]) -> None:
        self.node_id = node_id
        self.port = 0
        self.publications = 0  # passes of the loop (each publishes the status)
        self._listener = HealthListener(listen)
        self._status = status
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> int:
        """Bind the listener with the current status and start the loop; returns the bound port."""
        self.port = await self._listener.start(self._status()[0])
        self._task = asyncio.create_task(self._loop(), name=f"health-{self.node_id}")
        log.info("%s health (grpc.health.v1) on port %d", self.node_id, self.port)
        return self.port

    async def publish(self) -> None:
        """Publish the status now (watchers see it at once)."""
        await self._listener.set(*self._status())

    async def stop_loop(self) -> None:
        """Stop recomputing the status (the listener still answers with the last one)."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.wait({self._task})  # a cancel of our caller still propagates
            self._task = None

    async def stop(self, grace: float) -> None:
        await self.stop_loop()
        await self._listener.stop(grace)

    async def _loop(self) -> None:
        while True:
            await self.publish()
            self.publications += 1
            await asyncio.sleep(HEALTH_INTERVAL_S)


class NodeHealth:
    """The drain flag, when the trainer last published a step, and the publisher of the status: none without
    a health listener (``listen`` empty), and then starting, publishing and stopping do nothing.

    ``status`` is what the publisher serves (the peer's `Peer.health`, which adds the peer's own state).
    """

    def __init__(self, node_id: str, listen: str | None, stall_s: float, status: Callable[[], Health]) -> None:
        self.stall_s = stall_s
        self.draining = False  # the daemon is stopping: rounds in flight still land, probes see NOT_SERVING
        self.progress_at = time.monotonic()  # when the trainer last published a step
        self._publisher = HealthPublisher(node_id, listen, status) if listen else None

    def of(self, closing: bool, ready: bool, trained: bool, now: float | None = None) -> Health:
        """The status of a peer ``closing`` or not, ``ready`` or joining, whose trainer has published a step
        (``trained``) or not; ``now`` (monotonic) for tests."""
        idle = ((time.monotonic() if now is None else now) - self.progress_at) if trained else None
        return health_of(closing, ready, idle, self.stall_s, self.draining)

    def stepped(self) -> None:
        """The trainer published a step now."""
        self.progress_at = time.monotonic()

    def begin_drain(self) -> None:
        self.draining = True

    @property
    def port(self) -> int:
        """The health listener's port (0 without one)."""
        return self._publisher.port if self._publisher is not None else 0

    @property
    def publications(self) -> int:
        """Passes of the health loop (each publishes the status); 0 without a health listener."""
        return self._publisher.publications if self._publisher is not None else 0

    async def start(self) -> None:
        if self._publisher is not None:
            await self._publisher.start()

    async def publish(self) -> None:
        if self._publisher is not None:
            await self._publisher.publish()

    async def stop_loop(self) -> None:
        if self._publisher is not None:
            await self._publisher.stop_loop()

    async def stop(self, grace: float) -> None:
        if self._publisher is not None:
            await self._publisher.stop(grace)
