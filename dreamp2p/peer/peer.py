"""The asyncio gRPC peer: server, links to the ring, admission, round registry and `allreduce`.

One Peer lives on one event loop. It owns the gRPC server (see `transport.server` for the thin
servicer), one :class:`~dreamp2p.transport.client.Link` per other member, and the rounds in flight.
Averaging is the ring all-reduce of `collective.ring`; chunk sizes come from each link's measured
goodput (`collective.chunking`), which passive metering and a light idle-time probe keep current.

Membership: heartbeats feed `membership.Membership`; each round runs among the members alive when it
starts (its view, whose id every frame carries), so the ring re-forms among survivors at the next round.
Rounds are all-or-none: a member that finished its part sends a commit vote to every other member and
applies the result only once every member's commit arrived; a member whose round failed votes "failed"
and the others give up at once. A round that fails leaves every tensor as it was, on every member.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Coroutine, Sequence
from typing import Any

import torch
from grpc import aio

from dreamp2p.collective.chunking import choose_chunk_bytes
from dreamp2p.collective.feedback import GroupFeedback, RoundFeedback
from dreamp2p.collective.partition import split_segments
from dreamp2p.collective.ring import RingRound, RoundAborted, RoundSpec
from dreamp2p.compression import Codec, ZstdStage, codec_names, get_codec
from dreamp2p.config import PeerConfig, PeerInfo
from dreamp2p.errors import PeerError, RoundFailed, Status
from dreamp2p.messages import (
    PROTOCOL_VERSION,
    DType,
    Frame,
    Hello,
    LinkSnapshot,
    PeerStatus,
    RingCodecPlan,
    RoundResult,
    TrainingInfo,
    Vote,
)
from dreamp2p.peer.admission import Admission
from dreamp2p.peer.commit import CommitVotes
from dreamp2p.peer.guard import ContributionGuard
from dreamp2p.peer.heartbeat import beat_once
from dreamp2p.peer.membership import Membership, view_id
from dreamp2p.peer.probing import probe_forever, probe_once
from dreamp2p.peer.rounds import RoundRegistry
from dreamp2p.settings import settings_mismatch
from dreamp2p.transport.client import Link, OutboundStream
from dreamp2p.transport.health import HealthListener
from dreamp2p.transport.server import build_server

log = logging.getLogger(__name__)
# how often the health status is recomputed and published
HEALTH_INTERVAL_S = 0.5

# Probes larger than this are refused.
MAX_PROBE_BYTES = 4 << 20
# A failed round is retried under its group id with this bit set (same round id), see allreduce().
RETRY_GROUP_BIT = 1 << 31


class Peer:
    """A node's networking half. Use ``async with Peer(cfg) as peer`` or start/close explicitly."""

    def __init__(self, config: PeerConfig) -> None:
        self.config = config
        self.max_payload = config.transport.max_message_bytes - (64 << 10)
        self.max_probe_bytes = MAX_PROBE_BYTES
        self._server: aio.Server | None = None
        self.port = 0
        self._ring: tuple[PeerInfo, ...] = ()
        self._links: dict[str, Link] = {}
        # whose handshakes we accepted, and the members we refused for their model or settings: our own
        # handshakes with those fail at once with the same words (see _introduce)
        self._admission = Admission()
        self.rounds = RoundRegistry(config.transport.round_timeout_s)
        self._zstd = ZstdStage(config.transport.zstd_level) if config.transport.zstd else None
        self._prober: asyncio.Task[None] | None = None
        self._started = time.monotonic()
        self._closing = False
        self.rounds_completed = 0
        self.rounds_failed = 0
        self.rounds_retried = 0
        self.heartbeat_rounds = 0  # completed passes over every member: tests count time in them
        self.frames_rejected = 0
        self._guard = ContributionGuard(config.max_norm_ratio)
        self._health: HealthListener | None = None
        self._health_task: asyncio.Task[None] | None = None
        self.health_port = 0
        self.health_publications = 0  # passes of the health loop (each publishes the status)
        self._progress_at = time.monotonic()  # when the trainer last published a step
        self._feedback: dict[int, GroupFeedback] = {}  # error-feedback residuals per group (base group id)
        # set by the trainer's thread; replaced whole (never mutated), so readers see a consistent value
        self.training: TrainingInfo | None = None
        # set by a node that resumed: the checkpoint steps it held, so a restart wave can agree on one
        self.resume_steps: tuple[int, ...] | None = None
        # serves this node's training state to joining members (see `dreamp2p.state`); None: not offered
        self.state_donor: Any = None
        self.membership: Membership | None = None
        # live members in ring order; replaced whole on every change, so other threads may read it
        self.view: tuple[str, ...] = ()
        self.view_changes = 0
        self._commits = CommitVotes(config.node_id, self._send_vote, self._is_alive)
        self._heart: asyncio.Task[None] | None = None
        self._beat = asyncio.Event()  # set (and replaced) after each heartbeat pass over the members
        # A joining node answers heartbeats from the start, so every member counts it alive and runs its
        # rounds among a view that includes it; until it holds the cluster's state ("ready") it refuses
        # their frames at once (JOINING), so all those rounds fail everywhere: no plan decision or average
        # is made without it between the members' state snapshot and its first step (see Node.join).
        # Afterwards it refuses rounds from before the step it starts at.
        self.ready = True
        # training settings every member must share (see `dreamp2p.settings`); empty until declared
        self._settings: tuple[tuple[str, str], ...] = ()

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> int:
        self._server, self.port = build_server(self.config, self)
        await self._server.start()
        log.info("%s listening on port %d", self.config.node_id, self.port)
        if self.config.health_listen:
            self._health = HealthListener(self.config.health_listen)
            self.health_port = await self._health.start(self.health()[0])
            self._health_task = asyncio.create_task(self._health_loop(), name=f"health-{self.config.node_id}")
            log.info("%s health (grpc.health.v1) on port %d", self.config.node_id, self.health_port)
        return self.port

    def health(self, now: float | None = None) -> tuple[bool, str]:
        """Whether this node is serving, and why not: joining, shutting down, or its trainer stalled."""
        if self._closing:
            return False, "shutting down"
        if not self.ready:
            return False, "joining: no training state yet"
        if self.training is not None:
            idle = (time.monotonic() if now is None else now) - self._progress_at
            if idle > self.config.health_stall_s:
                return False, f"trainer stalled: no step published for {idle:.0f} s"
        return True, "serving"

    async def _health_loop(self) -> None:
        assert self._health is not None
        while True:
            await self._health.set(*self.health())
            self.health_publications += 1
            await asyncio.sleep(HEALTH_INTERVAL_S)

    @property
    def address(self) -> str:
        if self.config.advertise:
            return self.config.advertise
        host = self.config.listen.rsplit(":", 1)[0]
        return f"{host}:{self.port}"

    @property
    def ring(self) -> tuple[PeerInfo, ...]:
        return self._ring

    def hello(self) -> Hello:
        return Hello(
            cluster_id=self.config.cluster_id,
            protocol_version=PROTOCOL_VERSION,
            node_id=self.config.node_id,
            manifest_hash=self.config.manifest_hash,
            codecs=tuple(get_codec(n).wire_id for n in codec_names()),
            advertise_address=self.address,
            settings=self._settings,
        )

    async def connect(
        self, ring: Sequence[PeerInfo] | None = None, timeout: float | None = None, require_all: bool = True
    ) -> None:
        """Adopt the ring (config order by default) and handshake with every other member.

        ``require_all=False`` (a node joining a running cluster) counts members that do not answer as
        dead instead of failing; at least one must answer.
        """
        ring = tuple(ring if ring is not None else self.config.ring)
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
        hello = self.hello()
        limit = timeout if timeout is not None else cfg.transport.connect_timeout_s
        replies = await asyncio.gather(
            *(self._introduce(link, hello, limit) for link in self._links.values()), return_exceptions=not require_all
        )
        unreachable = []
        for link, reply in zip(self._links.values(), replies, strict=True):
            if isinstance(reply, asyncio.CancelledError):
                raise reply
            if isinstance(reply, BaseException):
                log.warning("%s did not answer the handshake: %s", link.dest.node_id, reply)
                unreachable.append(link.dest.node_id)
                continue
            if reply.node_id != link.dest.node_id:
                raise PeerError(
                    Status.UNKNOWN_PEER,
                    f"{link.dest.address} answered as {reply.node_id!r}, not {link.dest.node_id!r}",
                )
        self.membership = Membership(
            cfg.node_id,
            ids,
            misses=cfg.transport.heartbeat_misses,
            dead_after_s=cfg.transport.dead_after_s,
        )
        now = time.monotonic()
        self.membership.start(now)
        for node in unreachable:
            self.membership.missed(node, now, fatal=True)
        if self._links and len(unreachable) == len(self._links):
            raise PeerError(Status.TIMEOUT, "no member of the ring answered the handshake")
        self.view = self.membership.view()
        if self._prober is None and cfg.transport.probe_interval_s > 0:
            probe = probe_forever(self._links.values, cfg.transport.probe_interval_s, cfg.transport.probe_burst_bytes)
            self._prober = asyncio.create_task(probe, name=f"probe-{cfg.node_id}")
        if self._heart is None and cfg.transport.heartbeat_s > 0 and len(ring) > 1:
            self._heart = asyncio.create_task(self._heartbeat_loop(), name=f"heartbeat-{cfg.node_id}")

    async def _introduce(self, link: Link, hello: Hello, timeout: float) -> Hello:
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

    async def agree(self, settings: dict[str, str], timeout: float) -> None:
        """Declare our training settings and check them against every live member's, before training.

        Each member is handshaken again with the settings; a member that has declared its own compares
        them and refuses on a difference (CONFIG_MISMATCH), and its reply carries its settings, which we
        compare too, so both sides of a disagreement fail with the differing settings named. A member
        that has not declared yet (it has not attached its model) is asked again until ``timeout``.
        """
        self._settings = tuple(sorted(settings.items()))
        me = self.config.node_id
        pending = [node for node in self.view if node != me and node in self._links]
        deadline = time.monotonic() + timeout
        t = self.config.transport
        while pending:
            waiting = []
            for node in pending:
                left = max(0.1, deadline - time.monotonic())
                reply = await self._introduce(self._links[node], self.hello(), min(left, t.rpc_deadline_s))
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

    async def close(self, grace: float = 2.0) -> None:
        """Stop probing, fail rounds in flight, stop the server with ``grace`` seconds, close channels."""
        self._closing = True
        if self._health is not None:  # probes see NOT_SERVING while we drain
            await self._health.set(*self.health())
        loops = [t for t in (self._prober, self._heart, self._health_task) if t is not None]
        for task in loops:
            task.cancel()
        if loops:  # asyncio.wait re-raises nothing of theirs, and a cancel of close() itself still propagates
            await asyncio.wait(loops)
        self._prober = self._heart = self._health_task = None
        self.rounds.fail_open("peer shutting down")
        self.rounds.refuse_waiting(PeerError(Status.SHUTTING_DOWN, "peer shutting down"))
        if self._server is not None:
            await self._server.stop(grace)
            self._server = None
        await asyncio.gather(*(link.close() for link in self._links.values()))
        self._links.clear()
        if self._health is not None:
            await self._health.stop(grace)
            self._health = None

    async def __aenter__(self) -> Peer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ------------------------------------------------------------------ server backend

    def admit(self, hello: Hello) -> Hello:
        """Accept a member's handshake (PeerError saying why not) and answer with our own hello."""
        mine = self.hello()
        members = {p.node_id for p in (self._ring or self.config.ring)}
        self._admission.admit(hello, mine, members, get_codec(self.config.codec).wire_id, self.config.codec)
        return mine

    async def accept_frame(self, frame: Frame) -> None:
        if self._closing:
            raise PeerError(Status.SHUTTING_DOWN, "peer shutting down")
        if not self.ready:
            raise PeerError(Status.JOINING, "joining: no training state yet, so no part in rounds")
        if not self._admission.is_admitted(frame.sender):
            if any(p.node_id == frame.sender for p in self._ring):
                # a member that handshook with this node's previous process: it must introduce itself again
                raise PeerError(
                    Status.NEEDS_HANDSHAKE, f"ring member {frame.sender!r} has not handshaken with this process"
                )
            raise PeerError(Status.UNKNOWN_PEER, f"sender {frame.sender!r} has not completed a handshake")
        if self.membership is not None:
            self.membership.heard(frame.sender, time.monotonic(), revive=False)
        rnd = await self.rounds.round_for(frame)
        # a frame from another view is refused (VIEW_MISMATCH) without touching the round: its sender's
        # round fails there and that sender's "failed" vote ends ours (a forged frame cannot)
        rnd.deliver(frame)
        link = self._links.get(frame.sender)
        if link is not None:
            link.stats.bytes_received += len(frame.payload)

    def stream_broken(self, sender: str, keys: set[tuple[int, int]], reason: str) -> None:
        self.rounds.fail_open(f"{sender}: {reason}", lambda key, rnd: key in keys and rnd.spec.predecessor == sender)

    def vote(self, v: Vote) -> None:
        """A member's outcome of a round (see the module docstring): recorded, and a failure ends ours."""
        if not self.is_admitted(v.sender):
            raise PeerError(Status.UNKNOWN_PEER, f"sender {v.sender!r} has not completed a handshake")
        key = (v.group_id, v.round_id)
        if self.membership is not None:
            self.membership.heard(v.sender, time.monotonic(), revive=False)
        if not v.commit:
            rnd = self.rounds.get(key)
            # whatever view it ran in, a member of ours that gave the round up will not help finish it
            if rnd is not None and v.sender in self.rounds.members_of(key):
                rnd.fail(f"{v.sender} reports the round failed there")
        self._commits.record(v)

    def _send_vote(self, node: str, key: tuple[int, int], vid: int, commit: bool) -> Coroutine[Any, Any, None] | None:
        link = self._links.get(node)
        if link is None:
            return None
        return link.vote(key[0], key[1], vid, commit, self.config.transport.rpc_deadline_s)

    def _is_alive(self, node: str) -> bool:
        return self.membership is None or self.membership.is_alive(node)

    def set_training_info(self, info: TrainingInfo) -> None:
        """What this node trains and at which step, as its Status reports it (replaced whole)."""
        self.training = info
        self._progress_at = time.monotonic()

    def set_state_donor(self, donor: Any) -> None:
        """Serve this node's training state to joining members through ``donor`` (None: not offered)."""
        self.state_donor = donor

    def set_resume_steps(self, steps: Sequence[int]) -> None:
        """Report the checkpoint steps a resuming node holds, so a restart wave can agree on one."""
        self.resume_steps = tuple(steps)

    def admit_from(self, round_id: int) -> None:
        """Take part in rounds again, from ``round_id`` on (a joiner that now holds the cluster's state)."""
        self.rounds.min_round_id = round_id
        self.ready = True

    def stand_aside(self) -> None:
        """Take part in no round until ``ready`` again (a node that turns out to be joining): refuse new frames
        (JOINING) and fail the frames already waiting here for a round we would never open, so the members'
        rounds fail now instead of at their deadline."""
        self.ready = False
        self.rounds.refuse_waiting(PeerError(Status.JOINING, "joining: no training state yet, so no part in rounds"))

    def admitted(self) -> dict[str, Hello]:
        """Every member whose handshake this process accepted (a copy)."""
        return self._admission.admitted()

    def is_admitted(self, sender: str) -> bool:
        """Whether ``sender`` completed a handshake with this process (gate for every non-handshake call)."""
        return self._admission.is_admitted(sender)

    def note_rejected(self, err: PeerError) -> None:
        self.frames_rejected += 1

    def note_probe(self, sender: str, nbytes: int) -> None:
        if self.membership is not None and self._admission.is_admitted(sender):
            self.membership.heard(sender, time.monotonic(), revive=False)
        link = self._links.get(sender)
        if link is not None:
            link.stats.bytes_received += nbytes

    def status(self) -> PeerStatus:
        return PeerStatus(
            node_id=self.config.node_id,
            cluster_id=self.config.cluster_id,
            protocol_version=PROTOCOL_VERSION,
            ring=tuple(p.node_id for p in self._ring),
            links=tuple(self.link_snapshots()),
            rounds_completed=self.rounds_completed,
            rounds_failed=self.rounds_failed,
            frames_rejected=self.frames_rejected,
            codecs=self.hello().codecs,
            uptime_s=time.monotonic() - self._started,
            training=self.training,
            resuming=self.resume_steps is not None,
            checkpoint_steps=self.resume_steps or (),
            contributions_refused=self.contributions_refused,
            live=self.view,
            view_id=view_id(self.view) if self.view else 0,
        )

    def link_snapshots(self) -> list[LinkSnapshot]:
        return [
            LinkSnapshot(
                peer=node,
                rtt_s=link.stats.rtt_s if link.stats.rtt_samples else 0.0,
                goodput_Bps=link.stats.goodput_Bps if link.stats.samples else 0.0,
                bytes_sent=link.stats.bytes_sent,
                bytes_received=link.stats.bytes_received,
                samples=link.stats.samples,
                chunk_bytes=link.chunk_bytes,
            )
            for node, link in self._links.items()
        ]

    def feedback_norm(self, group_id: int) -> float:
        """Norm of the error-feedback residuals carried into group ``group_id``'s next round (0 without)."""
        group = self._feedback.get(group_id)
        return group.residual_norm() if group is not None else 0.0

    @property
    def contributions_refused(self) -> int:
        """Rounds we took part in without our values (non-finite, or a norm jump): see `peer.guard`."""
        return self._guard.refused

    def link(self, node_id: str) -> Link:
        return self._links[node_id]

    def abort_rounds(self, reason: str) -> None:
        self.rounds.fail_open(reason)

    def set_rate_limit(self, rate_Bps: float | None) -> None:
        """Re-pace every outgoing link (WAN emulation); None removes the limit."""
        for link in self._links.values():
            link.set_rate_limit(rate_Bps)

    # ------------------------------------------------------------------ averaging

    async def allreduce(
        self,
        tensors: Sequence[torch.Tensor],
        group_id: int = 0,
        codec: str | RingCodecPlan | None = None,
        plan_version: int = 0,
        timeout: float | None = None,
        out: Sequence[torch.Tensor] | None = None,
        round_id: int | None = None,
        guard_norm: bool = True,
        error_feedback: bool = False,
    ) -> RoundResult:
        """Average ``tensors`` across the ring (a collective: every member must call it).

        The mean is written into ``out`` (same shapes) when given, else into ``tensors`` in place.
        ``guard_norm`` withholds a contribution whose norm jumps far above the group's usual one; turn it
        off for groups whose scale legitimately changes (control vectors). ``error_feedback`` carries what
        a lossy codec lost into the group's next round (`dreamp2p.collective.feedback`): for groups that
        average increments (pseudo-gradients), never parameters; every member must pass the same.
        Rounds of a group are numbered 1, 2, ... unless ``round_id`` is given: trainers pass ids derived
        from the step, so a peer restarted from a checkpoint meets the others on the same round ids.
        On failure raises :class:`RoundFailed` and leaves every tensor exactly as it was.

        A failed round (corrupted bytes, a member that died, members that disagreed about who is alive)
        failed on every member (all-or-none), so every member retries it the same way: once, at once,
        among the members alive then, under group id ``group_id | RETRY_GROUP_BIT``.
        """
        if not 0 <= group_id < RETRY_GROUP_BIT:
            raise ValueError(f"group_id must be in [0, 2**31), got {group_id}")
        retries = self.config.transport.round_retries
        for attempt in range(retries + 1):
            gid = group_id if attempt == 0 else group_id | RETRY_GROUP_BIT
            try:
                return await self._allreduce_once(
                    tensors, gid, codec, plan_version, timeout, out, round_id, guard_norm, error_feedback
                )
            except RoundFailed as exc:
                if attempt == retries or self._closing or round_id is None:
                    raise
                self.rounds_retried += 1
                # let failure detection look at every member once more, so the retry runs among the living
                await self._next_heartbeat()
                log.info("round %s failed (%s); retrying among %s", exc.key, exc.reason, ", ".join(self.view))
        raise AssertionError("unreachable")

    async def _allreduce_once(
        self,
        tensors: Sequence[torch.Tensor],
        group_id: int,
        codec: str | RingCodecPlan | None,
        plan_version: int,
        timeout: float | None,
        out: Sequence[torch.Tensor] | None,
        round_id: int | None,
        guard_norm: bool,
        error_feedback: bool = False,
    ) -> RoundResult:
        if not self._ring:
            raise RuntimeError("allreduce before connect(): no ring")
        t0 = time.perf_counter()
        # the ring re-forms among the members alive now; every frame carries this view's id
        members = tuple(p for p in self._ring if p.node_id in self.view) if self.view else self._ring
        vid = view_id([p.node_id for p in members])
        world = len(members)
        rank = [p.node_id for p in members].index(self.config.node_id)
        round_id = self.rounds.claim(group_id, round_id)
        key = (group_id, round_id)
        if isinstance(codec, RingCodecPlan):
            links, codec_obj = codec, get_codec(codec.allowed[0])
        else:
            links, codec_obj = None, get_codec(codec or self.config.codec)
        flat = _flatten(tensors)
        numel = flat.numel()
        if 0 < numel < world:
            # every ring segment must carry data: a member that takes no part (joining, gone) is noticed by the
            # refusal of the frames sent to it, which an empty segment never sends (the round would wait out
            # its deadline instead); every member pads alike, so layouts still agree
            flat = torch.cat([flat, flat.new_zeros(world - numel)])
        refusal = self._guard.check(group_id, flat, guard_norm)
        if refusal is not None:
            # the round goes on without us: we send zeros, marked as excluded, and receive the others' mean
            log.warning("round %s: not contributing: %s", key, refusal)
            flat.zero_()
        succ = members[(rank + 1) % world]
        pred = members[(rank - 1) % world]
        chunk_bytes, stream = 0, None
        if world > 1:
            chunk_bytes, stream = self._stream_to(succ.node_id, flat.numel(), world, codec_obj, timeout)
        spec = RoundSpec(
            group_id=group_id,
            round_id=round_id,
            plan_version=plan_version,
            rank=rank,
            world=world,
            node_id=self.config.node_id,
            predecessor=pred.node_id,
            codec=codec_obj,
            dtype=_dtype_of(tensors),
            zstd=self._zstd,
            chunk_elems=max(1, chunk_bytes // 4),
            max_payload=self.max_payload,
            contributes=refusal is None,
            view_id=vid,
            **_link_codec_fields(links, rank, world),
        )
        feedback = self._feedback_for(spec, flat.numel()) if error_feedback and world > 1 else None
        rnd = RingRound(spec, flat, stream, feedback)
        others = [p.node_id for p in members if p.node_id != self.config.node_id]
        early = self._commits.failed_before(key, others)
        if early is not None:  # a member gave this round up before it even opened here
            rnd.fail(f"{early} reports the round failed there")
        self.rounds.open(key, rnd, (p.node_id for p in members))
        limit = timeout or self.config.transport.round_timeout_s
        await self._settle(rnd, stream, vid, others, limit, t0)
        if feedback is not None:
            feedback.commit()
        _unflatten(flat[:numel], out if out is not None else tensors)
        self.rounds_completed += 1
        return RoundResult(
            group_id=group_id,
            round_id=round_id,
            seconds=time.perf_counter() - t0,
            bytes_sent=rnd.bytes_sent,
            bytes_received=rnd.bytes_received,
            elements=numel,
            codec=codec_obj.name,
            chunk_bytes=chunk_bytes,
            contributors=rnd.contributors,
            contributed=refusal is None,
        )

    def _feedback_for(self, spec: RoundSpec, numel: int) -> RoundFeedback:
        """This round's draft of its group's error-feedback residuals (see `dreamp2p.collective.feedback`).

        A retry continues its group's residuals; a new member list, rank or codec starts from zero.
        """
        layout = (spec.view_id, spec.rank, spec.rs_codec.name, spec.ag_codec.name)
        group = self._feedback.setdefault(spec.group_id & ~RETRY_GROUP_BIT, GroupFeedback())
        return group.begin(layout, numel)

    def _stream_to(
        self, succ: str, numel: int, world: int, codec: Codec, timeout: float | None
    ) -> tuple[int, OutboundStream]:
        """This round's chunk size, sized to the link's measured goodput, and a stream to our successor."""
        link = self._links[succ]
        seg_elems = max(s.length for s in split_segments(numel, world, codec.block))
        t = self.config.transport
        goodput = link.stats.goodput_Bps if link.stats.samples else math.nan
        chunk_bytes = choose_chunk_bytes(
            goodput, seg_elems * 4, world, min_bytes=t.chunk_min_bytes, max_bytes=t.chunk_max_bytes
        )
        link.chunk_bytes = chunk_bytes
        # a small round gains nothing from parallel streams and pays each one's setup
        wire = numel * 4 * 2 * (world - 1) / world
        nstreams = 1 if wire <= 4 * chunk_bytes else t.streams_per_link
        return chunk_bytes, link.open_stream(nstreams, timeout=timeout or t.round_timeout_s)

    async def _settle(
        self, rnd: RingRound, stream: OutboundStream | None, vid: int, others: Sequence[str], limit: float, t0: float
    ) -> None:
        """Run an opened round and agree on its outcome with ``others``; RoundFailed on any failure.

        ``limit`` seconds from ``t0`` (perf_counter) for both. All-or-none: the result counts only once
        every member of the view finished its part, and a failure here is announced to them, so they
        drop the round too. The round is closed either way.
        """
        key = rnd.spec.key
        try:
            await self._run(rnd, stream, limit)
            await self._commits.agree(key, vid, others, limit - (time.perf_counter() - t0))
        except (PeerError, TimeoutError, RoundAborted) as exc:
            rnd.fail(str(exc))
            self.rounds_failed += 1
            self._commits.announce(key, vid, others, commit=False)
            if isinstance(exc, PeerError) and exc.status == Status.VIEW_MISMATCH:
                log.info("round %s: members disagree about who is alive (%s); skipped", key, exc.detail)
            raise RoundFailed(key, str(exc) or type(exc).__name__) from None
        except BaseException:
            rnd.fail("cancelled")
            raise
        finally:
            self.rounds.close(key)
            self._commits.forget(key)

    async def _run(self, rnd: RingRound, out: OutboundStream | None, timeout: float) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        starter = asyncio.ensure_future(rnd.start())
        waiters: list[asyncio.Future[None]] = [rnd.done, starter]
        failed = None
        if out is not None:
            failed = out.failed()
            waiters.append(failed)
        try:
            while not (rnd.done.done() and starter.done()):
                left = deadline - loop.time()
                if left <= 0:
                    raise TimeoutError(f"round did not finish within {timeout:.1f} s")
                done, _ = await asyncio.wait(waiters, timeout=left, return_when=asyncio.FIRST_COMPLETED)
                for fut in done:
                    if fut.cancelled():  # a part of the round, not our caller, was cancelled: it cannot finish
                        raise RoundAborted("a part of the round was cancelled")
                    exc = fut.exception()
                    if exc is not None:
                        raise exc if isinstance(exc, PeerError | RoundAborted) else RoundAborted(str(exc))
                waiters = [w for w in waiters if not w.done()]
            if out is not None:
                await asyncio.wait_for(out.close(), max(0.1, deadline - loop.time()))
        finally:
            if not starter.done():
                starter.cancel()
                await asyncio.wait({starter})  # our own cancellation still propagates
            if not starter.cancelled():
                starter.exception()
            if failed is not None and not failed.done():
                failed.cancel()
            elif failed is not None and not failed.cancelled():
                failed.exception()
            if rnd.done.done() and not rnd.done.cancelled():
                rnd.done.exception()

    # ------------------------------------------------------------------ liveness

    async def _heartbeat_loop(self) -> None:
        t = self.config.transport
        while True:
            await asyncio.sleep(t.heartbeat_s)
            assert self.membership is not None
            await beat_once(self._links, self.membership, max(0.5, 2 * t.heartbeat_s), self._reintroduce)
            self._set_view(self.membership.view())
            self.heartbeat_rounds += 1
            done, self._beat = self._beat, asyncio.Event()
            done.set()

    async def _reintroduce(self, link: Link) -> Hello:
        return await link.handshake(self.hello(), self.config.transport.rpc_deadline_s)

    async def _next_heartbeat(self) -> None:
        """Wait until the heartbeat loop has checked every member once more (no wait without heartbeats)."""
        t = self.config.transport
        if self._heart is None or self._heart.done():
            return
        tick = self._beat
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(tick.wait(), t.heartbeat_s + max(0.5, 2 * t.heartbeat_s) + 1.0)

    def mark_unreachable(self, node: str) -> None:
        """Take ``node`` out of our view now, as a refused heartbeat would; a later answer brings it back.

        Rounds that need it fail at once. For an operator or a caller that learned of the loss first
        (and for tests that partition the view on one member only).
        """
        if self.membership is None:
            raise RuntimeError("mark_unreachable before connect: there is no membership yet")
        self.membership.missed(node, time.monotonic(), fatal=True)
        self._set_view(self.membership.view())

    def _set_view(self, view: tuple[str, ...]) -> None:
        if view == self.view:
            return
        self.view = view
        self.view_changes += 1
        log.info("members alive: %s", ", ".join(view))
        self.rounds.fail_without(view)

    async def probe_now(self, burst_bytes: int | None = None) -> list[LinkSnapshot]:
        """Measure every link once (RTT echo + burst) and return the snapshots."""
        await probe_once(self._links.values(), burst_bytes or self.config.transport.probe_burst_bytes)
        return self.link_snapshots()


def _flatten(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    if not tensors:
        return torch.empty(0, dtype=torch.float32)
    for i, t in enumerate(tensors):
        if not t.is_floating_point():
            raise TypeError(f"tensor {i} has dtype {t.dtype}; only floating-point tensors can be averaged")
    return torch.cat([t.detach().reshape(-1).to(device="cpu", dtype=torch.float32) for t in tensors])


def _unflatten(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    offset = 0
    with torch.no_grad():
        for t in tensors:
            n = t.numel()
            t.copy_(flat[offset : offset + n].view(t.shape))
            offset += n


def _dtype_of(tensors: Sequence[torch.Tensor]) -> DType:
    dtypes = {t.dtype for t in tensors}
    if dtypes == {torch.float16}:
        return DType.FP16
    if dtypes == {torch.bfloat16}:
        return DType.BF16
    return DType.FP32


def _link_codec_fields(links: RingCodecPlan | None, rank: int, world: int) -> dict[str, Any]:
    """RoundSpec fields for per-link codecs: our link's send codec, the all-gather codec, what we accept.

    The choice was made for a ring of ``len(links.send)``; in a ring of another size (a member left or
    came back since) we send with the base codec until the next choice, but still accept every allowed
    codec, so members that disagree about the choice still finish the round.
    """
    if links is None:
        return {}
    fitting = len(links.send) == world
    return {
        "send_codec": get_codec(links.send[rank]) if fitting else None,
        "gather_codec": get_codec(links.gather) if fitting else None,
        "allowed_codecs": tuple(get_codec(c).wire_id for c in links.allowed),
    }
