"""The single proto boundary: converts between `dreamp2p.messages` and `dreamp2p.v1` protobuf.

Structural checks that need no round context (known enums, non-empty sender, sizes that fit the
configured limits) happen here, so everything past this module holds well-formed values. The bytes of
the two bulk messages (a frame's payload, a state chunk) are written and split by hand, without a second
copy, in `transport.wireformat`.
"""

from __future__ import annotations

import math
from typing import Any

import grpc

from dreamp2p.errors import PeerError, Status
from dreamp2p.messages import (
    DType,
    Frame,
    Hello,
    LinkSnapshot,
    MemberProgress,
    PeerStatus,
    Phase,
    RoundEvidence,
    TrainingInfo,
    Vote,
)
from dreamp2p.statemeta import (
    MAX_RANGE_BYTES,
    MAX_SKELETON_BYTES,
    MAX_TENSORS,
    MAX_TOTAL_BYTES,
    StateManifest,
    StateRange,
    TensorMeta,
    check_manifest,
    check_name,
)
from dreamp2p.transport.wireformat import CHUNK_DATA_TAG, CHUNK_OFFSET_TAG, PAYLOAD_TAG, split_payload, varint
from dreamp2p.v1 import peer_pb2 as pb

# Application status -> the standard gRPC code a generic client understands.
GRPC_CODE: dict[Status, grpc.StatusCode] = {
    Status.OK: grpc.StatusCode.OK,
    Status.UNSPECIFIED: grpc.StatusCode.UNKNOWN,
    Status.BAD_FRAME: grpc.StatusCode.INVALID_ARGUMENT,
    Status.UNKNOWN_CODEC: grpc.StatusCode.INVALID_ARGUMENT,
    Status.STALE_ROUND: grpc.StatusCode.ABORTED,
    Status.OVERSIZE: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Status.NON_FINITE: grpc.StatusCode.INVALID_ARGUMENT,
    Status.CHECKSUM_MISMATCH: grpc.StatusCode.DATA_LOSS,
    Status.BAD_TOKEN: grpc.StatusCode.UNAUTHENTICATED,
    Status.CLUSTER_MISMATCH: grpc.StatusCode.FAILED_PRECONDITION,
    Status.VERSION_MISMATCH: grpc.StatusCode.FAILED_PRECONDITION,
    Status.MANIFEST_MISMATCH: grpc.StatusCode.FAILED_PRECONDITION,
    Status.UNKNOWN_PEER: grpc.StatusCode.PERMISSION_DENIED,
    Status.TIMEOUT: grpc.StatusCode.DEADLINE_EXCEEDED,
    Status.SHUTTING_DOWN: grpc.StatusCode.UNAVAILABLE,
    Status.DUPLICATE_CHUNK: grpc.StatusCode.INVALID_ARGUMENT,
    Status.NEEDS_HANDSHAKE: grpc.StatusCode.FAILED_PRECONDITION,
    Status.VIEW_MISMATCH: grpc.StatusCode.ABORTED,
    Status.NOT_FOUND: grpc.StatusCode.NOT_FOUND,
    Status.JOINING: grpc.StatusCode.UNAVAILABLE,
    Status.CONFIG_MISMATCH: grpc.StatusCode.FAILED_PRECONDITION,
    Status.IDENTITY_MISMATCH: grpc.StatusCode.PERMISSION_DENIED,
    Status.ROUND_COMPLETED: grpc.StatusCode.ABORTED,
}

# Prefix of every error detail string, so clients can recover the application status from it.
_DETAIL_SEP = ": "


def _enum(value: Any) -> Any:
    """Generated stubs type enum fields as wrapper classes; our ints are valid values of them."""
    return value


def error_details(err: PeerError) -> str:
    return f"{err.status.name}{_DETAIL_SEP}{err.detail}"


def status_from_details(details: str | None) -> Status:
    """Recover the application status from an error detail written by :func:`error_details`."""
    name = (details or "").split(_DETAIL_SEP, 1)[0]
    try:
        return Status[name]
    except KeyError:
        return Status.UNSPECIFIED


def frame_to_proto(f: Frame) -> pb.DataFrame:
    m = _frame_header(f)
    m.payload = bytes(f.payload)
    return m


def _frame_header(f: Frame) -> pb.DataFrame:
    """Every DataFrame field but the payload."""
    return pb.DataFrame(
        round_id=f.round_id,
        plan_version=f.plan_version,
        group_id=f.group_id,
        phase=_enum(int(f.phase)),
        ring_step=f.ring_step,
        segment_index=f.segment_index,
        chunk_offset=f.chunk_offset,
        chunk_length=f.chunk_length,
        codec=_enum(f.codec),
        dtype=_enum(int(f.dtype)),
        element_count=f.element_count,
        checksum=f.checksum,
        zstd=f.zstd,
        raw_length=f.raw_length,
        sender=f.sender,
        excluded=f.excluded,
        view_id=f.view_id,
    )


PUSH_METHOD = "/dreamp2p.v1.Peer/Push"


def frame_to_wire(f: Frame) -> bytes:
    """Serialize a frame as a standard ``DataFrame`` message, copying the payload only once.

    Protobuf messages are concatenations of fields, so the header fields serialized by protobuf
    followed by field 15 written by hand is a valid ``DataFrame`` that any protobuf library parses.
    """
    header = _frame_header(f).SerializeToString()
    if not len(f.payload):
        return header  # proto3 leaves empty fields out
    return b"".join((header, PAYLOAD_TAG, varint(len(f.payload)), f.payload))


def frame_from_wire(data: bytes, max_payload: int) -> Frame:
    """Parse and structurally validate a received ``DataFrame``; the payload stays a view of ``data``."""
    header, payload = split_payload(data)
    try:
        m = pb.DataFrame.FromString(header)
    except Exception as exc:  # protobuf raises DecodeError; any failure here is a malformed frame
        raise PeerError(Status.BAD_FRAME, f"malformed DataFrame: {exc}") from None
    return _frame_fields(m, payload, max_payload)


def frame_from_proto(m: pb.DataFrame, max_payload: int) -> Frame:
    return _frame_fields(m, m.payload, max_payload)


def _frame_fields(m: pb.DataFrame, payload: bytes | memoryview, max_payload: int) -> Frame:
    """Structural validation of a received frame; raises PeerError with the precise reason."""
    if len(payload) > max_payload:
        raise PeerError(Status.OVERSIZE, f"payload of {len(payload)} bytes exceeds limit {max_payload}")
    try:
        phase = Phase(m.phase)
    except ValueError:
        raise PeerError(Status.BAD_FRAME, f"unknown phase {m.phase}") from None
    try:
        dtype = DType(m.dtype)
    except ValueError:
        raise PeerError(Status.BAD_FRAME, f"unknown dtype {m.dtype}") from None
    if m.codec == 0:
        raise PeerError(Status.UNKNOWN_CODEC, "codec not set")
    if not m.sender:
        raise PeerError(Status.BAD_FRAME, "sender not set")
    if m.chunk_length == 0 and payload:
        raise PeerError(Status.BAD_FRAME, "empty chunk with a payload")
    return Frame(
        round_id=m.round_id,
        plan_version=m.plan_version,
        group_id=m.group_id,
        phase=phase,
        ring_step=m.ring_step,
        segment_index=m.segment_index,
        chunk_offset=m.chunk_offset,
        chunk_length=m.chunk_length,
        codec=m.codec,
        dtype=dtype,
        element_count=m.element_count,
        checksum=m.checksum,
        zstd=m.zstd,
        raw_length=m.raw_length,
        payload=payload,
        sender=m.sender,
        excluded=m.excluded,
        view_id=m.view_id,
    )


def hello_to_proto(h: Hello) -> pb.HandshakeRequest:
    return pb.HandshakeRequest(
        cluster_id=h.cluster_id,
        protocol_version=h.protocol_version,
        node_id=h.node_id,
        manifest_hash=h.manifest_hash,
        codecs=_enum(list(h.codecs)),
        advertise_address=h.advertise_address,
        settings=dict(h.settings),
    )


def hello_from_proto(m: pb.HandshakeRequest) -> Hello:
    return Hello(
        cluster_id=m.cluster_id,
        protocol_version=m.protocol_version,
        node_id=m.node_id,
        manifest_hash=bytes(m.manifest_hash),
        codecs=tuple(int(c) for c in m.codecs),
        advertise_address=m.advertise_address,
        settings=_settings(m.settings),
    )


def hello_reply(h: Hello) -> pb.HandshakeResponse:
    return pb.HandshakeResponse(
        status=pb.STATUS_OK,
        node_id=h.node_id,
        protocol_version=h.protocol_version,
        codecs=_enum(list(h.codecs)),
        manifest_hash=h.manifest_hash,
        settings=dict(h.settings),
    )


def hello_from_reply(m: pb.HandshakeResponse) -> Hello:
    return Hello(
        cluster_id="",
        protocol_version=m.protocol_version,
        node_id=m.node_id,
        manifest_hash=bytes(m.manifest_hash),
        codecs=tuple(int(c) for c in m.codecs),
        settings=_settings(m.settings),
    )


# Bounds on the settings map a peer may send (names and values are short strings; this is no data channel).
MAX_SETTINGS = 256
MAX_SETTING_CHARS = 256


def _settings(m: Any) -> tuple[tuple[str, str], ...]:
    if len(m) > MAX_SETTINGS:
        raise PeerError(Status.BAD_FRAME, f"{len(m)} settings in a handshake; at most {MAX_SETTINGS}")
    for k, v in m.items():
        if len(k) > MAX_SETTING_CHARS or len(v) > MAX_SETTING_CHARS:
            raise PeerError(Status.BAD_FRAME, f"setting {k[:40]!r} longer than {MAX_SETTING_CHARS} characters")
    return tuple(sorted((str(k), str(v)) for k, v in m.items()))


def status_to_proto(s: PeerStatus) -> pb.StatusResponse:
    return pb.StatusResponse(
        node_id=s.node_id,
        cluster_id=s.cluster_id,
        protocol_version=s.protocol_version,
        ring=list(s.ring),
        links=[
            pb.LinkStats(
                peer=link.peer,
                rtt_s=link.rtt_s,
                goodput_bytes_per_s=link.goodput_Bps,
                bytes_sent=link.bytes_sent,
                bytes_received=link.bytes_received,
                samples=link.samples,
                chunk_bytes=link.chunk_bytes,
            )
            for link in s.links
        ],
        rounds_completed=s.rounds_completed,
        rounds_failed=s.rounds_failed,
        frames_rejected=s.frames_rejected,
        codecs=_enum(list(s.codecs)),
        uptime_s=s.uptime_s,
        step=s.training.step if s.training else 0,
        plan_version=s.training.plan_version if s.training else 0,
        plan_effective_step=s.training.plan_effective_step if s.training else 0,
        plan_summary=s.training.plan_summary if s.training else "",
        strategy=s.training.strategy if s.training else "",
        resuming=s.resuming,
        checkpoint_steps=list(s.checkpoint_steps),
        contributions_refused=s.contributions_refused,
        live=list(s.live),
        view_id=s.view_id,
        excluded=list(s.excluded),
        straggler_evictions=s.straggler_evictions,
        straggler_returns=s.straggler_returns,
        region_rank=s.training.region_rank if s.training else 0,
        region_ranks=s.training.region_ranks if s.training else 0,
    )


def status_from_proto(m: pb.StatusResponse) -> PeerStatus:
    return PeerStatus(
        node_id=m.node_id,
        cluster_id=m.cluster_id,
        protocol_version=m.protocol_version,
        ring=tuple(m.ring),
        links=tuple(
            LinkSnapshot(
                peer=link.peer,
                rtt_s=link.rtt_s,
                goodput_Bps=link.goodput_bytes_per_s,
                bytes_sent=link.bytes_sent,
                bytes_received=link.bytes_received,
                samples=link.samples,
                chunk_bytes=link.chunk_bytes,
            )
            for link in m.links
        ),
        rounds_completed=m.rounds_completed,
        rounds_failed=m.rounds_failed,
        frames_rejected=m.frames_rejected,
        codecs=tuple(int(c) for c in m.codecs),
        uptime_s=m.uptime_s,
        training=TrainingInfo(
            m.strategy, m.step, m.plan_version, m.plan_effective_step, m.plan_summary, m.region_rank, m.region_ranks
        )
        if m.strategy
        else None,
        resuming=m.resuming,
        checkpoint_steps=tuple(int(x) for x in m.checkpoint_steps),
        contributions_refused=m.contributions_refused,
        live=tuple(m.live),
        view_id=m.view_id,
        excluded=tuple(m.excluded),
        straggler_evictions=m.straggler_evictions,
        straggler_returns=m.straggler_returns,
    )


def probe_request(nonce: int, burst: bytes, reply_bytes: int, sender: str) -> pb.ProbeRequest:
    return pb.ProbeRequest(nonce=nonce, burst=burst, reply_bytes=reply_bytes, sender=sender)


def probe_response(
    nonce: int, received: int, reply_bytes: int, progress: MemberProgress | None = None, joining: bool = False
) -> pb.ProbeResponse:
    resp = pb.ProbeResponse(nonce=nonce, received_bytes=received, burst=bytes(reply_bytes), joining=joining)
    if progress is not None:
        resp.has_progress = True
        resp.step, resp.plan_version = progress.step, progress.plan_version
        resp.plan_effective_step, resp.plan_digest = progress.plan_effective_step, progress.plan_digest
        resp.schedule_step, resp.schedule_digest = progress.schedule_step, progress.schedule_digest
    return resp


def progress_from_probe(resp: pb.ProbeResponse) -> MemberProgress | None:
    """The answering member's progress, or None when it has no trainer (or predates the field)."""
    if not resp.has_progress:
        return None
    return MemberProgress(
        resp.step,
        resp.plan_version,
        resp.plan_effective_step,
        resp.plan_digest,
        resp.schedule_step,
        resp.schedule_digest,
    )


def vote_request(
    sender: str, group_id: int, round_id: int, view_id: int, commit: bool, evidence: RoundEvidence | None = None
) -> pb.VoteRequest:
    e = evidence or RoundEvidence()
    return pb.VoteRequest(
        sender=sender,
        group_id=group_id,
        round_id=round_id,
        view_id=view_id,
        commit=commit,
        sent_bytes=e.sent_bytes,
        link_bytes_per_s=e.link_Bps,
        part_s=e.part_s,
    )


def vote_from_proto(m: pb.VoteRequest) -> Vote:
    if not m.sender:
        raise PeerError(Status.BAD_FRAME, "vote without a sender")
    if m.round_id == 0:
        raise PeerError(Status.BAD_FRAME, "vote for round 0")
    # a member's own measurements: anything not a finite, non-negative number counts as not measured
    evidence = RoundEvidence(m.sent_bytes, _measured(m.link_bytes_per_s), _measured(m.part_s))
    return Vote(m.sender, m.group_id, m.round_id, m.view_id, m.commit, evidence)


def _measured(x: float) -> float:
    return x if math.isfinite(x) and x >= 0 else 0.0


def push_ack(frames: int, payload_bytes: int) -> pb.PushAck:
    return pb.PushAck(status=pb.STATUS_OK, frames=frames, payload_bytes=payload_bytes)


# ------------------------------------------------------------------ state transfer (see dreamp2p.state)

# Bounds a sender id, so a request cannot make us log or look up megabytes.
_MAX_SENDER_CHARS = 256


def _state_sender(sender: str) -> str:
    if not sender:
        raise PeerError(Status.BAD_FRAME, "state request without a sender")
    if len(sender) > _MAX_SENDER_CHARS:
        raise PeerError(Status.BAD_FRAME, f"sender id of {len(sender)} characters exceeds {_MAX_SENDER_CHARS}")
    return sender


def state_manifest_request(sender: str) -> pb.StateManifestRequest:
    return pb.StateManifestRequest(sender=sender)


def state_manifest_request_from_proto(m: pb.StateManifestRequest) -> str:
    """The validated sender of a manifest request."""
    return _state_sender(m.sender)


def state_manifest_to_proto(manifest: StateManifest, manifest_hash: bytes) -> pb.StateManifest:
    return pb.StateManifest(
        status=pb.STATUS_OK,
        snapshot_id=manifest.snapshot_id,
        step=manifest.step,
        skeleton=manifest.skeleton,
        tensors=[
            pb.TensorEntry(name=t.name, dtype=t.dtype, shape=list(t.shape), nbytes=t.nbytes, sha256=t.sha256)
            for t in manifest.tensors
        ],
        manifest_hash=manifest_hash,
    )


def state_manifest_from_proto(m: pb.StateManifest) -> StateManifest:
    """Structural validation of a donor's manifest (names, dtypes, shapes, sizes, hashes, bounds)."""
    if m.status != pb.STATUS_OK:
        try:
            status = Status(m.status)
        except ValueError:
            status = Status.UNSPECIFIED
        raise PeerError(status, f"donor refused: {m.detail[:200]}")
    if len(m.skeleton) > MAX_SKELETON_BYTES:
        raise PeerError(Status.OVERSIZE, f"state skeleton of {len(m.skeleton)} bytes exceeds {MAX_SKELETON_BYTES}")
    if len(m.tensors) > MAX_TENSORS:
        raise PeerError(Status.OVERSIZE, f"state manifest lists {len(m.tensors)} tensors, more than {MAX_TENSORS}")
    manifest = StateManifest(
        snapshot_id=m.snapshot_id,
        step=m.step,
        skeleton=bytes(m.skeleton),
        tensors=tuple(
            TensorMeta(e.name, e.dtype, tuple(int(d) for d in e.shape), e.nbytes, bytes(e.sha256)) for e in m.tensors
        ),
        manifest_hash=bytes(m.manifest_hash),
    )
    try:
        check_manifest(manifest)
    except ValueError as exc:
        raise PeerError(Status.BAD_FRAME, f"malformed state manifest: {exc}") from None
    return manifest


def state_chunk_request(r: StateRange) -> pb.StateChunkRequest:
    return pb.StateChunkRequest(
        sender=r.sender, snapshot_id=r.snapshot_id, tensor=r.tensor, offset=r.offset, length=r.length
    )


def state_range_from_proto(m: pb.StateChunkRequest) -> StateRange:
    """Structural validation of a FetchState request; whether the range exists is the donor's to say."""
    sender = _state_sender(m.sender)
    if m.snapshot_id == 0:
        raise PeerError(Status.BAD_FRAME, "state request without a snapshot id")
    try:
        check_name(m.tensor)
    except ValueError as exc:
        raise PeerError(Status.BAD_FRAME, f"state request: {exc}") from None
    if m.length == 0:
        raise PeerError(Status.BAD_FRAME, "state request for an empty byte range")
    if m.length > MAX_RANGE_BYTES:
        raise PeerError(Status.OVERSIZE, f"state request for {m.length} bytes, more than {MAX_RANGE_BYTES} per call")
    if m.offset > MAX_TOTAL_BYTES:
        raise PeerError(Status.BAD_FRAME, f"state request at offset {m.offset}, beyond any tensor")
    return StateRange(sender, m.snapshot_id, m.tensor, m.offset, m.length)


def state_chunk_to_wire(offset: int, data: bytes | memoryview) -> bytes:
    """Serialize a ``StateChunk`` copying ``data`` once (the standard encoding, as ``frame_to_wire``)."""
    parts: list[bytes | memoryview] = []
    if offset:  # proto3 leaves zero fields out
        parts += [CHUNK_OFFSET_TAG, varint(offset)]
    if len(data):
        parts += [CHUNK_DATA_TAG, varint(len(data)), data]
    return b"".join(parts)


def state_chunk_from_proto(m: pb.StateChunk) -> tuple[int, bytes]:
    return m.offset, m.data
