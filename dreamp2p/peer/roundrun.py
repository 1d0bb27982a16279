"""The ring-round engine: one `allreduce` from flattening the tensors to the all-or-none commit.

A round runs among the members alive when it starts (its view, whose id every frame carries): the
tensors are flattened, checked by the contribution guard (`peer.guard`), sent around the ring of
`collective.ring` in chunks sized to the successor link's goodput (`collective.chunking`), and the
result is written back only once every member voted commit (`peer.commit`). A failed round leaves every
tensor as it was and is retried once, among the members alive then, under a retry group id. A member
that gave a round up after voting commit (a member's commit late, or a member wrongly thought gone) may
be the only one that did: a member that refuses its retry as completed there tells it so, and it applies
its own result of the round then (`Undecided`), so the replicas stay identical; so it does when every other
member left meanwhile (a run's last round), rather than retry among itself alone.

The engine asks the peer's parts through their methods: the ring and a link from `RingLinks`, who is
alive and the next heartbeat tick from `Liveness`, from callables whether the peer stands aside (no round
runs then) or closes (a failed round is not retried then either); it owns the guard, the error-feedback
residuals and the round counters. Runs on the peer's event loop only.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from dreamp2p.collective.chunking import choose_chunk
from dreamp2p.collective.feedback import GroupFeedback, RoundFeedback
from dreamp2p.collective.gather import GatherRound, gathers
from dreamp2p.collective.partition import split_segments
from dreamp2p.collective.ring import RingRound, RoundAborted, RoundSpec
from dreamp2p.compression import Codec, ZstdStage, get_codec
from dreamp2p.config import PeerConfig, PeerInfo
from dreamp2p.errors import PeerError, RoundFailed, Status
from dreamp2p.messages import DType, RingCodecPlan, RoundEvidence, RoundResult
from dreamp2p.peer.commit import CommitVotes, Undecided
from dreamp2p.peer.guard import ContributionGuard
from dreamp2p.peer.links import RingLinks
from dreamp2p.peer.liveness import Liveness
from dreamp2p.peer.membership import view_id
from dreamp2p.peer.rounds import RETRY_GROUP_BIT, RoundRegistry
from dreamp2p.transport.outbound import OutboundStream

log = logging.getLogger(__name__)


class RoundRunner:
    """Runs a node's all-reduce rounds: the guard, the error-feedback residuals and the counters."""

    def __init__(
        self,
        config: PeerConfig,
        links: RingLinks,
        live: Liveness,
        rounds: RoundRegistry,
        commits: CommitVotes,
        closing: Callable[[], bool],
        diverged: Callable[[], tuple[str, ...]],
    ) -> None:
        self.config = config
        self.max_payload = config.transport.max_message_bytes - (64 << 10)
        self.completed = 0
        self.failed = 0
        self.retried = 0
        self._links = links
        self._live = live
        self._closing = closing  # the peer shuts down
        # the live members whose state the peer takes (see Peer.diverged): no round runs meanwhile
        self._diverged = diverged
        self._rounds = rounds
        self._commits = commits
        self._zstd = ZstdStage(config.transport.zstd_level) if config.transport.zstd else None
        self._guard = ContributionGuard(config.max_norm_ratio)
        # error-feedback residuals per group (base group id), with the plan version of the group's last round
        self._feedback: dict[int, tuple[int, GroupFeedback]] = {}

    def members(self) -> tuple[PeerInfo, ...]:
        """The ring's members alive now, in ring order (the whole ring before the first view)."""
        ring, view = self._links.ring, self._live.view
        return tuple(p for p in ring if p.node_id in view) if view else ring

    @property
    def contributions_refused(self) -> int:
        """Rounds we took part in without our values (non-finite, or a norm jump): see `peer.guard`."""
        return self._guard.refused

    def feedback_norm(self, group_id: int) -> float:
        """Norm of the error-feedback residuals carried into group ``group_id``'s next round (0 without)."""
        entry = self._feedback.get(group_id)
        return entry[1].residual_norm() if entry is not None else 0.0

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

        While the peer stands aside to take the members' state (``diverged``), a round fails here at once: it
        could only wait for frames no member sends (they run other rounds), up to its deadline.
        """
        if aside := self._diverged():
            raise RoundFailed((group_id, round_id or 0), f"standing aside to take the state of {', '.join(aside)}")
        if not 0 <= group_id < RETRY_GROUP_BIT:
            raise ValueError(f"group_id must be in [0, 2**31), got {group_id}")
        retries = self.config.transport.round_retries
        undecided: Undecided | None = None
        for attempt in range(retries + 1):
            gid = group_id if attempt == 0 else group_id | RETRY_GROUP_BIT
            self._live.refresh()  # a straggler whose probation ended takes part from this round on
            view = self._live.view
            try:
                result = await self._allreduce_once(
                    tensors, gid, codec, plan_version, timeout, out, round_id, guard_norm, error_feedback
                )
            except RoundFailed as exc:
                if undecided is not None and exc.status == Status.ROUND_COMPLETED:
                    # a member applied the round we gave up: every member had voted commit, so ours is final
                    log.info("round %s: %s; applying our result of it too", undecided.key, exc.reason)
                    return undecided.land()
                if isinstance(exc, Undecided) and attempt == 0:
                    undecided = exc
                if attempt == retries or self._no_retry() or round_id is None:
                    raise
                self.retried += 1
                # a member left during the round (the view changed, which failed it): retry among the
                # survivors now; otherwise let failure detection look at every member once more first
                if self._live.view == view:
                    await self._live.next_heartbeat()
                    if self._no_retry():  # it may have begun while we waited
                        raise
                if undecided is not None and [p.node_id for p in self.members()] == [self.config.node_id]:
                    # alone, a retry would apply our own values where the members gone may have applied the
                    # round (a run's last round: they commit and leave); our result of it has everyone's
                    log.info("round %s: the others left after it; applying our result of it", undecided.key)
                    return undecided.land()
                log.info("round %s failed (%s); retrying among %s", exc.key, exc.reason, ", ".join(self._live.view))
            else:
                return result if undecided is None else undecided.widen(result)
        raise AssertionError("unreachable")

    def _no_retry(self) -> bool:
        """A failed round is not retried while the peer shuts down, or stands aside to take the members'
        state (a retry could only wait for frames nobody sends)."""
        return self._closing() or bool(self._diverged())

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
        # the ring re-forms among the members alive now; every frame carries this view's id
        members = self.members()
        if not members:
            raise RuntimeError("allreduce before connect(): no ring")
        t0 = time.perf_counter()
        vid = view_id([p.node_id for p in members])
        world = len(members)
        rank = [p.node_id for p in members].index(self.config.node_id)
        round_id = self._rounds.claim(group_id, round_id)
        key = (group_id, round_id)
        links, codec_obj = _resolve_codec(codec, self.config.codec)
        flat, numel = _flatten(tensors, world)
        refusal = self._guard.check(group_id, flat, guard_norm)
        if refusal is not None:
            # the round goes on without us: we send zeros, marked as excluded, and receive the others' mean
            log.warning("round %s: not contributing: %s", key, refusal)
            flat.zero_()
        succ = members[(rank + 1) % world]
        pred = members[(rank - 1) % world]
        link_fields = _link_codec_fields(links, rank, world)
        chunk_elems, chunk_bytes, stream = (
            self._stream_to(succ.node_id, flat.numel(), world, codec_obj, link_fields, timeout)
            if world > 1
            else (1, 0, None)
        )
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
            chunk_elems=chunk_elems,
            max_payload=self.max_payload,
            contributes=refusal is None,
            view_id=vid,
            **link_fields,
        )
        feedback = self._feedback_for(spec, flat.numel()) if error_feedback and world > 1 else None
        rnd = (GatherRound if gathers(spec) else RingRound)(spec, flat, stream, feedback)
        others = [p.node_id for p in members if p.node_id != self.config.node_id]
        early = self._commits.failed_before(key, others)
        if early is not None:  # a member gave this round up before it even opened here
            rnd.fail(f"{early} reports the round failed there")
        self._rounds.open(key, rnd, (p.node_id for p in members))
        limit = timeout or self.config.transport.round_timeout_s

        def land() -> RoundResult:
            """Apply the round's result: every member voted commit."""
            if feedback is not None:
                feedback.commit()
            _unflatten(flat[:numel], out if out is not None else tensors)
            self.completed += 1
            if not group_id & RETRY_GROUP_BIT:  # a retry may run among fewer members: it tells nothing
                self._rounds.note_completion(key)
            return _result(rnd, numel, chunk_bytes, members, t0)

        try:
            await self._settle(rnd, stream, vid, others, limit, t0)
        except Undecided as exc:
            exc.land = land
            exc.members = tuple(p.node_id for p in members)
            raise
        return land()

    def _feedback_for(self, spec: RoundSpec, numel: int) -> RoundFeedback:
        """This round's draft of its group's error-feedback residuals (see `dreamp2p.collective.feedback`).

        A retry continues its group's residuals; a new member list, rank or codec starts from zero. Groups of
        plan versions other than this round's and the one before are dropped: a new plan's syncs are new
        groups, so those residuals would never be continued, and each re-plan would keep a model's worth.
        """
        kept = (spec.plan_version, spec.plan_version - 1)
        self._feedback = {g: entry for g, entry in self._feedback.items() if entry[0] in kept}
        gid = spec.group_id & ~RETRY_GROUP_BIT
        group = self._feedback[gid][1] if gid in self._feedback else GroupFeedback()
        self._feedback[gid] = (spec.plan_version, group)
        return group.begin((spec.view_id, spec.rank, spec.rs_codec.name, spec.ag_codec.name), numel)

    def _stream_to(
        self, succ: str, numel: int, world: int, codec: Codec, link_fields: dict[str, Any], timeout: float | None
    ) -> tuple[int, int, OutboundStream]:
        """This round's chunk size (elements, wire bytes), sized to the link's measured goodput, and a
        stream to our successor.

        Sized in wire bytes (`choose_chunk`): the least compressive codec we may send with in this round
        (``codec``, or our link's codecs in ``link_fields``) bounds a frame's size.
        """
        link = self._links.link(succ)
        codecs = [codec, *(link_fields.get(k) or codec for k in ("send_codec", "gather_codec"))]
        ratio = max(c.wire_ratio() for c in codecs)
        seg_elems = max(s.length for s in split_segments(numel, world, codecs[0].block))
        t = self.config.transport
        goodput = link.stats.goodput_Bps if link.stats.samples else math.nan
        chunk_elems, chunk_bytes = choose_chunk(
            goodput, seg_elems, world, ratio, min_bytes=t.chunk_min_bytes, max_bytes=t.chunk_max_bytes
        )
        link.chunk_bytes = chunk_bytes
        # a small round gains nothing from parallel streams and pays each one's setup
        wire = numel * 4 * ratio * 2 * (world - 1) / world
        nstreams = 1 if wire <= 4 * chunk_bytes else t.streams_per_link
        return chunk_elems, chunk_bytes, link.open_stream(nstreams, timeout=timeout or t.round_timeout_s)

    async def _settle(
        self, rnd: RingRound, stream: OutboundStream | None, vid: int, others: Sequence[str], limit: float, t0: float
    ) -> None:
        """Run an opened round and agree on its outcome with ``others``; RoundFailed on any failure.

        ``limit`` seconds from ``t0`` (perf_counter) for both. All-or-none: the result counts only once
        every member of the view finished its part, and a failure here is announced to them, so they
        drop the round too. The round is closed either way.
        """
        key = rnd.spec.key
        voted = False
        try:
            await _run(rnd, stream, limit)
            self._commits.attach(key, self._evidence(rnd, others, t0))
            voted = True
            await self._commits.agree(key, vid, others, limit - (time.perf_counter() - t0))
            votes = self._commits.votes(key)
            evidence = {n: votes[n].evidence for n in others if n in votes}
            evidence[self.config.node_id] = self._commits.evidence(key)
        except (PeerError, TimeoutError, RoundAborted) as exc:
            failed = self._failed(rnd, vid, others, exc)
            if voted:  # a member may hold every commit, ours among them, and have applied the round
                raise Undecided(key, failed.reason) from None
            raise failed from None
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is None or task.cancelling():
                rnd.fail("cancelled")
                raise
            # a part of the round was cancelled beneath it, not our caller: a failed round like any other,
            # so the trainer skips it on every member instead of meeting a bare CancelledError
            log.warning("round %s: a part of it was cancelled beneath it", key, exc_info=True)
            raise self._failed(rnd, vid, others, RoundAborted("a part of the round was cancelled")) from None
        except BaseException:
            rnd.fail("cancelled")
            raise
        finally:
            self._rounds.close(key)
            self._commits.forget(key)
        # every member of the round holds the same evidence now (all-or-none), so judges it alike
        self._live.judge(evidence)

    def _failed(self, rnd: RingRound, vid: int, others: Sequence[str], exc: Exception) -> RoundFailed:
        """Give up ``rnd`` here and tell ``others`` (all-or-none: they drop it too); the error to raise."""
        key = rnd.spec.key
        rnd.fail(str(exc))
        self.failed += 1
        deadline = isinstance(exc, TimeoutError) or (isinstance(exc, PeerError) and exc.status == Status.TIMEOUT)
        self._rounds.note_failure(key, str(exc) or type(exc).__name__, deadline=deadline)
        self._commits.announce(key, vid, others, commit=False)
        if isinstance(exc, PeerError) and exc.status == Status.VIEW_MISMATCH:
            log.info("round %s: members disagree about who is alive (%s); skipped", key, exc.detail)
        return RoundFailed(key, str(exc) or type(exc).__name__, exc.status if isinstance(exc, PeerError) else None)

    def _evidence(self, rnd: RingRound, others: Sequence[str], t0: float) -> RoundEvidence:
        """What we measured of our part of ``rnd``: bytes sent, our link's rate to our successor, seconds."""
        rate = 0.0
        if others:
            stats = self._links.link(others[rnd.spec.rank % len(others)]).stats
            rate = stats.goodput_Bps if stats.samples and math.isfinite(stats.goodput_Bps) else 0.0
        return RoundEvidence(rnd.bytes_sent, rate, time.perf_counter() - t0)


def _resolve_codec(codec: str | RingCodecPlan | None, default: str) -> tuple[RingCodecPlan | None, Codec]:
    """A round's per-link codec plan (None for one codec on every link) and its base codec."""
    if isinstance(codec, RingCodecPlan):
        return codec, get_codec(codec.allowed[0])
    return None, get_codec(codec or default)


def _result(rnd: RingRound, numel: int, chunk_bytes: int, members: Sequence[PeerInfo], t0: float) -> RoundResult:
    """What a completed round reports: its ids, time since ``t0`` (perf_counter), bytes, codec, members."""
    spec = rnd.spec
    return RoundResult(
        group_id=spec.group_id,
        round_id=spec.round_id,
        seconds=time.perf_counter() - t0,
        bytes_sent=rnd.bytes_sent,
        bytes_received=rnd.bytes_received,
        elements=numel,
        codec=spec.codec.name,
        chunk_bytes=chunk_bytes,
        contributors=rnd.contributors,
        contributed=spec.contributes,
        members=tuple(p.node_id for p in members),
    )


async def _run(rnd: RingRound, out: OutboundStream | None, timeout: float) -> None:
    """Drive an opened round to its end within ``timeout``: its sends, its receives and our stream."""
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
                raise TimeoutError(f"round did not finish within {timeout:.1f} s: {rnd.waiting_for()}")
            done, _ = await asyncio.wait(waiters, timeout=left, return_when=asyncio.FIRST_COMPLETED)
            for fut in done:
                if fut.cancelled():  # a part of the round, not our caller, was cancelled: it cannot finish
                    raise RoundAborted("a part of the round was cancelled")
                exc = fut.exception()
                if exc is not None:
                    raise exc if isinstance(exc, PeerError | RoundAborted) else RoundAborted(str(exc))
            waiters = [w for w in waiters if not w.done()]
        if out is not None and failed is not None:
            await _close(out, failed, max(0.1, deadline - loop.time()))
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


async def _close(out: OutboundStream, failed: asyncio.Future[None], timeout: float) -> None:
    """Wait for our stream's acknowledgements, unless the round is aborted first.

    Our part may be done while the successor died with our last frames unacknowledged: the stream then
    waits for it to come back (a restart) up to the round's deadline, so a view change that drops it
    (which aborts the stream) must end the wait, not the deadline.
    """
    closing = asyncio.ensure_future(out.close())
    try:
        done, _ = await asyncio.wait({closing, failed}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        if closing in done:
            if closing.cancelled():  # not by our caller (that cancels us inside wait): the stream cannot finish
                raise RoundAborted("our stream to the successor was cancelled")
            closing.result()
        elif failed in done and not failed.cancelled():
            failed.result()  # raises the stream's failure (an abort names its reason)
        if not done:
            raise TimeoutError(f"our frames were not acknowledged within {timeout:.1f} s")
    finally:
        if not closing.done():
            closing.cancel()
            await asyncio.wait({closing})
        if not closing.cancelled():
            closing.exception()


def _flatten(tensors: Sequence[torch.Tensor], world: int) -> tuple[torch.Tensor, int]:
    """The tensors as one fp32 vector, padded to at least ``world`` elements, and their element count."""
    if not tensors:
        return torch.empty(0, dtype=torch.float32), 0
    for i, t in enumerate(tensors):
        if not t.is_floating_point():
            raise TypeError(f"tensor {i} has dtype {t.dtype}; only floating-point tensors can be averaged")
    flat = torch.cat([t.detach().reshape(-1).to(device="cpu", dtype=torch.float32) for t in tensors])
    numel = flat.numel()
    if 0 < numel < world:
        # every ring segment must carry data: a member that takes no part (joining, gone) is noticed by the
        # refusal of the frames sent to it, which an empty segment never sends (the round would wait out
        # its deadline instead); every member pads alike, so layouts still agree
        flat = torch.cat([flat, flat.new_zeros(world - numel)])
    return flat, numel


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
