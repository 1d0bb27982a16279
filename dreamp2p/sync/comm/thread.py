"""The peer's event loop on its own thread, so communication runs while the trainer computes.

The training thread submits collectives and gets :class:`concurrent.futures.Future` objects back; it
only blocks where a strategy decides to wait. One loop, one Peer, one thread per node: torch kernels
and gRPC's C core release the GIL, so the two threads overlap for real.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import gc
import logging
import threading
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, TypeVar

import torch

from dreamp2p.config import PeerConfig, PeerInfo
from dreamp2p.messages import LinkSnapshot, PeerStatus, RingCodecPlan, RoundResult, TrainingInfo
from dreamp2p.peer import Peer
from dreamp2p.state.fetch import FetchedState, fetch_state
from dreamp2p.sync.model.layers import FlatGroup

log = logging.getLogger(__name__)
T = TypeVar("T")


class CommThread:
    """A started :class:`Peer` living on a private event loop thread."""

    def __init__(self, config: PeerConfig, ready: bool = True) -> None:
        self.config = config
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name=f"dreamp2p-{config.node_id}", daemon=True)
        self._thread.start()
        self.peer = Peer(config)
        # before the server starts: a joiner is left out of rounds until it asks in, and takes part in
        # none before it has state
        self.peer.ready = self.peer.in_ring = ready
        self.port = self.call(self.peer.start())

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_forever()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def call(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        return self.submit(coro).result(timeout)

    @property
    def address(self) -> str:
        return self.peer.address

    @property
    def node_id(self) -> str:
        return self.config.node_id

    def connect(
        self, ring: Sequence[PeerInfo] | None = None, timeout: float | None = None, require_all: bool = True
    ) -> None:
        self.call(self.peer.connect(ring, timeout, require_all))

    @property
    def round_timeout_s(self) -> float:
        """How long the peer lets one round run before it fails (``[node.transport] round_timeout_s``)."""
        return self.config.transport.round_timeout_s

    def agree(self, settings: dict[str, str], timeout: float) -> None:
        """Declare the training settings and check them against every live member's (see Peer.agree)."""
        self.call(self.peer.agree(settings, timeout), timeout + 30)

    @property
    def rank(self) -> int:
        """Our position among the members alive now (the ring the next round runs among)."""
        return self.members.index(self.config.node_id)

    @property
    def world(self) -> int:
        return len(self.members)

    @property
    def members(self) -> tuple[str, ...]:
        return self.peer.view or tuple(p.node_id for p in self.peer.ring)

    def allreduce(
        self,
        tensors: Sequence[torch.Tensor],
        group_id: int,
        codec: str | RingCodecPlan | None = None,
        plan_version: int = 0,
        timeout: float | None = None,
    ) -> concurrent.futures.Future[RoundResult]:
        """Start averaging ``tensors`` in place; they must not be touched until the future is done."""
        return self.submit(self.peer.allreduce(tensors, group_id, codec, plan_version, timeout))

    def allreduce_group(
        self,
        group: FlatGroup,
        group_id: int,
        codec: str | RingCodecPlan | None = None,
        plan_version: int = 0,
        round_id: int | None = None,
        guard_norm: bool = True,
        prepare: Callable[[], None] | None = None,
        error_feedback: bool = False,
    ) -> concurrent.futures.Future[RoundResult]:
        """Average a group's snapshot into its ``work`` buffer; ``snap`` stays for the delta merge.

        With ``prepare``, the round averages ``work`` in place instead, after ``prepare()`` filled it on
        the comm thread once the snapshot has landed (e.g. a pseudo-gradient ``theta - snap``): the
        training thread never waits for an asynchronous device-to-host snapshot.
        """
        return self.submit(
            _allreduce_group(
                self.peer, group, group_id, codec, plan_version, round_id, guard_norm, prepare, error_feedback
            )
        )

    def on_loop(self, fn: Callable[..., T], *args: Any) -> T:
        """Run a plain function of the peer on the loop thread (the peer is not thread-safe)."""

        async def run() -> T:
            return fn(*args)

        return self.call(run())

    def links(self) -> list[LinkSnapshot]:
        return self.on_loop(self.peer.link_snapshots)

    @property
    def ring_ids(self) -> tuple[str, ...]:
        """Every configured member (live or not), in ring order, this node included."""
        return tuple(p.node_id for p in self.peer.ring)

    def set_training_info(self, info: TrainingInfo) -> None:
        """Publish our strategy and step (read by our Status); never blocks the training thread."""
        if not self._loop.is_closed():  # a step after close() has nobody left to tell
            self._loop.call_soon_threadsafe(self.peer.set_training_info, info)

    @property
    def diverged_from(self) -> tuple[str, ...]:
        """Live members training with a plan we missed (see Peer.diverged); read without a loop call."""
        return self.peer.diverged

    @property
    def leading_step(self) -> int:
        """The highest step a live member reported (`dreamp2p.peer.drift.LeadingStep`); read without a loop call."""
        return self.peer.lead.step

    @property
    def view_changes(self) -> int:
        """How often the live view changed (see Peer.view_changes)."""
        return int(self.on_loop(lambda: self.peer.view_changes))

    def set_state_donor(self, donor: Any) -> None:
        self.on_loop(self.peer.set_state_donor, donor)

    def set_resume_steps(self, steps: Sequence[int]) -> None:
        self.on_loop(self.peer.set_resume_steps, steps)

    def ask_in(self, timeout: float) -> None:
        """A joiner about to take the state: be counted in the members' rounds from now on (see Peer.ask_in)."""
        self.call(self.peer.ask_in(timeout), timeout + 30)

    def admit_from(self, round_id: int) -> None:
        """Take part in rounds from ``round_id`` on (see Peer.admit_from)."""
        self.on_loop(self.peer.admit_from, round_id)

    def begin_drain(self) -> None:
        """Health NOT_SERVING from now on: the node is stopping (see Peer.begin_drain)."""
        self.on_loop(self.peer.begin_drain)

    def stand_aside(self) -> None:
        """Take part in no round until :meth:`admit_from` (see Peer.stand_aside)."""
        self.on_loop(self.peer.stand_aside)

    def member_status(self, node_id: str, timeout: float | None = None) -> PeerStatus:
        """Ask member ``node_id`` for its Status (PeerError when it does not answer)."""

        async def ask() -> PeerStatus:
            return await self.peer.link(node_id).status()

        return self.call(ask(), timeout)

    def fetch_state(self, donors: Sequence[str], timeout: float, manifest_hash: bytes | None = None) -> FetchedState:
        """Fetch the training state from several ``donors`` at once (see `dreamp2p.state.fetch`)."""

        async def fetch() -> FetchedState:
            links = [self.peer.link(n) for n in donors]
            return await fetch_state(links, timeout, manifest_hash=manifest_hash)

        return self.call(fetch(), timeout + 30)

    def status(self) -> PeerStatus:
        return self.on_loop(self.peer.status)

    def abort_rounds(self, reason: str) -> None:
        """Fail every round in flight (their tensors stay untouched); used when peers are gone."""
        self.on_loop(self.peer.abort_rounds, reason)

    def set_rate_limit(self, rate_Bps: float | None) -> None:
        """Change the emulated rate of every outgoing link (WAN emulation; None removes the limit)."""
        self.on_loop(self.peer.set_rate_limit, rate_Bps)

    def close(self, grace: float = 2.0) -> None:
        """Close the peer, then end every task still on the loop before stopping it.

        A task left pending would be finalized later by the garbage collector, possibly at interpreter
        exit on another thread, running its cleanup (gRPC call cancels) against a closed loop.
        """
        if not self._thread.is_alive():
            return
        try:
            self.call(self.peer.close(grace), timeout=grace + 30)
        finally:
            try:
                self.call(_drain_loop(grace), timeout=grace + 30)
            finally:
                self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
            if not self._thread.is_alive():
                self._loop.close()


async def _drain_loop(timeout: float) -> None:
    """Cancel and await every other task on this loop, then close async generators and the executor."""
    me = asyncio.current_task()
    tasks = [t for t in asyncio.all_tasks() if t is not me]
    for task in tasks:
        task.cancel()
    if tasks:
        _, pending = await asyncio.wait(tasks, timeout=timeout)
        log.debug("closing: cancelled %d leftover task(s); %d did not end", len(tasks), len(pending))
    # a failed round's frames can hold its gRPC calls in reference cycles: free them here, on the loop
    # thread while the loop still runs, not in a collection at interpreter exit
    gc.collect()
    loop = asyncio.get_running_loop()
    await loop.shutdown_asyncgens()
    await loop.shutdown_default_executor()


async def _allreduce_group(
    peer: Peer,
    group: FlatGroup,
    group_id: int,
    codec: str | RingCodecPlan | None,
    plan_version: int,
    round_id: int | None,
    guard_norm: bool,
    prepare: Callable[[], None] | None = None,
    error_feedback: bool = False,
) -> RoundResult:
    if group.device.type == "cuda":
        await asyncio.to_thread(group.ready)
    source = group.snap
    if prepare is not None:
        prepare()
        source = group.work
    return await peer.allreduce(
        [source],
        group_id,
        codec,
        plan_version,
        out=[group.work],
        round_id=round_id,
        guard_norm=guard_norm,
        error_feedback=error_feedback,
    )
