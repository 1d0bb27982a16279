"""Malformed or unauthorized single calls to a real peer, and the precise status each one gets.

One hand-built call at a time, each answered with its own gRPC code, application status and detail:
frames broken in one field (fp32, int8 and zstd), frames for rounds that are finished,
far ahead or never open, payloads above the peer's and gRPC's size limits, calls without the right
token on every RPC of the service, handshakes that disagree on cluster, protocol, model or membership,
oversize probes, and Push bodies that are not (or are oddly encoded) DataFrames. What this file does not
cover has its own file: limits on what many calls together may hold (test_hardening.py), TLS and
certificate-bound node ids (test_tls.py), hypothesis-generated messages (test_fuzz_rpc.py), bytes
corrupted in flight (test_corruption.py).

Every test runs real :class:`~dreamp2p.peer.Peer` servers on 127.0.0.1 in the test's event loop. The
attacker is a raw gRPC client (``PeerStub`` on an insecure channel) sending hand-built ``peer_pb2``
messages. The pattern for frame tests: in the ring ``[p0, p1]`` the attacker handshakes with ``p1`` as
``p0`` (p1's ring predecessor) while ``p1`` alone opens an averaging round (the *victim* round) that the
real ``p0`` never joins. Each malformed frame is built from a frame that is valid for that round, with
exactly one field broken. The test then checks, in this order:

* the gRPC code and the application status that leads the details (``"BAD_FRAME: ..."``) plus the
  specific problem named in the details;
* the victim round fails (timeout) and the victim's tensor is bit-for-bit unchanged;
* ``frames_rejected`` counted the refusal, ``Status`` still answers, and a normal all-reduce with the
  real ``p0`` produces the exact mean.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import struct
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import grpc
import pytest
import torch
import xxhash
from conftest import poll_until, ring_configs, running_ring
from grpc import aio
from rawpeer import CALL_TIMEOUT, CLUSTER, GOOD_MD, MANIFEST, SERVICE, TOKEN, hello_request, refused, running_peer

from dreamp2p import PROTOCOL_VERSION
from dreamp2p.collective.partition import reduce_scatter_recv, split_segments
from dreamp2p.collective.ring import RoundProgress
from dreamp2p.compression import ZstdStage, get_codec
from dreamp2p.config import TransportConfig
from dreamp2p.errors import RoundFailed, Status
from dreamp2p.messages import Hello
from dreamp2p.peer import MAX_PROBE_BYTES, MAX_ROUNDS_AHEAD, Peer
from dreamp2p.peer.membership import view_id
from dreamp2p.transport.server import PeerServicer
from dreamp2p.v1 import peer_pb2 as pb
from dreamp2p.v1 import peer_pb2_grpc as pb_grpc

# Group of the victim rounds; legitimate rounds use group 0, so their round ids stay in step on both peers.
VICTIM_GROUP = 3
# Elements in a victim buffer: two 64-element segments, block-aligned for the blockwise codecs.
N = 128
# How long a victim round waits for frames that never come (every frame test waits this out once).
VICTIM_TIMEOUT = 0.35
FLT_MAX = 3.4028234663852886e38
# Time for a cancelled stream to reach the peer at the other end.
SETTLE = 0.05

TRANSPORT = TransportConfig(probe_interval_s=3600.0, round_timeout_s=5.0, rpc_deadline_s=5.0, connect_timeout_s=5.0)
PUSH = "/dreamp2p.v1.Peer/Push"
# A ring whose messages may be 128 KiB: the peer's own payload limit is 64 KiB below that.
SMALL_MESSAGES = TransportConfig(
    max_message_bytes=128 << 10,
    chunk_min_bytes=64 << 10,
    chunk_max_bytes=64 << 10,
    probe_interval_s=3600.0,
    round_timeout_s=5.0,
    rpc_deadline_s=5.0,
)
MAX_PAYLOAD = (128 << 10) - (64 << 10)


# ---------------------------------------------------------------------------------------------- peers


def token_ring(
    size: int = 2, transport: TransportConfig = TRANSPORT
) -> contextlib.AbstractAsyncContextManager[list[Peer]]:
    """``size`` token-protected peers ``p0..`` on ephemeral ports, connected into one ring (closed after)."""
    configs = ring_configs(size, cluster_id=CLUSTER, token=TOKEN, manifest_hash=MANIFEST, transport=transport)
    return running_ring(configs, timeout=5.0)


class Attacker:
    """A raw gRPC client aimed at one peer; every call carries the good token unless told otherwise."""

    def __init__(self, address: str) -> None:
        self.channel = aio.insecure_channel(address)
        self.stub = pb_grpc.PeerStub(self.channel)

    def handshake(self, md: Sequence[tuple[str, str]] = GOOD_MD, **fields: Any) -> Awaitable[pb.HandshakeResponse]:
        return self.stub.Handshake(hello_request(**fields), metadata=md, timeout=CALL_TIMEOUT)

    def push(self, *frames: pb.DataFrame, md: Sequence[tuple[str, str]] = GOOD_MD) -> Awaitable[pb.PushAck]:
        async def stream() -> AsyncIterator[pb.DataFrame]:
            for f in frames:
                yield f

        return self.stub.Push(stream(), metadata=md, timeout=CALL_TIMEOUT)

    def push_raw(self, *messages: bytes) -> Awaitable[pb.PushAck]:
        """A Push stream of hand-encoded message bodies, sent as they are."""

        async def stream() -> AsyncIterator[bytes]:
            for m in messages:
                yield m

        call = self.channel.stream_unary(PUSH, response_deserializer=pb.PushAck.FromString)
        return call(stream(), metadata=GOOD_MD, timeout=CALL_TIMEOUT)

    def probe(self, md: Sequence[tuple[str, str]] = GOOD_MD, **fields: Any) -> Awaitable[pb.ProbeResponse]:
        return self.stub.Probe(pb.ProbeRequest(**fields), metadata=md, timeout=CALL_TIMEOUT)

    def status(self, md: Sequence[tuple[str, str]] = GOOD_MD) -> Awaitable[pb.StatusResponse]:
        return self.stub.Status(pb.StatusRequest(), metadata=md, timeout=CALL_TIMEOUT)

    async def close(self) -> None:
        await self.channel.close(grace=None)


@pytest.fixture
async def ring2() -> AsyncIterator[list[Peer]]:
    async with token_ring(2) as peers:
        yield peers


@pytest.fixture
async def attacker(ring2: list[Peer]) -> AsyncIterator[Attacker]:
    """A raw client aimed at p1, the victim of the two-peer ring."""
    a = Attacker(ring2[1].address)
    yield a
    await a.close()


# --------------------------------------------------------------------------------------------- frames


def attacker_values(length: int) -> torch.Tensor:
    """The finite contribution the attacker's valid frames carry."""
    return torch.linspace(-2.0, 2.0, length, dtype=torch.float32)


def valid_frame(codec: str = "fp32", n: int = N, world: int = 2, rank: int = 1) -> pb.DataFrame:
    """The single frame that ``rank``'s victim round accepts from its predecessor at reduce-scatter step 0.

    It covers the whole expected segment in one chunk; its checksum is the xxh3_64 of its payload.
    """
    c = get_codec(codec)
    seg = split_segments(n, world, c.block)[reduce_scatter_recv(rank, world, 0)]
    payload = bytes(c.encode(attacker_values(seg.length)).numpy())
    return pb.DataFrame(
        round_id=1,
        plan_version=0,
        group_id=VICTIM_GROUP,
        phase=pb.PHASE_REDUCE_SCATTER,
        ring_step=0,
        segment_index=seg.index,
        chunk_offset=seg.start,
        chunk_length=seg.length,
        codec=c.wire_id,  # type: ignore[arg-type]  # an int the generated enum type accepts
        dtype=pb.DTYPE_FP32,
        element_count=n,
        checksum=xxhash.xxh3_64_intdigest(payload),
        payload=payload,
        sender="p0",
        view_id=view_id([f"p{r}" for r in range(world)]),
    )


def tweak(base: pb.DataFrame, **fields: object) -> pb.DataFrame:
    """A copy of ``base`` with ``fields`` changed; the checksum follows the payload unless given."""
    f = pb.DataFrame()
    f.CopyFrom(base)
    for name, value in fields.items():
        setattr(f, name, value)
    if "checksum" not in fields:
        f.checksum = xxhash.xxh3_64_intdigest(f.payload)
    return f


def fp32_chunk(base: pb.DataFrame, start: int, length: int) -> pb.DataFrame:
    """The part ``[start, start + length)`` of a full-segment fp32 frame, as its own valid chunk."""
    rel = start - base.chunk_offset
    return tweak(base, chunk_offset=start, chunk_length=length, payload=base.payload[4 * rel : 4 * (rel + length)])


def poke_f32(payload: bytes, index: int, value: float) -> bytes:
    """``payload`` with the float32 at element ``index`` replaced (for fp32 data or blockwise scales)."""
    out = bytearray(payload)
    struct.pack_into("<f", out, 4 * index, value)
    return bytes(out)


# ------------------------------------------------------------------------------------------ assertions


@dataclass
class Victim:
    """An averaging round that one peer opened and whose partner never joins."""

    key: tuple[int, int]
    tensor: torch.Tensor
    pristine: torch.Tensor
    task: asyncio.Task[object]

    async def failed_untouched(self) -> RoundFailed:
        """The round ends in RoundFailed and leaves the tensor bit-for-bit as it was."""
        with pytest.raises(RoundFailed) as info:
            await asyncio.wait_for(self.task, 10.0)
        assert torch.equal(self.tensor.view(torch.int32), self.pristine.view(torch.int32))
        # The failed round cancels its stream to the successor; let the successor see that before the next
        # round opens there, or it aborts that round too (test_failed_round_spares_other_rounds_of_partner).
        await asyncio.sleep(SETTLE)
        return info.value


async def open_victim_round(
    peer: Peer, codec: str = "fp32", tensor: torch.Tensor | None = None, timeout: float = VICTIM_TIMEOUT
) -> Victim:
    """Start ``peer.allreduce`` in the victim group and return once its round is open to frames."""
    if tensor is None:
        tensor = torch.randn(N, generator=torch.Generator().manual_seed(7))
    pristine = tensor.clone()
    key = (VICTIM_GROUP, peer.rounds.snapshot().next_round.get(VICTIM_GROUP, 0) + 1)
    task = asyncio.create_task(peer.allreduce([tensor], group_id=VICTIM_GROUP, codec=codec, timeout=timeout))
    await poll_until(lambda: peer.rounds.get(key) is not None or task.done(), 0.005)
    assert peer.rounds.get(key) is not None, f"victim round {key} did not open"
    return Victim(key, tensor, pristine, task)


@dataclass(frozen=True)
class Trace:
    """What a refused call may change in a peer, read on its event loop (the test's): counters, rounds,
    admissions, and the receive bookkeeping and buffer of one open round."""

    rounds_completed: int
    rounds_failed: int
    frames_rejected: int
    pending: int
    next_round: dict[int, int]
    closed: dict[int, frozenset[int]]
    open_rounds: frozenset[tuple[int, int]]
    admitted: dict[str, Hello]
    progress: RoundProgress | None
    acc: torch.Tensor | None

    @staticmethod
    def of(peer: Peer, key: tuple[int, int] | None = None) -> Trace:
        registry = peer.rounds.snapshot()
        rnd = peer.rounds.get(key) if key is not None else None
        return Trace(
            rounds_completed=peer.rounds_completed,
            rounds_failed=peer.rounds_failed,
            frames_rejected=peer.frames_rejected,
            pending=registry.pending,
            next_round=registry.next_round,
            closed=registry.closed,
            open_rounds=registry.open_rounds,
            admitted=peer.admitted(),
            progress=None if rnd is None else rnd.progress(),
            acc=None if rnd is None else rnd.acc.clone(),
        )

    def left_alone(self, after: Trace, rejected: int) -> None:
        """``after`` (a later trace of the same peer) differs only by ``rejected`` more refused frames."""
        assert after.rounds_completed == self.rounds_completed
        assert self.rounds_failed <= after.rounds_failed <= self.rounds_failed + 1
        assert after.frames_rejected == self.frames_rejected + rejected
        assert after.pending == 0, "a refused frame left a round waiter behind"
        assert after.next_round == self.next_round
        # an open round may give up at its own deadline meanwhile on a loaded machine (rounds_failed + 1
        # above): that closes it, and nothing else may change among the closed rounds
        newly = {(g, r) for g, rs in after.closed.items() for r in rs} - {
            (g, r) for g, rs in self.closed.items() for r in rs
        }
        gone = {(g, r) for g, rs in self.closed.items() for r in rs if r not in after.closed.get(g, frozenset())}
        assert not gone and len(newly) == after.rounds_failed - self.rounds_failed, (self.closed, after.closed)
        assert after.open_rounds <= self.open_rounds
        assert after.admitted.keys() == self.admitted.keys()
        assert all(after.admitted[k] is self.admitted[k] for k in self.admitted)
        if after.open_rounds != self.open_rounds:
            return  # the round gave up at its deadline (checked above): it holds no bookkeeping any more
        assert after.progress == self.progress, "refused frames changed the round's bookkeeping"
        if self.acc is not None:
            assert after.acc is not None and torch.equal(after.acc.view(torch.int32), self.acc.view(torch.int32))


async def rejected_count(attacker: Attacker) -> int:
    return (await attacker.status()).frames_rejected


async def assert_exact_mean(peers: Sequence[Peer]) -> None:
    """All peers average in group 0 and every one ends with the exact mean (small integers: exact in fp32)."""
    world = len(peers)
    data = [
        [torch.arange(64, dtype=torch.float32).view(8, 8) * (2 * i + 1), torch.full((5,), float(3 * i))]
        for i in range(world)
    ]
    expected = [cast(torch.Tensor, sum(d[j] for d in data)) / world for j in range(2)]
    results = await asyncio.gather(*(p.allreduce(d, timeout=5.0) for p, d in zip(peers, data, strict=True)))
    assert all(r.elements == 69 for r in results)
    for d in data:
        for got, want in zip(d, expected, strict=True):
            assert torch.equal(got, want)


async def assert_still_serves(peers: Sequence[Peer], attacker: Attacker) -> None:
    """The victim (p1) answers Status and completes a normal all-reduce with the real ring."""
    before = await attacker.status()
    assert before.node_id == "p1"
    await assert_exact_mean(peers)
    after = await attacker.status()
    assert after.rounds_completed == before.rounds_completed + 1


# ------------------------------------------------------------------------------ malformed frame table


@dataclass(frozen=True)
class BadFrames:
    """Frames built from the valid one for the open round; the last one must be refused as stated."""

    build: Callable[[pb.DataFrame], list[pb.DataFrame]]
    code: grpc.StatusCode
    status: Status
    detail: str
    codec: str = "fp32"


def one(**fields: object) -> Callable[[pb.DataFrame], list[pb.DataFrame]]:
    return lambda f: [tweak(f, **fields)]


INVALID = grpc.StatusCode.INVALID_ARGUMENT

FP32_CASES = [
    pytest.param(
        BadFrames(lambda f: [tweak(f, payload=f.payload[:-1])], INVALID, Status.BAD_FRAME, "255 bytes"),
        id="truncated-one-byte",
    ),
    pytest.param(
        BadFrames(lambda f: [tweak(f, payload=f.payload + b"\0")], INVALID, Status.BAD_FRAME, "257 bytes"),
        id="one-byte-long",
    ),
    pytest.param(BadFrames(one(payload=b""), INVALID, Status.BAD_FRAME, "payload of 0 bytes"), id="empty-payload"),
    pytest.param(
        BadFrames(one(chunk_offset=64), INVALID, Status.BAD_FRAME, "outside segment 0"),
        id="offset-in-next-seg",
    ),
    pytest.param(BadFrames(one(chunk_length=65), INVALID, Status.BAD_FRAME, "outside segment 0"), id="length-past-seg"),
    pytest.param(
        BadFrames(one(chunk_offset=2**64 - 1), INVALID, Status.BAD_FRAME, "outside segment 0"),
        id="offset-u64-max",
    ),
    pytest.param(
        BadFrames(one(chunk_length=0, payload=b""), INVALID, Status.BAD_FRAME, "outside segment 0"),
        id="empty-chunk",
    ),
    pytest.param(
        BadFrames(one(chunk_length=0), INVALID, Status.BAD_FRAME, "empty chunk with a payload"),
        id="zero-length-with-payload",
    ),
    pytest.param(BadFrames(one(segment_index=1), INVALID, Status.BAD_FRAME, "expected segment 0"), id="wrong-segment"),
    pytest.param(
        BadFrames(one(phase=pb.PHASE_ALL_GATHER), INVALID, Status.BAD_FRAME, "expected segment 1"),
        id="segment-wrong-for-phase",
    ),
    pytest.param(BadFrames(one(ring_step=1), INVALID, Status.BAD_FRAME, "ring_step 1 out of range"), id="step-1"),
    pytest.param(BadFrames(one(ring_step=2**32 - 1), INVALID, Status.BAD_FRAME, "out of range"), id="step-u32-max"),
    pytest.param(
        BadFrames(one(element_count=N - 1), INVALID, Status.BAD_FRAME, f"element_count {N - 1}"),
        id="element-count-short",
    ),
    pytest.param(
        BadFrames(one(element_count=2**64 - 1), INVALID, Status.BAD_FRAME, "element_count"),
        id="element-count-huge",
    ),
    pytest.param(BadFrames(one(plan_version=7), INVALID, Status.BAD_FRAME, "plan version 7"), id="plan-version"),
    pytest.param(BadFrames(one(codec=99), INVALID, Status.UNKNOWN_CODEC, "unknown codec id 99"), id="unknown-codec"),
    pytest.param(BadFrames(one(codec=0), INVALID, Status.UNKNOWN_CODEC, "codec not set"), id="codec-0"),
    pytest.param(
        BadFrames(one(codec=pb.CODEC_FP16), INVALID, Status.BAD_FRAME, "codec fp16 but round uses fp32"),
        id="other-known-codec",
    ),
    pytest.param(BadFrames(one(dtype=pb.DTYPE_BF16), INVALID, Status.BAD_FRAME, "dtype BF16"), id="other-known-dtype"),
    pytest.param(BadFrames(one(phase=0), INVALID, Status.BAD_FRAME, "unknown phase 0"), id="phase-0"),
    pytest.param(BadFrames(one(phase=9), INVALID, Status.BAD_FRAME, "unknown phase 9"), id="phase-9"),
    pytest.param(BadFrames(one(dtype=0), INVALID, Status.BAD_FRAME, "unknown dtype 0"), id="dtype-0"),
    pytest.param(BadFrames(one(dtype=42), INVALID, Status.BAD_FRAME, "unknown dtype 42"), id="dtype-42"),
    pytest.param(BadFrames(one(sender=""), INVALID, Status.BAD_FRAME, "sender not set"), id="no-sender"),
    pytest.param(
        BadFrames(one(zstd=True, raw_length=256), INVALID, Status.BAD_FRAME, "does not use zstd"),
        id="zstd-flag-on-plain-round",
    ),
    pytest.param(
        BadFrames(one(round_id=2 + MAX_ROUNDS_AHEAD), INVALID, Status.BAD_FRAME, f"more than {MAX_ROUNDS_AHEAD} ahead"),
        id="round-far-ahead",
    ),
    pytest.param(
        BadFrames(one(round_id=2**64 - 1), INVALID, Status.BAD_FRAME, f"more than {MAX_ROUNDS_AHEAD} ahead"),
        id="round-u64-max",
    ),
    pytest.param(
        BadFrames(one(round_id=0), grpc.StatusCode.ABORTED, Status.STALE_ROUND, "round 0 of group 3"),
        id="round-0",
    ),
    pytest.param(
        BadFrames(
            lambda f: [tweak(f, checksum=f.checksum ^ 1)],
            grpc.StatusCode.DATA_LOSS,
            Status.CHECKSUM_MISMATCH,
            "256",
        ),
        id="checksum",
    ),
    pytest.param(
        BadFrames(lambda f: [tweak(f, payload=poke_f32(f.payload, 5, math.nan))], INVALID, Status.NON_FINITE, "nan"),
        id="nan",
    ),
    pytest.param(
        BadFrames(lambda f: [tweak(f, payload=poke_f32(f.payload, 63, math.inf))], INVALID, Status.NON_FINITE, "inf"),
        id="plus-inf",
    ),
    pytest.param(
        BadFrames(
            lambda f: [tweak(f, payload=poke_f32(f.payload, 0, -math.inf))],
            INVALID,
            Status.NON_FINITE,
            "-inf",
        ),
        id="minus-inf",
    ),
    pytest.param(
        BadFrames(one(excluded=2), INVALID, Status.BAD_FRAME, "excluded 2 exceeds the contributions"),
        id="excluded-more-than-summed",
    ),
    pytest.param(
        BadFrames(
            one(sender="mallory"),
            grpc.StatusCode.PERMISSION_DENIED,
            Status.UNKNOWN_PEER,
            "'mallory' has not completed a handshake",
        ),
        id="sender-never-handshook",
    ),
    pytest.param(
        BadFrames(
            lambda f: [f, tweak(f, payload=poke_f32(f.payload, 0, 1.5))],
            INVALID,
            Status.DUPLICATE_CHUNK,
            "chunk at 0 of REDUCE_SCATTER step 0",
        ),
        id="duplicate-chunk-other-bytes",
    ),
    pytest.param(
        BadFrames(lambda f: [fp32_chunk(f, 0, 32), fp32_chunk(f, 16, 32)], INVALID, Status.BAD_FRAME, "overlaps"),
        id="overlapping-chunk",
    ),
]


def _int8_payload(scale: float, first_code: int | None = None) -> bytes:
    """A valid int8 payload for segment 0 with its (only) block scale and optionally code 0 replaced."""
    payload = bytearray(valid_frame("int8").payload)
    struct.pack_into("<f", payload, 0, scale)
    if first_code is not None:
        payload[4] = first_code
    return bytes(payload)


INT8_CASES = [
    pytest.param(
        BadFrames(
            lambda f: [tweak(f, payload=_int8_payload(math.nan))],
            INVALID,
            Status.NON_FINITE,
            "scale nan",
            "int8",
        ),
        id="int8-nan-scale",
    ),
    pytest.param(
        BadFrames(
            lambda f: [tweak(f, payload=_int8_payload(math.inf))],
            INVALID,
            Status.NON_FINITE,
            "scale inf",
            "int8",
        ),
        id="int8-inf-scale",
    ),
    pytest.param(
        BadFrames(
            lambda f: [tweak(f, payload=_int8_payload(FLT_MAX, first_code=0))],
            INVALID,
            Status.NON_FINITE,
            "decodes to -inf",
            "int8",
        ),
        id="int8-overflowing-code",
    ),
    pytest.param(
        BadFrames(lambda f: [tweak(f, payload=f.payload[:-1])], INVALID, Status.BAD_FRAME, "expected 68", "int8"),
        id="int8-truncated",
    ),
    pytest.param(
        BadFrames(
            lambda f: [
                tweak(
                    f,
                    chunk_offset=1,
                    chunk_length=63,
                    payload=bytes(get_codec("int8").encode(torch.ones(63)).numpy()),
                )
            ],
            INVALID,
            Status.BAD_FRAME,
            "not aligned to the codec block of 64",
            "int8",
        ),
        id="int8-misaligned-chunk",
    ),
]


# ----------------------------------------------------------------------------------------- frame tests


@pytest.mark.parametrize("case", FP32_CASES + INT8_CASES)
async def test_malformed_frame_is_refused_and_round_untouched(
    ring2: list[Peer], attacker: Attacker, case: BadFrames
) -> None:
    """Each malformed frame gets its precise status; the open round fails with the tensor unchanged."""
    _, p1 = ring2
    await attacker.handshake(node_id="p0")
    before = await rejected_count(attacker)
    victim = await open_victim_round(p1, case.codec)

    await refused(attacker.push(*case.build(valid_frame(case.codec))), case.code, case.status, case.detail)

    await victim.failed_untouched()
    assert await rejected_count(attacker) == before + 1
    await assert_still_serves(ring2, attacker)


async def test_an_identical_resend_is_taken_once(ring2: list[Peer], attacker: Attacker) -> None:
    """A sender whose connection broke resends what it had sent (`transport.outbound`'s replay, when it takes
    the receiver for restarted): a frame identical to the chunk already taken at its place is ignored and
    fails nothing; other bytes at that place are DUPLICATE_CHUNK, and the round fails untouched."""
    _, p1 = ring2
    await attacker.handshake(node_id="p0")
    victim = await open_victim_round(p1)
    f = valid_frame()
    await attacker.push(f)
    rnd = p1.rounds.get(victim.key)
    assert rnd is not None
    received = rnd.progress()
    await attacker.push(f, f)  # a replay, twice over
    assert rnd.progress() == received and rnd.resent == 2 and not rnd.done.done()
    changed = tweak(f, payload=poke_f32(f.payload, 0, 1.5))
    await refused(attacker.push(changed), INVALID, Status.DUPLICATE_CHUNK, "already received")
    await victim.failed_untouched()
    await assert_still_serves(ring2, attacker)


async def test_barrage_leaves_no_trace_in_the_round(ring2: list[Peer], attacker: Attacker) -> None:
    """Every single-frame refusal against one round, then the valid frame is still accepted as new.

    A refused frame must not mark its chunk as received (the valid one would then be a duplicate); the
    rejection counter grows by exactly the refusals past the proto boundary.
    """
    _, p1 = ring2
    await attacker.handshake(node_id="p0")
    before = await rejected_count(attacker)
    victim = await open_victim_round(p1, timeout=2.0)  # time for ~30 refusals
    valid = valid_frame()
    counted = 0
    for param in FP32_CASES:
        case = cast(BadFrames, param.values[0])
        frames = case.build(valid)
        if len(frames) != 1:
            continue  # multi-frame cases deliver a valid first frame
        await refused(attacker.push(*frames), case.code, case.status, case.detail)
        counted += 1
    assert counted >= 20
    assert await rejected_count(attacker) == before + counted

    ack = await attacker.push(valid)
    assert (ack.status, ack.frames, ack.payload_bytes) == (pb.STATUS_OK, 1, 4 * 64)
    await victim.failed_untouched()
    await assert_still_serves(ring2, attacker)


async def test_overflowing_reduction_fails_round_at_once(ring2: list[Peer], attacker: Attacker) -> None:
    """Finite values whose sum overflows fp32: NON_FINITE, and the round fails now, not at its timeout."""
    _, p1 = ring2
    await attacker.handshake(node_id="p0")
    victim = await open_victim_round(p1, tensor=torch.full((N,), 3e38))
    frame = tweak(valid_frame(), payload=bytes(torch.full((64,), 3e38).numpy()))

    await refused(attacker.push(frame), INVALID, Status.NON_FINITE, "reduction became non-finite")

    failure = await victim.failed_untouched()
    assert "non-finite" in failure.reason
    await assert_still_serves(ring2, attacker)


async def test_frame_for_finished_rounds_is_stale(ring2: list[Peer], attacker: Attacker) -> None:
    """Frames for a failed victim round and for a completed round are ABORTED STALE_ROUND."""
    _, p1 = ring2
    await attacker.handshake(node_id="p0")
    victim = await open_victim_round(p1)
    await victim.failed_untouched()
    await assert_exact_mean(ring2)  # completes round 1 of group 0 on both peers
    before = await rejected_count(attacker)

    await refused(attacker.push(valid_frame()), grpc.StatusCode.ABORTED, Status.STALE_ROUND, "round 1 of group 3")
    completed = tweak(valid_frame(), group_id=0)
    await refused(attacker.push(completed), grpc.StatusCode.ABORTED, Status.STALE_ROUND, "round 1 of group 0")

    assert await rejected_count(attacker) == before + 2
    await assert_still_serves(ring2, attacker)


async def test_frame_from_a_member_that_is_not_the_predecessor() -> None:
    """In the ring [p0, p1, p2], p1's rounds take frames from p0 only: p2 gets UNKNOWN_PEER."""
    async with token_ring(3) as peers:
        p1 = peers[1]
        attacker = Attacker(p1.address)
        try:
            await attacker.handshake(node_id="p2")
            victim = await open_victim_round(p1)
            frame = tweak(valid_frame(world=3, rank=1), sender="p2")
            assert frame.chunk_length == 43  # segment 0 of 128 elements over 3 peers

            await refused(attacker.push(frame), grpc.StatusCode.PERMISSION_DENIED, Status.UNKNOWN_PEER, "expects 'p0'")

            await victim.failed_untouched()
            await assert_still_serves(peers, attacker)
        finally:
            await attacker.close()


@pytest.mark.parametrize(
    ("n", "size", "status", "detail"),
    [
        pytest.param(
            40_000, None, Status.OVERSIZE, f"payload of 80000 bytes exceeds limit {MAX_PAYLOAD}", id="above-max-payload"
        ),
        pytest.param(
            N,
            MAX_PAYLOAD + 1,
            Status.OVERSIZE,
            f"payload of {MAX_PAYLOAD + 1} bytes exceeds limit {MAX_PAYLOAD}",
            id="max-payload-plus-one",
        ),
        pytest.param(80_000, None, None, "larger than max", id="above-grpc-message-limit"),
        pytest.param(N, (128 << 10) + 1, None, "larger than max", id="grpc-message-limit-plus-one"),
    ],
)
async def test_oversize_frame_is_resource_exhausted(
    n: int, size: int | None, status: Status | None, detail: str
) -> None:
    """max_message_bytes = 128 KiB: a payload above the peer's own limit (64 KiB below it) is RESOURCE_EXHAUSTED
    OVERSIZE and counted as a rejected frame; one above the message limit is refused by gRPC itself
    (RESOURCE_EXHAUSTED, no application status, not counted). Either way the open round is left as it was.

    ``size`` replaces the valid frame's payload by that many zero bytes (the size is checked first).
    """
    async with token_ring(2, SMALL_MESSAGES) as peers:
        p1 = peers[1]
        assert p1.max_payload == MAX_PAYLOAD
        attacker = Attacker(p1.address)
        try:
            await attacker.handshake(node_id="p0")
            # time for the traces around the refusal before the round gives up
            victim = await open_victim_round(p1, tensor=torch.randn(n), timeout=1.0)
            frame = valid_frame(n=n)
            if size is None:
                assert len(frame.payload) == 4 * n // 2
            else:
                frame = tweak(frame, payload=bytes(size))
            before = Trace.of(p1, victim.key)

            lead = None if status is None else f"{status.name}: {detail}"
            await refused(attacker.push(frame), grpc.StatusCode.RESOURCE_EXHAUSTED, lead, detail)

            counted = int(status is not None)
            before.left_alone(Trace.of(p1, victim.key), rejected=counted)
            assert await rejected_count(attacker) == before.frames_rejected + counted
            await victim.failed_untouched()
            await assert_still_serves(peers, attacker)
        finally:
            await attacker.close()


@pytest.mark.parametrize(
    ("method", "md"),
    [
        pytest.param("Handshake", GOOD_MD, id="Handshake"),
        pytest.param("Probe", GOOD_MD, id="Probe"),
        pytest.param("Status", (), id="Status-no-token"),
        pytest.param("Probe", (), id="Probe-no-token"),
    ],
)
async def test_oversize_unary_message_is_refused_before_the_token(method: str, md: tuple[tuple[str, str], ...]) -> None:
    """A unary request above max_message_bytes is RESOURCE_EXHAUSTED from gRPC itself, checked before the
    token: a caller without it learns the size limit, nothing else. Nothing of the peer changes."""
    async with token_ring(2, SMALL_MESSAGES) as peers:
        p1 = peers[1]
        attacker = Attacker(p1.address)
        try:
            before = Trace.of(p1)
            call = attacker.channel.unary_unary(f"/dreamp2p.v1.Peer/{method}")
            big = bytes((128 << 10) + 1)
            await refused(
                call(big, metadata=md, timeout=CALL_TIMEOUT),
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                None,
                "larger than max",
            )
            before.left_alone(Trace.of(p1), rejected=0)
            await assert_still_serves(peers, attacker)
        finally:
            await attacker.close()


def _zstd_cases() -> list[object]:
    zstd = ZstdStage(1)
    need = 4 * 64

    def bomb(f: pb.DataFrame) -> list[pb.DataFrame]:
        # 8 MiB of zeros squeeze into a few hundred bytes, but the frame declares its true size
        return [tweak(f, zstd=True, raw_length=need, payload=zstd.compress(bytes(8 << 20), 4))]

    def nan(f: pb.DataFrame) -> list[pb.DataFrame]:
        raw = poke_f32(f.payload, 3, math.nan)
        return [tweak(f, zstd=True, raw_length=need, payload=zstd.compress(raw, 4))]

    return [
        pytest.param(bomb, Status.BAD_FRAME, "declares 8388608 bytes, expected 256", id="bomb"),
        pytest.param(
            one(zstd=True, raw_length=10**12),
            Status.BAD_FRAME,
            "raw_length 1000000000000, expected 256",
            id="raw-len",
        ),
        pytest.param(
            one(zstd=True, raw_length=need, payload=b"\x28\xb5\x2f\xfd" + bytes(12)),
            Status.BAD_FRAME,
            "zstd",
            id="corrupt",
        ),
        pytest.param(nan, Status.NON_FINITE, "nan", id="nan-inside"),
    ]


@pytest.mark.parametrize(("build", "status", "detail"), _zstd_cases())
async def test_bad_zstd_frame_is_refused(
    build: Callable[[pb.DataFrame], list[pb.DataFrame]], status: Status, detail: str
) -> None:
    """On a zstd ring: a decompression bomb, a lying raw_length, a corrupt stream, compressed NaN."""
    transport = TransportConfig(probe_interval_s=3600.0, round_timeout_s=5.0, rpc_deadline_s=5.0, zstd=True)
    async with token_ring(2, transport) as peers:
        attacker = Attacker(peers[1].address)
        try:
            await attacker.handshake(node_id="p0")
            victim = await open_victim_round(peers[1])

            await refused(attacker.push(*build(valid_frame())), INVALID, status, detail)

            await victim.failed_untouched()
            await assert_still_serves(peers, attacker)
        finally:
            await attacker.close()


async def test_frame_for_round_that_never_opens_times_out() -> None:
    """A frame ahead of the peer waits for its round at most round_timeout_s, then DEADLINE_EXCEEDED."""
    transport = TransportConfig(probe_interval_s=3600.0, round_timeout_s=0.3, rpc_deadline_s=5.0)
    async with token_ring(2, transport) as peers:
        attacker = Attacker(peers[1].address)
        try:
            await attacker.handshake(node_id="p0")
            frame = tweak(valid_frame(), group_id=100)
            await refused(attacker.push(frame), grpc.StatusCode.DEADLINE_EXCEEDED, Status.TIMEOUT, "(100, 1)")
            await assert_still_serves(peers, attacker)
        finally:
            await attacker.close()


# ------------------------------------------------------------------------------------------ auth tests


BAD_TOKENS = [
    pytest.param((), "missing authorization token", id="missing"),
    pytest.param((("authorization", "Bearer wrong"),), "bad authorization token", id="wrong"),
    pytest.param((("authorization", TOKEN),), "bad authorization token", id="no-scheme"),
    pytest.param((("authorization", f"bearer {TOKEN}"),), "bad authorization token", id="lowercase-scheme"),
    pytest.param((("authorization", f"Bearer {TOKEN[:-1]}"),), "bad authorization token", id="prefix"),
    pytest.param((("authorization", f"Bearer {TOKEN}x"),), "bad authorization token", id="extended"),
]

# The body each call carries: a request the peer accepts where the test has one, else an empty body (the
# default message). The token is checked before the body is read either way.
BODIES = {
    "Handshake": hello_request().SerializeToString(),
    "Probe": pb.ProbeRequest(nonce=5).SerializeToString(),
    "Status": pb.StatusRequest().SerializeToString(),
}
# Every RPC of the service; Push, which carries frames, has its own test below.
UNARY_REQUEST_METHODS = [m for m in SERVICE.methods if m.name != "Push"]


def raw_call(channel: aio.Channel, method: Any, md: Sequence[tuple[str, str]]) -> Awaitable[object]:
    """Call ``method`` of the Peer service with its BODIES entry (raw bytes, no serializers)."""
    path = f"/{SERVICE.full_name}/{method.name}"
    body = BODIES.get(method.name, b"")
    if method.client_streaming and method.server_streaming:
        raise AssertionError(f"{method.name}: bidirectional streams are not covered here")
    if method.client_streaming:

        async def stream() -> AsyncIterator[bytes]:
            yield body

        return channel.stream_unary(path)(stream(), metadata=md, timeout=CALL_TIMEOUT)
    if method.server_streaming:
        replies = channel.unary_stream(path)(body, metadata=md, timeout=CALL_TIMEOUT)

        async def drain() -> None:
            async for _ in replies:
                pass

        return drain()
    return channel.unary_unary(path)(body, metadata=md, timeout=CALL_TIMEOUT)


def test_every_servicer_rpc_is_in_the_service() -> None:
    """The token tests walk the proto service; the servicer implements nothing outside it."""
    rpcs = {name for name in vars(PeerServicer) if name[:1].isupper()}
    assert rpcs <= {m.name for m in SERVICE.methods}
    assert {"Handshake", "Push", "Probe", "Status"} <= rpcs
    assert "Push" in {m.name for m in SERVICE.methods if m.client_streaming}


@pytest.mark.parametrize("method", UNARY_REQUEST_METHODS, ids=lambda m: m.name)
@pytest.mark.parametrize(("md", "reason"), BAD_TOKENS)
async def test_bad_or_missing_token_is_unauthenticated(
    method: Any, md: tuple[tuple[str, str], ...], reason: str
) -> None:
    """Every RPC without the right bearer token is UNAUTHENTICATED BAD_TOKEN naming why; with the token the
    same call reaches its handler (which answers however it answers); nothing counts as a rejected frame,
    and the peer keeps serving."""
    async with running_peer() as peer:
        channel = aio.insecure_channel(peer.address)
        try:
            await refused(raw_call(channel, method, md), grpc.StatusCode.UNAUTHENTICATED, f"BAD_TOKEN: {reason}")
            assert peer.frames_rejected == 0
            try:
                await raw_call(channel, method, GOOD_MD)
            except aio.AioRpcError as err:
                assert err.code() != grpc.StatusCode.UNAUTHENTICATED, err.details()
            probe = pb_grpc.PeerStub(channel).Probe(pb.ProbeRequest(nonce=77), metadata=GOOD_MD, timeout=CALL_TIMEOUT)
            assert (await probe).nonce == 77
        finally:
            await channel.close(grace=None)


@pytest.mark.parametrize(("md", "reason"), BAD_TOKENS)
async def test_push_with_bad_or_missing_token_never_reaches_the_round(
    ring2: list[Peer], attacker: Attacker, md: tuple[tuple[str, str], ...], reason: str
) -> None:
    """A valid frame pushed without the right token is UNAUTHENTICATED BAD_TOKEN naming why, and not
    delivered nor counted as rejected: the same frame with the token is then accepted as new."""
    _, p1 = ring2
    await attacker.handshake(node_id="p0")
    victim = await open_victim_round(p1)
    before = await rejected_count(attacker)

    await refused(attacker.push(valid_frame(), md=md), grpc.StatusCode.UNAUTHENTICATED, f"BAD_TOKEN: {reason}")
    assert await rejected_count(attacker) == before
    ack = await attacker.push(valid_frame())
    assert ack.frames == 1

    await victim.failed_untouched()
    assert (await attacker.probe(nonce=77)).nonce == 77
    await assert_still_serves(ring2, attacker)


# ------------------------------------------------------------------------------------- handshake tests


@pytest.mark.parametrize(
    ("fields", "code", "status", "detail"),
    [
        pytest.param(
            {"cluster_id": "other"},
            grpc.StatusCode.FAILED_PRECONDITION,
            Status.CLUSTER_MISMATCH,
            "'other'",
            id="cluster",
        ),
        pytest.param(
            {"cluster_id": ""},
            grpc.StatusCode.FAILED_PRECONDITION,
            Status.CLUSTER_MISMATCH,
            "cluster ''",
            id="cluster-empty",
        ),
        pytest.param(
            {"protocol_version": PROTOCOL_VERSION + 1},
            grpc.StatusCode.FAILED_PRECONDITION,
            Status.VERSION_MISMATCH,
            f"protocol version {PROTOCOL_VERSION + 1}",
            id="version-next",
        ),
        pytest.param(
            {"protocol_version": 0},
            grpc.StatusCode.FAILED_PRECONDITION,
            Status.VERSION_MISMATCH,
            "protocol version 0",
            id="version-0",
        ),
        pytest.param(
            {"manifest_hash": bytes(32)},
            grpc.StatusCode.FAILED_PRECONDITION,
            Status.MANIFEST_MISMATCH,
            MANIFEST.hex()[:16],
            id="manifest",
        ),
        pytest.param(
            {"manifest_hash": b""},
            grpc.StatusCode.FAILED_PRECONDITION,
            Status.MANIFEST_MISMATCH,
            "manifest",
            id="manifest-empty",
        ),
        pytest.param(
            {"node_id": "mallory"},
            grpc.StatusCode.PERMISSION_DENIED,
            Status.UNKNOWN_PEER,
            "'mallory'",
            id="not-in-ring",
        ),
        pytest.param(
            {"node_id": ""},
            grpc.StatusCode.PERMISSION_DENIED,
            Status.UNKNOWN_PEER,
            "node ''",
            id="empty-node",
        ),
        pytest.param(
            {"codecs": [pb.CODEC_INT8]},
            INVALID,
            Status.UNKNOWN_CODEC,
            "cannot decode codec fp32",
            id="codecs",
        ),
    ],
)
async def test_bad_handshake_is_refused(
    ring2: list[Peer],
    attacker: Attacker,
    fields: dict[str, Any],
    code: grpc.StatusCode,
    status: Status,
    detail: str,
) -> None:
    """A handshake that disagrees on cluster, protocol, model or membership is refused precisely."""
    await refused(attacker.handshake(**fields), code, status, detail)
    reply = await attacker.handshake(node_id="p0")
    assert (reply.status, reply.node_id, reply.manifest_hash) == (pb.STATUS_OK, "p1", MANIFEST)
    await assert_still_serves(ring2, attacker)


async def test_refused_handshake_admits_nobody(ring2: list[Peer], attacker: Attacker) -> None:
    """mallory's refused handshake does not let it push frames."""
    await refused(attacker.handshake(node_id="mallory"), grpc.StatusCode.PERMISSION_DENIED, Status.UNKNOWN_PEER)
    await refused(
        attacker.push(tweak(valid_frame(), sender="mallory")),
        grpc.StatusCode.PERMISSION_DENIED,
        Status.UNKNOWN_PEER,
        "has not completed a handshake",
    )


# ---------------------------------------------------------------------------------------------- probes


@pytest.mark.parametrize(
    "fields",
    [
        pytest.param({"reply_bytes": MAX_PROBE_BYTES + 1}, id="reply-just-over"),
        pytest.param({"reply_bytes": 2**32 - 1}, id="reply-u32-max"),
        pytest.param({"burst": bytes(MAX_PROBE_BYTES + 1)}, id="burst-just-over"),
    ],
)
async def test_oversize_probe_is_refused(ring2: list[Peer], attacker: Attacker, fields: dict[str, Any]) -> None:
    """Probes above 4 MiB either way are RESOURCE_EXHAUSTED OVERSIZE; a small probe still echoes."""
    await refused(
        attacker.probe(nonce=1, sender="p0", **fields),
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        Status.OVERSIZE,
        f"probe larger than {MAX_PROBE_BYTES} bytes",
    )
    reply = await attacker.probe(nonce=9, reply_bytes=16)
    assert (reply.nonce, reply.burst) == (9, bytes(16))
    await assert_still_serves(ring2, attacker)


# ------------------------------------------------------------------- hand-encoded Push message bodies


# Not a protobuf message: an endless varint where the first field's key should be.
GARBAGE = b"\xff" * 16


def field(number: int, wire_type: int, body: bytes) -> bytes:
    """One protobuf field: key varint then ``body`` (already encoded for its wire type)."""
    return varint(number << 3 | wire_type) + body


def varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def payload_field(payload: bytes) -> bytes:
    return field(15, 2, varint(len(payload)) + payload)


def header_of(f: pb.DataFrame) -> bytes:
    """Every field of ``f`` but the payload, serialized."""
    return tweak(f, payload=b"", checksum=f.checksum).SerializeToString()


WIRE_BAD = [
    pytest.param(lambda f: GARBAGE, "varint longer than 10 bytes", id="garbage"),
    pytest.param(lambda f: f.SerializeToString()[:-1], "truncated message", id="cut-in-payload"),
    pytest.param(lambda f: header_of(f) + b"\x7a" + varint(257) + f.payload, "needs 257 bytes", id="length-past-end"),
    pytest.param(lambda f: header_of(tweak(f, view_id=0))[:-1], "field 16 needs 2 bytes", id="cut-in-sender"),
    pytest.param(lambda f: header_of(f)[:-1], "truncated message: varint", id="cut-in-view-id"),
    pytest.param(lambda f: b"\x00\x00" + f.SerializeToString(), "field number 0", id="field-0"),
    pytest.param(lambda f: f.SerializeToString() + field(20, 3, b""), "wire type 3", id="group-start"),
    pytest.param(lambda f: f.SerializeToString() + field(20, 6, b""), "wire type 6", id="wire-type-6"),
    pytest.param(lambda f: f.SerializeToString() + field(20, 1, b"\0" * 7), "truncated message", id="short-fixed64"),
    pytest.param(
        lambda f: field(1, 0, b"\xff" * 10 + b"\x01") + f.SerializeToString(), "varint longer", id="11-byte-varint"
    ),
    pytest.param(lambda f: field(2**29, 0, b"\x01") + f.SerializeToString(), "malformed DataFrame", id="field-2^29"),
]

WIRE_EQUIVALENT = [
    pytest.param(lambda f: payload_field(f.payload) + header_of(f), id="payload-first"),
    pytest.param(lambda f: f.SerializeToString() + field(99, 0, varint(7)), id="unknown-field"),
    pytest.param(lambda f: header_of(f) + payload_field(bytes(256)) + payload_field(f.payload), id="last-payload-wins"),
    pytest.param(
        lambda f: header_of(f) + b"\xfa\x80\x80\x00" + varint(len(f.payload)) + f.payload, id="overlong-payload-key"
    ),
]


@pytest.mark.parametrize(("encode", "detail"), WIRE_BAD)
async def test_malformed_push_body_is_bad_frame(
    ring2: list[Peer], attacker: Attacker, encode: Callable[[pb.DataFrame], bytes], detail: str
) -> None:
    """A Push body that is not a well-formed DataFrame is INVALID_ARGUMENT BAD_FRAME; the round is untouched."""
    await attacker.handshake(node_id="p0")
    victim = await open_victim_round(ring2[1])

    await refused(attacker.push_raw(encode(valid_frame())), INVALID, Status.BAD_FRAME, detail)

    await victim.failed_untouched()
    await assert_still_serves(ring2, attacker)


@pytest.mark.parametrize("encode", WIRE_EQUIVALENT)
async def test_equivalent_push_body_is_accepted(
    ring2: list[Peer], attacker: Attacker, encode: Callable[[pb.DataFrame], bytes]
) -> None:
    """Encodings protobuf parses into the valid frame (any field order, unknown fields, the last of a
    repeated payload, a non-minimal key) are accepted as that frame, and only once."""
    await attacker.handshake(node_id="p0")
    victim = await open_victim_round(ring2[1])
    body = encode(valid_frame())
    parsed = pb.DataFrame.FromString(body)
    parsed.DiscardUnknownFields()
    # the encoding is right: protobuf itself reads it as the valid frame
    assert parsed.SerializeToString(deterministic=True) == valid_frame().SerializeToString(deterministic=True)

    ack = await attacker.push_raw(body)
    assert (ack.frames, ack.payload_bytes) == (1, 4 * 64)
    rnd = ring2[1].rounds.get(victim.key)
    assert rnd is not None
    received = rnd.progress()
    await attacker.push(valid_frame())  # the same frame again: ignored, as an identical resend
    assert rnd.progress() == received and rnd.resent == 1
    await refused(attacker.push(tweak(valid_frame(), payload=poke_f32(valid_frame().payload, 0, 2.5))), INVALID)

    await victim.failed_untouched()
    await assert_still_serves(ring2, attacker)


# ------------------------------------------------------------------------------- partner rounds


async def test_failed_round_spares_other_rounds_of_partner(ring2: list[Peer]) -> None:
    """p1 gives up a round of group 3 that p0 never joined; p0's open round of group 0 must survive it."""
    p0, p1 = ring2
    victim = await open_victim_round(p1)
    mine, theirs = [torch.full((6,), 4.0)], [torch.full((6,), 2.0)]
    early = asyncio.create_task(p0.allreduce(mine, timeout=5.0))  # group 0, open on p0 before p1 gives up
    await victim.failed_untouched()

    await asyncio.gather(early, p1.allreduce(theirs, timeout=5.0))
    assert torch.equal(mine[0], torch.full((6,), 3.0))
    assert torch.equal(theirs[0], torch.full((6,), 3.0))
