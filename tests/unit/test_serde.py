"""The proto boundary: hand-framed DataFrames are valid protobuf, and parsing arbitrary bytes is safe."""

from __future__ import annotations

import grpc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dreamp2p.errors import PeerError, Status
from dreamp2p.messages import DType, Frame, PeerStatus, Phase, RoundEvidence, TrainingInfo
from dreamp2p.transport import serde
from dreamp2p.v1 import peer_pb2 as pb

u64 = st.integers(0, 2**64 - 1)
u32 = st.integers(0, 2**32 - 1)

frames = st.builds(
    Frame,
    round_id=u64,
    plan_version=u32,
    group_id=u32,
    phase=st.sampled_from(list(Phase)),
    ring_step=u32,
    segment_index=u32,
    chunk_offset=u64,
    chunk_length=st.integers(1, 2**64 - 1),
    codec=st.integers(1, 6),
    dtype=st.sampled_from(list(DType)),
    element_count=u64,
    checksum=u64,
    zstd=st.booleans(),
    raw_length=u64,
    payload=st.binary(max_size=3000),
    sender=st.text(min_size=1, max_size=20),
)


@given(frames)
@settings(max_examples=300, deadline=None)
def test_wire_framing_is_the_protobuf_encoding(f: Frame) -> None:
    wire = serde.frame_to_wire(f)
    # payload is written last (after field 16): same message, so any protobuf parser reads it back
    assert pb.DataFrame.FromString(wire) == serde.frame_to_proto(f)
    back = serde.frame_from_wire(wire, 1 << 20)
    assert back == serde.frame_from_proto(pb.DataFrame.FromString(wire), 1 << 20)
    assert bytes(back.payload) == f.payload


@given(frames, st.randoms())
@settings(max_examples=200, deadline=None)
def test_any_field_order_parses(f: Frame, rnd: object) -> None:
    """Another protobuf library may order fields differently; the scanner must not care."""
    m = serde.frame_to_proto(f)
    parts = []
    for field, _ in m.ListFields():
        single = pb.DataFrame()
        setattr(single, field.name, getattr(m, field.name))
        parts.append(single.SerializeToString())
    rnd.shuffle(parts)  # type: ignore[attr-defined]
    back = serde.frame_from_wire(b"".join(parts), 1 << 20)
    assert back == serde.frame_from_proto(m, 1 << 20)


@given(st.binary(max_size=400))
@settings(max_examples=2000, deadline=None)
def test_random_bytes_give_peer_error_or_frame(data: bytes) -> None:
    try:
        frame = serde.frame_from_wire(data, 1 << 20)
    except PeerError as err:
        assert err.status in {Status.BAD_FRAME, Status.UNKNOWN_CODEC, Status.OVERSIZE}
    else:
        assert isinstance(frame, Frame)


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        (b"\x08", "varint runs past the end"),
        (b"\x08" + b"\xff" * 11, "varint longer than 10 bytes"),
        (b"\x7a\x05abc", "field 15 needs 5 bytes"),
        (b"\x0b", "wire type 3"),
        (b"\x00\x01", "field number 0"),
        (b"\x09\x01\x02", "truncated message"),
    ],
)
def test_malformed_wire_reasons(data: bytes, reason: str) -> None:
    with pytest.raises(PeerError, match=reason) as err:
        serde.frame_from_wire(data, 1 << 20)
    assert err.value.status == Status.BAD_FRAME


def test_oversize_payload_refused() -> None:
    f = Frame(1, 0, 0, Phase.REDUCE_SCATTER, 0, 0, 0, 10, 1, DType.FP32, 10, 0, False, 0, bytes(41), "p0")
    with pytest.raises(PeerError) as err:
        serde.frame_from_wire(serde.frame_to_wire(f), 40)
    assert err.value.status == Status.OVERSIZE


def test_status_names_round_trip() -> None:
    for status in Status:
        assert serde.status_from_details(serde.error_details(PeerError(status, "x"))) == status
    assert serde.status_from_details("garbage") == Status.UNSPECIFIED
    assert serde.status_from_details(None) == Status.UNSPECIFIED


def test_every_status_has_a_grpc_code() -> None:
    # a status without one would turn a precise refusal into an internal error at the edge
    assert set(serde.GRPC_CODE) == set(Status)


@pytest.mark.parametrize(
    ("code", "details", "status"),
    [
        (grpc.StatusCode.UNAVAILABLE, "failed to connect to all addresses", Status.UNSPECIFIED),
        (grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded", Status.TIMEOUT),
        (grpc.StatusCode.INVALID_ARGUMENT, "BAD_FRAME: element_count 3 but group buffer has 4", Status.BAD_FRAME),
    ],
)
def test_a_failed_call_carries_its_grpc_code_and_status_as_fields(
    code: grpc.StatusCode, details: str, status: Status
) -> None:
    from grpc import aio

    from dreamp2p.transport.rpcerror import rpc_error

    err = rpc_error(aio.AioRpcError(code, aio.Metadata(), aio.Metadata(), details=details))
    assert err.grpc_code == code.name and err.status == status


@pytest.mark.parametrize(
    ("sent", "rate", "part", "expect"),
    [
        (1000, 2.5e6, 0.75, RoundEvidence(1000, 2.5e6, 0.75)),
        (0, 0.0, 0.0, RoundEvidence()),
        # a member's own measurements: anything not finite and non-negative counts as not measured
        (10, float("nan"), float("inf"), RoundEvidence(10, 0.0, 0.0)),
        (10, -1.0, -0.5, RoundEvidence(10, 0.0, 0.0)),
    ],
)
def test_vote_carries_the_senders_evidence(sent: int, rate: float, part: float, expect: RoundEvidence) -> None:
    req = serde.vote_request("p1", 3, 7, 42, True, RoundEvidence(sent, rate, part))
    v = serde.vote_from_proto(pb.VoteRequest.FromString(req.SerializeToString()))
    assert (v.sender, v.group_id, v.round_id, v.view_id, v.commit) == ("p1", 3, 7, 42, True)
    assert v.evidence == expect


def test_vote_without_evidence_and_status_straggler_fields_round_trip() -> None:
    v = serde.vote_from_proto(serde.vote_request("p1", 0, 1, 0, False))
    assert v.evidence == RoundEvidence()
    st = PeerStatus(
        node_id="p0",
        cluster_id="c",
        protocol_version=2,
        ring=("p0", "p1", "p2"),
        links=(),
        rounds_completed=1,
        rounds_failed=0,
        frames_rejected=0,
        live=("p0", "p1"),
        excluded=("p2",),
        straggler_evictions=3,
        straggler_returns=2,
    )
    back = serde.status_from_proto(pb.StatusResponse.FromString(serde.status_to_proto(st).SerializeToString()))
    assert (back.excluded, back.straggler_evictions, back.straggler_returns) == (("p2",), 3, 2)


@pytest.mark.parametrize(
    "training",
    [
        TrainingInfo("dreamddp", 40, 2, 36, "layer 0: every 4", region_rank=1, region_ranks=4),
        TrainingInfo("ssgd", 3),  # a one-rank region: no region fields
    ],
)
def test_status_region_fields_round_trip(training: TrainingInfo) -> None:
    st = PeerStatus("eu.1", "c", 2, ("eu.1", "us.1"), (), 0, 0, 0, training=training)
    back = serde.status_from_proto(pb.StatusResponse.FromString(serde.status_to_proto(st).SerializeToString()))
    assert back.training == training
