"""The asyncio gRPC peer: a thin facade over the parts of a node's networking half.

One Peer lives on one event loop. It owns the gRPC server (see `transport.server` for the thin
servicer, which calls the methods below) and wires its parts together: the links to the ring, the
handshakes and the active probe (`links.py`, `probing.py`), admission of the members' handshakes
(`admission.py`), what members send us (`inbound.py`), liveness and the view of live members
(`liveness.py`, one heartbeat round in `heartbeat.py`), the round registry (`rounds.py`), the commit
votes (`commit.py`), the ring-round engine behind `allreduce` (`roundrun.py`), the check for a plan missed
across a partition (`drift.py`) and the health state and status (`health.py`).

Membership: each round runs among the members alive when it starts (its view, whose id every frame
carries), so the ring re-forms among survivors at the next round. Rounds are all-or-none: a member that
finished its part sends a commit vote to every other member and applies the result only once every
member's commit arrived; a member whose round failed votes "failed" and the others give up at once. A
round that fails leaves every tensor as it was, on every member.

Joining: a joining node answers heartbeats from the start, but while it starts up (connects, builds its
strategy) its answers say it is out of the ring (``in_ring`` False), so the members count it alive and run
their rounds without it. Once it asks in (`Peer.ask_in`, just before it requests the state) they run their
rounds among a view that includes it; until it holds the cluster's state (``ready``) it refuses their frames
at once (JOINING), so all those rounds fail everywhere: no plan decision or average is made without it
between the members' state snapshot and its first step (see Node.join). Afterwards it refuses rounds from
before the step it starts at.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from grpc import aio

from dreamp2p.config import PeerConfig, PeerInfo
from dreamp2p.errors import PeerError, Status
from dreamp2p.messages import (
    PROTOCOL_VERSION,
    Frame,
    Hello,
    LinkSnapshot,
    MemberProgress,
    PeerStatus,
    RingCodecPlan,
    RoundResult,
    TrainingInfo,
    Vote,
)
from dreamp2p.peer.admission import Admission, address_of, hello_of
from dreamp2p.peer.commit import CommitVotes
from dreamp2p.peer.drift import DriftWatch, LeadingStep
from dreamp2p.peer.health import NodeHealth
from dreamp2p.peer.inbound import JOINING, Inbound, gate
from dreamp2p.peer.links import RingLinks
from dreamp2p.peer.liveness import Liveness
from dreamp2p.peer.membership import Membership, view_id
from dreamp2p.peer.roundrun import RETRY_GROUP_BIT, RoundRunner
from dreamp2p.peer.rounds import RoundRegistry
from dreamp2p.peer.straggler import rule_of, shared_settings
from dreamp2p.transport.client import Link
from dreamp2p.transport.linkrate.probeburst import MAX_PROBE_BYTES  # larger probes are refused
from dreamp2p.transport.server import build_server

__all__ = ["MAX_PROBE_BYTES", "RETRY_GROUP_BIT", "Peer"]

log = logging.getLogger(__name__)


class PeerCounters:
    """The counters a `Peer` reports, each read from the part that keeps it: its Status carries some, tests
    count time and events in them. Only a base of `Peer`, which holds the parts."""

    _inbound: Inbound
    _engine: RoundRunner
    _live: Liveness
    _health: NodeHealth

    @property
    def frames_rejected(self) -> int:
        return self._inbound.rejected

    @property
    def rounds_completed(self) -> int:
        return self._engine.completed

    @property
    def rounds_failed(self) -> int:
        return self._engine.failed

    @property
    def rounds_retried(self) -> int:
        return self._engine.retried

    @property
    def contributions_refused(self) -> int:
        """Rounds we took part in without our values (non-finite, or a norm jump): see `peer.guard`."""
        return self._engine.contributions_refused

    @property
    def heartbeat_rounds(self) -> int:
        """Heartbeat ticks so far: tests count time in them."""
        return self._live.heartbeat_rounds

    @property
    def view_changes(self) -> int:
        return self._live.view_changes

    @property
    def health_publications(self) -> int:
        """Passes of the health loop (each publishes the status); 0 without a health listener."""
        return self._health.publications


class Peer(PeerCounters):
    """A node's networking half. Use ``async with Peer(cfg) as peer`` or start/close explicitly."""

    def __init__(self, config: PeerConfig) -> None:
        self.config = config
        self.max_probe_bytes = MAX_PROBE_BYTES
        self._server: aio.Server | None = None
        self.port = 0
        # whose handshakes we accepted, and the members we refused for their model or settings: our own
        # handshakes with those fail at once with the same words (see RingLinks.introduce)
        self._admission = Admission()
        self._links = RingLinks(config, self._admission)
        self.rounds = RoundRegistry(config.transport.round_timeout_s)
        # the highest step a live member is at: the cluster's step clock for time-paced periods
        self.lead = LeadingStep()
        self.rounds.on_early = lambda round_id: self.lead.launched(round_id - 1)
        # a view change fails at once the rounds that need a member that is gone
        self._live = Liveness(
            config.node_id,
            config.transport,
            self._links.by_node,
            self._reintroduce,
            self.rounds.fail_without,
            after_tick=self._check_drift,
        )
        self._commits = CommitVotes(config.node_id, self._links.send_vote, self._live.is_alive)
        parts = (self._links, self._live, self.rounds, self._commits)
        self._engine = RoundRunner(config, *parts, lambda: self._closing, lambda: self.diverged)
        self.max_payload = self._engine.max_payload
        self._inbound = Inbound(
            config, self._admission, *parts, lambda: gate(self._closing, self.ready), self.max_payload
        )
        self._health = NodeHealth(config.node_id, config.health_listen, config.health_stall_s, self.health)
        self._started = time.monotonic()
        self._closing = False
        # set by the trainer's thread; replaced whole (never mutated), so readers see a consistent value
        self.training: TrainingInfo | None = None
        # set by a node that resumed: the checkpoint steps it held, so a restart wave can agree on one
        self.resume_steps: tuple[int, ...] | None = None
        # serves this node's training state to joining members (see `dreamp2p.state`); None: not offered
        self.state_donor: Any = None
        # a joiner starts out of the ring and not ready (see the module docstring)
        self.ready = True
        self.in_ring = True
        # training settings every member must share (see `dreamp2p.settings`); empty until declared
        self._settings: tuple[tuple[str, str], ...] = ()
        # the members whose plan we missed (a healed partition, see `peer.drift`): we stand aside until the
        # trainer took their state and admits us again; replaced whole, so other threads may read it
        self.diverged: tuple[str, ...] = ()
        self.on_diverged: Callable[[tuple[str, ...]], None] | None = None  # told when it is set
        self._drift = DriftWatch(config.transport.heartbeat_s)

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> int:
        self._server, self.port = build_server(self.config, self)
        await self._server.start()
        log.info("%s listening on port %d", self.config.node_id, self.port)
        await self._health.start()
        return self.port

    def health(self, now: float | None = None) -> tuple[bool, str]:
        """Whether this node is serving, and why not: joining, shutting down, draining, or its trainer stalled."""
        return self._health.of(self._closing, self.ready, self.training is not None, now)

    @property
    def health_port(self) -> int:
        """The port of the health listener (grpc.health.v1); 0 without one."""
        return self._health.port

    @property
    def address(self) -> str:
        return address_of(self.config, self.port)

    def hello(self) -> Hello:
        return hello_of(self.config, self.address, self._settings)

    async def connect(
        self, ring: Sequence[PeerInfo] | None = None, timeout: float | None = None, require_all: bool = True
    ) -> None:
        """Adopt the ring (config order by default), handshake with every other member (``require_all``: see
        `RingLinks.connect`), then keep the view current (heartbeats) and the links measured (the probe)."""
        cfg = self.config
        ring = ring if ring is not None else cfg.ring
        limit = timeout if timeout is not None else cfg.transport.connect_timeout_s
        unreachable = await self._links.connect(ring, self.hello(), limit, require_all)
        self._live.begin([p.node_id for p in self.ring], unreachable)
        if (nobody := self._links.none_answered(unreachable)) is not None:
            raise nobody
        self._links.start_probing()
        if len(self.ring) > 1:
            self._live.start_heartbeats()

    async def agree(self, settings: dict[str, str], timeout: float) -> None:
        """Declare our training settings and check them against every live member's, before training (how:
        `RingLinks.agree`); the straggler rule is among them, so every member judges stragglers alike."""
        settings = {**settings, **shared_settings(rule_of(self.config.transport))}
        self._settings = tuple(sorted(settings.items()))
        await self._links.agree(settings, self.view, self.hello, timeout)

    async def close(self, grace: float = 2.0) -> None:
        """Stop probing, fail rounds in flight, stop the server with ``grace`` seconds, close channels."""
        self._closing = True
        await self._health.publish()  # probes see NOT_SERVING while we drain
        await self._links.stop_probing()
        await self._live.stop()
        await self._health.stop_loop()
        self.rounds.fail_open("peer shutting down")
        self.rounds.refuse_waiting(PeerError(Status.SHUTTING_DOWN, "peer shutting down"))
        if self._server is not None:
            await self._server.stop(grace)
            self._server = None
        await self._links.close()
        await self._health.stop(grace)

    async def __aenter__(self) -> Peer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ------------------------------------------------------------------ server backend

    def admit(self, hello: Hello) -> Hello:
        """Accept a member's handshake (PeerError saying why not) and answer with our own hello."""
        return self._inbound.admit(hello, self.hello())

    async def accept_frame(self, frame: Frame) -> None:
        await self._inbound.accept_frame(frame)

    def stream_broken(self, sender: str, keys: set[tuple[int, int]], reason: str) -> None:
        self._inbound.stream_broken(sender, keys, reason)

    def vote(self, v: Vote) -> None:
        """A member's outcome of a round (see the module docstring): recorded, and a failure ends ours."""
        self._inbound.vote(v)

    def note_rejected(self, err: PeerError) -> None:
        self._inbound.note_rejected(err)

    def note_probe(self, sender: str, nbytes: int) -> None:
        self._inbound.note_probe(sender, nbytes)

    def admitted(self) -> dict[str, Hello]:
        """Every member whose handshake this process accepted (a copy)."""
        return self._admission.admitted()

    def is_admitted(self, sender: str) -> bool:
        """Whether ``sender`` completed a handshake with this process (gate for every non-handshake call)."""
        return self._admission.is_admitted(sender)

    def failed_vote(self, key: tuple[int, int], members: Sequence[str]) -> str | None:
        """A member of ``members`` whose vote that round ``key`` failed is recorded here, if any (read only)."""
        return self._commits.failed_before(key, members)

    def status(self) -> PeerStatus:
        return status_of(self, time.monotonic() - self._started)

    # ------------------------------------------------------------------ the trainer's side

    def set_training_info(self, info: TrainingInfo) -> None:
        """What this node trains and at which step, as its Status reports it (replaced whole)."""
        self.training = info
        self._health.stepped()
        self._check_drift()

    def progress(self) -> MemberProgress | None:
        """Our training progress as our heartbeat answers carry it (None until a trainer reports)."""
        return None if self.training is None else self.training.progress()

    def out_of_ring(self) -> bool:
        """Whether our heartbeat answers ask the members to leave us out of their rounds (a joiner starting)."""
        return not self.in_ring

    async def ask_in(self, timeout: float) -> None:
        """A joiner about to take the members' state: be counted in their rounds from now on.

        Our heartbeat answers stop saying we are joining, and every member is introduced to again, which
        makes it echo us at once (`Liveness.welcome`) instead of at its next heartbeat tick. Members that do
        not answer within ``timeout`` learn it from their next echo.
        """
        self.in_ring = True
        await self._links.handshake_all(self.hello(), timeout, require_all=False)

    def _check_drift(self) -> None:
        """Stand aside if live members train with a plan we should have adopted and did not, or are further
        ahead than we can catch up with (`peer.drift`); checked after every step and every heartbeat tick.

        Our open rounds fail and the frames waiting here are refused, so neither side waits for a round that
        cannot complete; the trainer then takes the state of the members ahead (`Node.resync`) and admits us
        again."""
        others = self._links.progress_of(self.view)
        self.lead.heard(others)
        if not self.ready or self.diverged or self._closing:
            return
        ahead = self._drift.ahead(self.training, others)
        if not ahead:
            return
        self.diverged = ahead
        self.stand_aside()
        self.rounds.fail_open(f"this node missed the plan of {', '.join(ahead)} and takes their state")
        if self.on_diverged is not None:
            self.on_diverged(ahead)

    def set_state_donor(self, donor: Any) -> None:
        """Serve this node's training state to joining members through ``donor`` (None: not offered)."""
        self.state_donor = donor

    def set_resume_steps(self, steps: Sequence[int]) -> None:
        """Report the checkpoint steps a resuming node holds, so a restart wave can agree on one."""
        self.resume_steps = tuple(steps)

    def admit_from(self, round_id: int) -> None:
        """Take part in rounds again, from ``round_id`` on (a joiner that now holds the cluster's state)."""
        self.rounds.admit_from(round_id)
        self.ready = True
        self.diverged = ()

    def begin_drain(self) -> None:
        """The node is stopping after its rounds in flight: health turns NOT_SERVING (rounds still run)."""
        self._health.begin_drain()

    def stand_aside(self) -> None:
        """Take part in no round until ``ready`` again (a node that turns out to be joining): refuse new frames
        (JOINING) and fail the frames already waiting here for a round we would never open, so the members'
        rounds fail now instead of at their deadline."""
        self.ready = False
        self.rounds.refuse_waiting(PeerError(Status.JOINING, JOINING))

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
        """Average ``tensors`` across the ring (a collective: every member must call it); see
        `RoundRunner.allreduce` for each argument, the all-or-none outcome, the one retry and why a round
        fails at once while we stand aside (``diverged``)."""
        return await self._engine.allreduce(
            tensors, group_id, codec, plan_version, timeout, out, round_id, guard_norm, error_feedback
        )

    def abort_rounds(self, reason: str) -> None:
        self.rounds.fail_open(reason)

    def feedback_norm(self, group_id: int) -> float:
        """Norm of the error-feedback residuals carried into group ``group_id``'s next round (0 without)."""
        return self._engine.feedback_norm(group_id)

    def link(self, node_id: str) -> Link:
        return self._links.link(node_id)

    # ------------------------------------------------------------------ links and liveness

    @property
    def ring(self) -> tuple[PeerInfo, ...]:
        return self._links.ring

    @property
    def membership(self) -> Membership | None:
        return self._live.membership

    @property
    def view(self) -> tuple[str, ...]:
        """Live members in ring order; replaced whole on every change, so other threads may read it."""
        return self._live.view

    def mark_unreachable(self, node: str) -> None:
        """Take ``node`` out of our view now (see `Liveness.mark_unreachable`); a later answer brings it back."""
        self._live.mark_unreachable(node)

    async def _reintroduce(self, link: Link) -> Hello:
        return await link.handshake(self.hello(), self.config.transport.rpc_deadline_s)

    def link_snapshots(self) -> list[LinkSnapshot]:
        return self._links.snapshots()

    def set_rate_limit(self, rate_Bps: float | None) -> None:
        """Re-pace every outgoing link (WAN emulation); None removes the limit."""
        self._links.set_rate_limit(rate_Bps)

    async def probe_now(self, burst_bytes: int | None = None) -> list[LinkSnapshot]:
        """Measure every link once (RTT echo + burst) and return the snapshots."""
        return await self._links.probe_now(burst_bytes)


def status_of(peer: Peer, uptime_s: float) -> PeerStatus:
    """The answer to a Status call: who we are, our links, our counters, the trainer's progress."""
    stragglers = peer._live.stragglers  # who sits out the rounds as a straggler (see peer.straggler)
    return PeerStatus(
        node_id=peer.config.node_id,
        cluster_id=peer.config.cluster_id,
        protocol_version=PROTOCOL_VERSION,
        ring=tuple(p.node_id for p in peer.ring),
        links=tuple(peer.link_snapshots()),
        rounds_completed=peer.rounds_completed,
        rounds_failed=peer.rounds_failed,
        frames_rejected=peer.frames_rejected,
        codecs=peer.hello().codecs,
        uptime_s=uptime_s,
        training=peer.training,
        resuming=peer.resume_steps is not None,
        checkpoint_steps=peer.resume_steps or (),
        contributions_refused=peer.contributions_refused,
        live=peer.view,
        view_id=view_id(peer.view) if peer.view else 0,
        excluded=tuple(p.node_id for p in peer.ring if stragglers is not None and p.node_id in stragglers.excluded),
        straggler_evictions=stragglers.evictions if stragglers is not None else 0,
        straggler_returns=stragglers.returns if stragglers is not None else 0,
    )
