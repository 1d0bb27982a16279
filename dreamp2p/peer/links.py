"""The links to the ring: one client `Link` per other member, the handshakes and the settings agreement.

`adopt` takes a ring (checked: this node in it, no id twice) and opens a link to each new member;
`handshake_all` introduces us to every member at once and tells who did not answer (`connect`: both, and
`none_answered` the error when nobody did, naming the certificate problems met); `agree` checks our
training settings against every live member's (`dreamp2p.settings`). A handshake gives up at once when
admission (`peer.admission`) has meanwhile refused that member. The links are kept measured by the
active probe (`peer.probing`) and report their statistics as `LinkSnapshot`s. Runs on the peer's event
loop only.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine, Mapping, Sequence
from typing import Any

from dreamp2p.config import PeerConfig, PeerInfo
from dreamp2p.errors import PeerError, Status
from dreamp2p.messages import Hello, LinkSnapshot, MemberProgress, RoundEvidence
from dreamp2p.peer.admission import Admission
from dreamp2p.peer.probing import probe_forever, probe_once
from dreamp2p.settings import settings_mismatch
from dreamp2p.transport.client import Link
from dreamp2p.transport.linkrate.kernelnet import KernelCheck, read_tcp_limits

log = logging.getLogger(__name__)


class RingLinks:
    """The ring this node runs in and its links to the other members."""

    def __init__(self, config: PeerConfig, admission: Admission) -> None:
        self.config = config
        self._admission = admission
        self._ring: tuple[PeerInfo, ...] = ()
        self._links: dict[str, Link] = {}
        self._prober: asyncio.Task[None] | None = None
        self._kernel: KernelCheck | None = None  # read at the first probe (see `kernel_check`)

    @property
    def ring(self) -> tuple[PeerInfo, ...]:
        return self._ring

    def by_node(self) -> Mapping[str, Link]:
        """Every link, keyed by the member it leads to (a live view: do not keep it across awaits)."""
        return self._links

    def link(self, node_id: str) -> Link:
        return self._links[node_id]

    def get(self, node_id: str) -> Link | None:
        return self._links.get(node_id)

    def progress_of(self, members: Sequence[str]) -> dict[str, MemberProgress | None]:
        """What each of ``members`` (but us) said of its training in its last heartbeat answer."""
        me = self.config.node_id
        return {n: self._links[n].progress for n in members if n != me and n in self._links}

    def adopt(self, ring: Sequence[PeerInfo]) -> None:
        """Take ``ring`` as the ring (refused with ValueError if it lacks us or names a node twice)."""
        ring = tuple(ring)
        ids = [p.node_id for p in ring]
        if self.config.node_id not in ids:
            raise ValueError(f"ring {ids} does not contain this node {self.config.node_id!r}")
        if len(set(ids)) != len(ids):
            raise ValueError(f"ring lists a node id twice: {ids}")
        self._ring = ring
        cfg = self.config
        for p in ring:
            if p.node_id != cfg.node_id and p.node_id not in self._links:
                self._links[p.node_id] = Link(cfg.node_id, p, cfg.transport, cfg.tls, cfg.token)

    async def connect(self, ring: Sequence[PeerInfo], hello: Hello, timeout: float, require_all: bool) -> list[str]:
        """Adopt ``ring`` and handshake with every other member; the members that did not answer.

        ``require_all=False`` (a node joining a running cluster) counts members that do not answer as
        dead instead of failing; at least one must answer, and once one has, the others get two heartbeat
        intervals more (a member that is down or cut off must not hold the join up; the heartbeats bring
        it back when it answers).
        """
        self.adopt(ring)
        grace = max(1.0, 2 * self.config.transport.heartbeat_s)
        return await self.handshake_all(hello, timeout, require_all, grace)

    def none_answered(self, unreachable: Sequence[str]) -> PeerError | None:
        """The error when no member answered our handshake (None if one did or there is none)."""
        if not self._links or len(unreachable) != len(self._links):
            return None
        # a certificate problem is the likely reason, and the one an operator can fix: name each one met
        met = [f"{node}: {self._links[node].tls_problem}" for node in unreachable if self._links[node].tls_problem]
        because = f" ({'; '.join(met)})" if met else ""
        return PeerError(Status.TIMEOUT, f"no member of the ring answered the handshake{because}")

    async def handshake_all(
        self, hello: Hello, timeout: float, require_all: bool, grace: float | None = None
    ) -> list[str]:
        """Handshake with every member at once; the members that did not answer (none if ``require_all``:
        then the first failure is raised). A member answering under another id is a PeerError either way.

        ``grace`` (only without ``require_all``): once one member answered, the others have that many
        seconds more, so a member that is down or cut off does not hold us for all of ``timeout`` (a node
        joining a running cluster: the heartbeats bring such a member back when it answers).
        """
        links = list(self._links.values())
        calls = [asyncio.ensure_future(self.introduce(link, hello, timeout)) for link in links]
        try:
            if require_all:
                await asyncio.gather(*calls)
            else:
                await _first_then_grace(calls, grace)
        finally:
            for call in calls:
                call.cancel()
            if calls:
                await asyncio.wait(calls)
        unreachable = []
        for link, call in zip(links, calls, strict=True):
            reply = None if call.cancelled() else call.exception() or call.result()
            if not isinstance(reply, Hello):
                log.warning("%s did not answer the handshake: %s", link.dest.node_id, reply or "no answer in time")
                unreachable.append(link.dest.node_id)
                continue
            if reply.node_id != link.dest.node_id:
                raise PeerError(
                    Status.UNKNOWN_PEER,
                    f"{link.dest.address} answered as {reply.node_id!r}, not {link.dest.node_id!r}",
                )
        return unreachable

    async def introduce(self, link: Link, hello: Hello, timeout: float) -> Hello:
        """Handshake with ``link``'s member, but fail at once if we refused that member meanwhile.

        Two nodes that disagree handshake each other at about the same time; the one refused first exits,
        and our own handshake with it would then retry a closed port until its timeout. Having refused it
        ourselves, we know the answer: fail now with the words we refused it with.
        """
        node = link.dest.node_id
        task = asyncio.ensure_future(link.handshake(hello, timeout))
        try:
            while not task.done():
                conflict = self._admission.conflict_with(node)
                if conflict is not None:
                    raise conflict
                await asyncio.wait({task}, timeout=0.1)
            return task.result()
        finally:
            if not task.done():
                task.cancel()
                await asyncio.wait({task})  # its outcome is moot now; our own cancellation still propagates
            if not task.cancelled():
                task.exception()  # retrieved, so asyncio does not log it as never retrieved

    async def agree(
        self, settings: dict[str, str], members: Sequence[str], hello: Callable[[], Hello], timeout: float
    ) -> None:
        """Check our training settings against those of ``members``, before training, until ``timeout``.

        Each member is handshaken again with ``hello()``, which carries our settings; a member that has
        declared its own compares them and refuses on a difference (CONFIG_MISMATCH), and its reply carries
        its settings, which we compare too, so both sides of a disagreement fail with the differing settings
        named. A member that has not declared yet (it has not attached its model) is asked again every 0.1 s.
        """
        me = self.config.node_id
        pending = [node for node in members if node != me and node in self._links]
        deadline = time.monotonic() + timeout
        t = self.config.transport
        while pending:
            waiting = []
            for node in pending:
                left = max(0.1, deadline - time.monotonic())
                reply = await self.introduce(self._links[node], hello(), min(left, t.rpc_deadline_s))
                if not reply.settings:
                    waiting.append(node)
                    continue
                differ = settings_mismatch(settings, dict(reply.settings), me, node)
                if differ is not None:
                    raise PeerError(Status.CONFIG_MISMATCH, differ)
            pending = waiting
            if pending:
                if time.monotonic() > deadline:
                    raise PeerError(
                        Status.TIMEOUT,
                        f"{', '.join(pending)} declared no training settings within {timeout:.0f} s "
                        "(have they attached a model?)",
                    )
                await asyncio.sleep(0.1)

    def send_vote(
        self, node: str, key: tuple[int, int], vid: int, commit: bool, evidence: RoundEvidence | None = None
    ) -> Coroutine[Any, Any, None] | None:
        """Our vote on round ``key`` to ``node`` (None: no link to it; see `peer.commit`)."""
        link = self._links.get(node)
        if link is None:
            return None
        return link.vote(key[0], key[1], vid, commit, self.config.transport.rpc_deadline_s, evidence)

    def note_received(self, sender: str, nbytes: int) -> None:
        """Count ``nbytes`` received from ``sender`` on its link's statistics (no link: nothing)."""
        link = self._links.get(sender)
        if link is not None:
            link.stats.bytes_received += nbytes

    def snapshots(self) -> list[LinkSnapshot]:
        return [
            LinkSnapshot(
                peer=node,
                rtt_s=link.stats.rtt_s if link.stats.rtt_samples else 0.0,
                goodput_Bps=link.stats.goodput_Bps if link.stats.samples else 0.0,
                bytes_sent=link.stats.bytes_sent,
                bytes_received=link.stats.bytes_received,
                samples=link.stats.samples,
                chunk_bytes=link.chunk_bytes,
                goodput_is_floor=link.stats.floor,
            )
            for node, link in self._links.items()
        ]

    def start_probing(self) -> None:
        """Start the probe loop (once; not without a probe interval)."""
        t = self.config.transport
        if self._prober is None and t.probe_interval_s > 0:
            probe = probe_forever(self._links.values, t.probe_interval_s, t.probe_burst_bytes, self.kernel_check())
            self._prober = asyncio.create_task(probe, name=f"probe-{self.config.node_id}")

    def kernel_check(self) -> KernelCheck:
        """This host's TCP ceilings, read once, against which probed links are checked
        (`transport.linkrate.kernelnet`)."""
        if self._kernel is None:
            self._kernel = KernelCheck(read_tcp_limits())
        return self._kernel

    async def stop_probing(self) -> None:
        """Cancel the probe loop and wait for it to end (a cancel of our caller still propagates)."""
        if self._prober is not None:
            self._prober.cancel()
            await asyncio.wait({self._prober})
            self._prober = None

    async def probe_now(self, burst_bytes: int | None = None) -> list[LinkSnapshot]:
        """Measure every link once (RTT echo + burst) and return the snapshots."""
        await probe_once(
            self._links.values(), burst_bytes or self.config.transport.probe_burst_bytes, self.kernel_check()
        )
        return self.snapshots()

    def set_rate_limit(self, rate_Bps: float | None) -> None:
        """Re-pace every outgoing link (WAN emulation); None removes the limit."""
        for link in self._links.values():
            link.set_rate_limit(rate_Bps)

    async def close(self) -> None:
        await asyncio.gather(*(link.close() for link in self._links.values()))
        self._links.clear()


async def _first_then_grace(calls: Sequence[asyncio.Future[Hello]], grace: float | None) -> None:
    """Wait for ``calls`` to end, but once one has succeeded only ``grace`` seconds more (None: no limit)."""
    pending = set(calls)
    deadline: float | None = None
    loop = asyncio.get_running_loop()
    while pending:
        left = None if deadline is None else deadline - loop.time()
        if left is not None and left <= 0:
            return
        done, pending = await asyncio.wait(pending, timeout=left, return_when=asyncio.FIRST_COMPLETED)
        if grace is not None and deadline is None and any(not c.cancelled() and c.exception() is None for c in done):
            deadline = loop.time() + grace
