"""Ring all-reduce (mean) of one flat fp32 buffer: reduce-scatter then all-gather, pipelined by chunk.

The classic bandwidth-optimal ring (Patarasuk & Yuan, 2009): each peer sends
2(N-1)/N of the buffer. Chunks flow independently, so a chunk is forwarded to the next hop as soon as
it has been reduced here, and the 2(N-1) hops overlap instead of running one after another.

Lossy codecs: partial sums are always accumulated in fp32. The owner of a fully reduced segment
encodes the mean once and replaces its own copy by the decoded bytes; all-gather forwards those exact
bytes, so every peer ends with bit-identical values.

Per-link codecs (bandwidth-aware compression, arXiv 2408.14736; the choice is made by
``dreamp2p.schedule.linkcodec``): a peer may encode its reduce-scatter frames with the codec chosen for
its outgoing link, and owners encode all-gather frames with the codec of the ring's slowest link. Every
frame names its codec and is decoded by it; receivers accept any of the round's allowed codecs, and the
segment/chunk layout is aligned to all of their blocks so that any of them can encode any chunk.

A sparse codec (top-k) cannot re-encode a partial sum without dropping what the sum adds, so its rounds
gather the members' contributions instead (`collective.gather`, a subclass of this round).

This module is protocol only: it knows nothing of gRPC. Frames leave through an :class:`OutStream` and
arrive through :meth:`RingRound.deliver`, which validates every field before touching the buffer.
"""

from __future__ import annotations

import asyncio
import bisect
import dataclasses
import logging
import math
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch
import xxhash

from dreamp2p.collective.feedback import GATHER, REDUCE, RoundFeedback
from dreamp2p.collective.partition import (
    Segment,
    all_gather_recv,
    all_gather_send,
    reduce_scatter_recv,
    reduce_scatter_send,
    split_chunks,
    split_segments,
)
from dreamp2p.compression import Codec, CodecError, NonFiniteError, ZstdStage, get_codec
from dreamp2p.compression.base import UnknownCodecError
from dreamp2p.errors import PeerError, Status
from dreamp2p.messages import DType, Frame, Phase

log = logging.getLogger(__name__)


def checksum(payload: bytes | memoryview) -> int:
    return xxhash.xxh3_64_intdigest(payload)


class OutStream(Protocol):
    """Where a round's outgoing frames go (to the ring successor)."""

    def forward(self, frame: Frame) -> None:
        """Queue a frame produced by a received one; never blocks, so receiving never deadlocks the ring."""

    async def put(self, frame: Frame) -> None:
        """Queue one of our own frames; waits while the queue is over its byte budget (backpressure)."""

    async def close(self) -> None:
        """Flush and wait for the receiver's acknowledgement; raises on failure."""

    def abort(self, reason: str) -> None: ...


@dataclass(frozen=True)
class RoundSpec:
    group_id: int
    round_id: int
    plan_version: int
    rank: int
    world: int
    node_id: str
    predecessor: str
    codec: Codec
    dtype: DType = DType.FP32
    zstd: ZstdStage | None = None
    chunk_elems: int = 1 << 18
    max_payload: int = 64 << 20
    contributes: bool = True  # False: our buffer is zeros standing in for a refused contribution
    view_id: int = 0  # hash of the member list this round runs among; frames must carry the same
    # Per-link codecs (all default to ``codec``: one codec for the whole round, as before).
    send_codec: Codec | None = None  # reduce-scatter frames we send: the codec of our outgoing link
    gather_codec: Codec | None = None  # all-gather frames of the segment we own: cross every ring link
    # Wire ids accepted on received frames besides ``codec``. Every member must pass the same set: the
    # segment layout is aligned to all of their blocks (see :func:`round_block`).
    allowed_codecs: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for i in self.allowed_codecs:
            if i != self.codec.wire_id:
                get_codec(i)  # UnknownCodecError (a ValueError) for an id no peer could decode
        accepted = self.accepted_codecs
        for field, c in (("send_codec", self.send_codec), ("gather_codec", self.gather_codec)):
            if c is not None and c.wire_id not in accepted:
                # our successor would refuse every frame we send
                raise ValueError(f"{field} {c.name} is not among the round's accepted codecs {sorted(accepted)}")

    @property
    def key(self) -> tuple[int, int]:
        return (self.group_id, self.round_id)

    @property
    def rs_codec(self) -> Codec:
        """Codec of the reduce-scatter frames this peer sends."""
        return self.send_codec or self.codec

    @property
    def ag_codec(self) -> Codec:
        """Codec of the all-gather frames this peer originates (its own segment's mean)."""
        return self.gather_codec or self.codec

    @property
    def accepted_codecs(self) -> frozenset[int]:
        """Wire ids a received frame may carry."""
        return frozenset((self.codec.wire_id, *self.allowed_codecs))

    @property
    def block(self) -> int:
        """Element alignment of the round's segments and chunks."""
        return round_block(self.codec, self.allowed_codecs)


def _header(f: Frame) -> Frame:
    """Every field of a frame but its payload (whose checksum is among them)."""
    return dataclasses.replace(f, payload=b"")


def round_block(codec: Codec, allowed_codecs: tuple[int, ...] = ()) -> int:
    """Alignment that suits every accepted codec: the LCM of their blocks (``codec.block`` alone by default).

    Chunks start at multiples of it, so a blockwise codec quantizes each chunk exactly as it would inside
    the whole segment, whichever accepted codec a sender picks.
    """
    blocks = [get_codec(i).block for i in allowed_codecs if i != codec.wire_id]
    return math.lcm(codec.block, *blocks)


class RoundProgress(NamedTuple):
    """A round's receive bookkeeping at one moment: elements in, and the chunks seen per (phase, step)."""

    received: int
    starts: tuple[tuple[tuple[Phase, int], tuple[int, ...]], ...]
    lengths: tuple[tuple[tuple[Phase, int, int], int], ...]


def check_header(spec: RoundSpec, codecs: dict[int, Codec], numel: int, f: Frame) -> Codec:
    """Check what a frame says about its round (view, sender, plan, size, codec, dtype, step) against
    ``spec``; the codec it was encoded with, or PeerError with the precise status. ``codecs``: those the
    round accepts, by wire id; ``numel``: the group buffer's elements."""
    if f.view_id != spec.view_id:
        raise PeerError(
            Status.VIEW_MISMATCH,
            f"frame from a round among members {f.view_id:#x}; here it runs among {spec.view_id:#x}",
        )
    if f.sender != spec.predecessor:
        raise PeerError(Status.UNKNOWN_PEER, f"frame from {f.sender!r}, but this round expects {spec.predecessor!r}")
    if f.plan_version != spec.plan_version:
        raise PeerError(Status.BAD_FRAME, f"plan version {f.plan_version}, round uses {spec.plan_version}")
    if f.element_count != numel:
        raise PeerError(Status.BAD_FRAME, f"element_count {f.element_count} but group buffer has {numel}")
    codec = codecs.get(f.codec)
    if codec is None:
        try:
            other = get_codec(f.codec).name
        except UnknownCodecError:
            raise PeerError(Status.UNKNOWN_CODEC, f"unknown codec id {f.codec}") from None
        detail = f"codec {other} but round uses {spec.codec.name}"
        if len(codecs) > 1:
            detail += f" and accepts only {', '.join(codecs[i].name for i in sorted(codecs))}"
        raise PeerError(Status.BAD_FRAME, detail)
    if f.dtype != spec.dtype:
        raise PeerError(Status.BAD_FRAME, f"dtype {f.dtype.name} but round uses {spec.dtype.name}")
    if f.ring_step >= spec.world - 1:
        raise PeerError(Status.BAD_FRAME, f"ring_step {f.ring_step} out of range for {spec.world} peers")
    if f.excluded > (f.ring_step + 1 if f.phase == Phase.REDUCE_SCATTER else spec.world - 1):
        raise PeerError(
            Status.BAD_FRAME,
            f"excluded {f.excluded} exceeds the contributions a {f.phase.name} frame at step {f.ring_step} can carry",
        )
    return codec


class RingRound:
    """One all-reduce round at one peer. Create, :meth:`start`, feed :meth:`deliver`, await :attr:`done`."""

    def __init__(
        self, spec: RoundSpec, buffer: torch.Tensor, out: OutStream | None, feedback: RoundFeedback | None = None
    ) -> None:
        if buffer.dtype != torch.float32 or buffer.dim() != 1 or not buffer.is_contiguous():
            raise ValueError("ring buffer must be a contiguous 1-D float32 tensor")
        if spec.world > 1 and out is None:
            raise ValueError("a ring of more than one peer needs an outbound stream")
        self.spec = spec
        self.acc = buffer
        self.out = out
        self._feedback = feedback  # error feedback for lossy encodes (increments only; see collective.feedback)
        self._block = spec.block
        # decoders by wire id; the spec's own codec objects win, so they need not be registered
        self._codecs: dict[int, Codec] = {i: get_codec(i) for i in spec.accepted_codecs if i != spec.codec.wire_id}
        for c in (spec.codec, spec.rs_codec, spec.ag_codec):
            self._codecs[c.wire_id] = c
        self.segments: list[Segment] = split_segments(buffer.numel(), spec.world, self._block)
        self.done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        # per (phase, step): sorted chunk starts, and per (phase, step, start) the header of the chunk taken
        # there (its length among them): to refuse overlaps and duplicates, and to know an identical resend
        self._starts: dict[tuple[Phase, int], list[int]] = {}
        self._taken: dict[tuple[Phase, int, int], Frame] = {}
        self.resent = 0  # identical resends of chunks already taken, ignored
        self._expected = 0
        self._received = 0
        self.bytes_sent = 0
        self.bytes_received = 0
        self.contributors = spec.world  # fewest peers whose values entered any segment's mean
        if spec.world > 1:
            for step in range(spec.world - 1):
                rs = self.segments[reduce_scatter_recv(spec.rank, spec.world, step)].length
                ag = self.segments[all_gather_recv(spec.rank, spec.world, step)].length
                self._expected += rs + ag
        self._scratch = torch.empty(0, dtype=torch.float32)

    # ------------------------------------------------------------------ sending

    async def start(self) -> None:
        """Send our own segment (reduce-scatter step 0). Finishes at once for a ring of one."""
        spec = self.spec
        if spec.world == 1:
            self._maybe_finish()
            return
        seg = self.segments[reduce_scatter_send(spec.rank, spec.world, 0)]
        assert self.out is not None
        for chunk in split_chunks(seg, spec.chunk_elems, self._block):
            if self.done.done():
                return
            frame = self._encode_frame(
                Phase.REDUCE_SCATTER, 0, seg.index, chunk.start, chunk.length, self._own_excluded
            )
            self.bytes_sent += len(frame.payload)
            await self.out.put(frame)
        self._maybe_finish()

    def waiting_for(self) -> str:
        """How far the round got here, for the message of one that ran out of time: whose frames it awaits."""
        return (
            f"received {self._received} of {self._expected} elements from {self.spec.predecessor!r}, "
            f"sent {self.bytes_sent} bytes"
        )

    @property
    def _own_excluded(self) -> int:
        return 0 if self.spec.contributes else 1

    def _encode_frame(self, phase: Phase, step: int, segment: int, start: int, length: int, excluded: int = 0) -> Frame:
        """A reduce-scatter frame of our partial sum, in our outgoing link's codec."""
        codec = self.spec.rs_codec
        values = self.acc[start : start + length]
        fb = self._feedback
        # a refused contribution is zeros marked excluded: nothing of ours, residual included, goes out
        if fb is not None and not codec.lossless and (step > 0 or self.spec.contributes):
            values = fb.compensate(REDUCE, start, values)
            encoded = codec.encode(values)
            fb.keep(REDUCE, start, values, codec.decode(encoded, length))
        else:
            encoded = codec.encode(values)
        return self._frame(phase, step, segment, start, length, bytes(encoded.numpy()), codec, excluded)

    def _frame(
        self,
        phase: Phase,
        step: int,
        segment: int,
        start: int,
        length: int,
        raw: bytes,
        codec: Codec,
        excluded: int = 0,
    ) -> Frame:
        spec = self.spec
        raw_length = len(raw)
        if spec.zstd is not None:
            payload = spec.zstd.compress(raw, codec.itemsize)
            use_zstd = len(payload) < raw_length
            if not use_zstd:
                payload = raw
        else:
            payload, use_zstd = raw, False
        return Frame(
            round_id=spec.round_id,
            plan_version=spec.plan_version,
            group_id=spec.group_id,
            phase=phase,
            ring_step=step,
            segment_index=segment,
            chunk_offset=start,
            chunk_length=length,
            codec=codec.wire_id,
            dtype=spec.dtype,
            element_count=self.acc.numel(),
            checksum=checksum(payload),
            zstd=use_zstd,
            raw_length=raw_length if use_zstd else 0,
            payload=payload,
            sender=spec.node_id,
            excluded=excluded,
            view_id=spec.view_id,
        )

    # ---------------------------------------------------------------- receiving

    def deliver(self, frame: Frame) -> None:
        """Validate a frame against this round, then reduce or store it and forward what follows.

        Raises PeerError before touching any state if anything is off.
        """
        spec = self.spec
        if self.done.done():
            raise PeerError(Status.STALE_ROUND, f"round {spec.round_id} of group {spec.group_id} already ended")
        if self._is_resend(frame):
            # a sender that took us for restarted after its connection broke (`transport.outbound`'s
            # replay) sends again what we hold already: taken once, as at-least-once delivery wants
            self.resent += 1
            return
        raw, chunk_start, length, codec = self._validate(frame)
        decoded = self._decode(codec, raw, length)
        self._mark(frame)
        self.bytes_received += len(frame.payload)
        try:
            self._apply(frame, raw, decoded, chunk_start, length)
        except NonFiniteError as exc:
            # our own partial sum overflowed: this round cannot produce a valid mean anywhere
            self.fail(f"reduction became non-finite: {exc}")
            raise PeerError(Status.NON_FINITE, f"reduction became non-finite: {exc}") from None
        self._received += length
        self._maybe_finish()

    def _is_resend(self, frame: Frame) -> bool:
        """Whether ``frame`` is, header and bytes, the chunk already taken at its place (any other frame
        there is refused as DUPLICATE_CHUNK by `_validate`)."""
        taken = self._taken.get((frame.phase, frame.ring_step, frame.chunk_offset))
        return taken is not None and taken == _header(frame) and checksum(frame.payload) == frame.checksum

    def _apply(self, frame: Frame, raw: bytes | memoryview, decoded: torch.Tensor, start: int, length: int) -> None:
        """Take a validated frame: ``raw`` its encoded bytes (unzipped), ``decoded`` their values (scratch)."""
        spec = self.spec
        step = frame.ring_step
        view = self.acc[start : start + length]
        last = step == spec.world - 2
        if frame.phase == Phase.REDUCE_SCATTER:
            view.add_(decoded)
            excluded = frame.excluded + self._own_excluded
            if not last:
                seg = reduce_scatter_send(spec.rank, spec.world, step + 1)
                self._forward(self._encode_frame(Phase.REDUCE_SCATTER, step + 1, seg, start, length, excluded))
            else:
                contributors = spec.world - excluded
                if contributors < 1:
                    raise NonFiniteError("every peer's contribution was refused at its source")
                self.contributors = min(self.contributors, contributors)
                view.div_(contributors)
                # these bytes cross every ring link, so they use the slowest link's codec
                gather = spec.ag_codec
                fb = self._feedback
                sent = fb.compensate(GATHER, start, view) if fb is not None and not gather.lossless else view
                out_raw = bytes(gather.encode(sent).numpy())
                if not gather.lossless:
                    # keep exactly what every other peer will decode
                    gather.decode(out_raw, length, out=view)
                    if fb is not None:
                        fb.keep(GATHER, start, sent, view)
                seg = all_gather_send(spec.rank, spec.world, 0)
                # all-gather frames tell everyone how many peers the mean is over
                self._forward(self._frame(Phase.ALL_GATHER, 0, seg, start, length, out_raw, gather, excluded))
        else:
            view.copy_(decoded)
            self.contributors = min(self.contributors, spec.world - frame.excluded)
            if not last:
                seg = all_gather_send(spec.rank, spec.world, step + 1)
                # forward the owner's exact bytes: every peer decodes the same values
                self._forward(dataclasses.replace(frame, ring_step=step + 1, segment_index=seg, sender=spec.node_id))

    def _forward(self, frame: Frame) -> None:
        assert self.out is not None
        self.bytes_sent += len(frame.payload)
        self.out.forward(frame)

    def _validate(self, f: Frame) -> tuple[bytes | memoryview, int, int, Codec]:
        spec = self.spec
        codec = check_header(spec, self._codecs, self.acc.numel(), f)
        want, seg = self._expected_segment(f.phase, f.ring_step)
        if f.segment_index != want:
            raise PeerError(
                Status.BAD_FRAME,
                f"segment {f.segment_index} at {f.phase.name} step {f.ring_step}; expected segment {want}",
            )
        # the round's block, not the frame codec's: chunk boundaries are the same whoever encoded them
        block = self._block
        if f.chunk_length == 0 or f.chunk_offset < seg.start or f.chunk_offset + f.chunk_length > seg.stop:
            raise PeerError(
                Status.BAD_FRAME,
                f"chunk [{f.chunk_offset}, {f.chunk_offset + f.chunk_length}) outside segment "
                f"{want} [{seg.start}, {seg.stop})",
            )
        if (f.chunk_offset - seg.start) % block or (
            f.chunk_length % block and f.chunk_offset + f.chunk_length != seg.stop
        ):
            raise PeerError(Status.BAD_FRAME, f"chunk not aligned to the codec block of {block} elements")
        self._check_overlap(f.phase, f.ring_step, f.chunk_offset, f.chunk_length)
        if checksum(f.payload) != f.checksum:
            raise PeerError(Status.CHECKSUM_MISMATCH, f"payload checksum mismatch ({len(f.payload)} bytes)")
        need = codec.encoded_nbytes(f.chunk_length)
        raw: bytes | memoryview
        if f.zstd:
            if spec.zstd is None:
                raise PeerError(Status.BAD_FRAME, "zstd payload but this round does not use zstd")
            if f.raw_length != need:
                raise PeerError(Status.BAD_FRAME, f"raw_length {f.raw_length}, expected {need}")
            try:
                raw = spec.zstd.decompress(f.payload, need, codec.itemsize, spec.max_payload)
            except CodecError as exc:
                raise PeerError(Status.BAD_FRAME, f"zstd: {exc}") from None
        else:
            if len(f.payload) != need:
                raise PeerError(
                    Status.BAD_FRAME,
                    f"payload of {len(f.payload)} bytes for {f.chunk_length} {codec.name} elements; expected {need}",
                )
            raw = f.payload
        return raw, f.chunk_offset, f.chunk_length, codec

    def _expected_segment(self, phase: Phase, step: int) -> tuple[int, Segment]:
        """The segment index a frame of ``phase`` at ``step`` must name here, and the elements it spans."""
        rank, world = self.spec.rank, self.spec.world
        want = (
            reduce_scatter_recv(rank, world, step)
            if phase == Phase.REDUCE_SCATTER
            else all_gather_recv(rank, world, step)
        )
        return want, self.segments[want]

    def _decode(self, codec: Codec, raw: bytes | memoryview, length: int) -> torch.Tensor:
        if self._scratch.numel() < length:
            self._scratch = torch.empty(length, dtype=torch.float32)
        out = self._scratch[:length]
        try:
            return codec.decode(raw, length, out=out)
        except NonFiniteError as exc:
            raise PeerError(Status.NON_FINITE, str(exc)) from None
        except CodecError as exc:
            raise PeerError(Status.BAD_FRAME, str(exc)) from None

    def _check_overlap(self, phase: Phase, step: int, start: int, length: int) -> None:
        starts = self._starts.get((phase, step), [])
        i = bisect.bisect_left(starts, start)
        if i < len(starts) and starts[i] == start:
            raise PeerError(Status.DUPLICATE_CHUNK, f"chunk at {start} of {phase.name} step {step} already received")
        if i > 0 and starts[i - 1] + self._taken[(phase, step, starts[i - 1])].chunk_length > start:
            raise PeerError(Status.BAD_FRAME, f"chunk at {start} overlaps one already received")
        if i < len(starts) and start + length > starts[i]:
            raise PeerError(Status.BAD_FRAME, f"chunk at {start} overlaps one already received")

    def _mark(self, frame: Frame) -> None:
        """Record ``frame``'s chunk as taken (after `_validate`)."""
        bisect.insort(self._starts.setdefault((frame.phase, frame.ring_step), []), frame.chunk_offset)
        self._taken[(frame.phase, frame.ring_step, frame.chunk_offset)] = _header(frame)

    # ---------------------------------------------------------------- lifecycle

    def _maybe_finish(self) -> None:
        if self._received >= self._expected and not self.done.done():
            self.done.set_result(None)

    def progress(self) -> RoundProgress:
        """What has arrived so far, as sorted tuples: comparable across calls, e.g. around refused input."""
        starts = tuple(sorted((k, tuple(v)) for k, v in self._starts.items()))
        lengths = tuple(sorted((key, f.chunk_length) for key, f in self._taken.items()))
        return RoundProgress(self._received, starts, lengths)

    def fail(self, reason: str) -> None:
        if not self.done.done():
            self.done.set_exception(RoundAborted(reason))
            self.done.exception()  # the caller learns of it through RoundFailed; mark it seen
        if self.out is not None:
            self.out.abort(reason)


class RoundAborted(Exception):
    """A round was given up locally (a peer cancelled, or the reduction went wrong)."""
