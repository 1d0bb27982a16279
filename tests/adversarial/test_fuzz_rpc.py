"""Hypothesis-generated messages against every RPC of a live peer: none crashes it or changes its state.

Issue acceptance: "hypothesis-driven malformed messages against every RPC of a live server (>= 2,000 cases
in the suite): no crash, no state change, precise status codes." This file holds the randomized cases only:
generated handshakes, probes, status calls, Push streams (random, raw and mutated frames) and calls to
methods the peer does not have. Fixed inputs that must always run are ``@example`` cases of these tests
(a body that is not a protobuf message, an unknown method with and without the token); every other fixed
case, with the exact detail its refusal names, is in test_bad_input.py.

Setup. One token-protected ring ``[p0, p1]`` runs for the whole module on its own asyncio loop in a
background thread (as :class:`dreamp2p.sync.comm.thread.CommThread` runs a peer), so the ``@given`` functions stay
plain synchronous functions that drive a synchronous ``grpc`` client from the test thread. The attacker aims
at p1 and handshakes as ``p0``, p1's ring predecessor, so its frames get past the sender check (the
mutated-frame tests also handshake as ``p1``, whose frames then reach the round and are refused there). For
the Push tests p1 holds a *victim* averaging round open in group 3 that the real p0 never joins; frames
built from the valid frame of that round, with fields changed, go as deep as the round's validation. A
victim that accepted a frame or ended is replaced by a fresh one before the next example.

Every example checks, against snapshots of p1 taken on its loop before and after the call:

* the call answers OK or an error whose gRPC code is in the RPC's allowed set (never UNKNOWN or INTERNAL),
  whose details start with ``"STATUS_NAME: "`` for a :class:`~dreamp2p.errors.Status` that
  ``serde.GRPC_CODE`` maps to exactly that code. Where the answer is predictable it must be exactly the
  predicted status: a bad or missing token, an undecodable body, every handshake, probe and status call,
  and a frame refused before it reaches a round (structure, sender, stale/far-ahead/never-opened round);
  an accepted Push acknowledges exactly the frames and payload bytes sent;
* p1 still answers Status; ``rounds_completed``, p1's round counters and closed rounds are unchanged and
  nothing is left waiting; ``frames_rejected`` grew by exactly one per refused authenticated Push and not
  otherwise; admissions changed only by an accepted handshake (of its node only), the link byte count
  only by an accepted probe from p0 (by its burst size);
* every victim tensor the test ever held is bit-for-bit untouched, and a Push refused at its first frame
  (or a refused one-frame Push) leaves the victim round's buffer and chunk bookkeeping exactly as they were
  (the one documented exception: a frame whose reduction overflows fails the round, NON_FINITE "reduction
  became non-finite").

After each test function the victim is ended and a real all-reduce between p0 and p1 must produce the
exact mean. One more test covers the rest of the surface: calls to methods the peer does not have.
Messages above the size limits are fixed cases (64 MiB is too much to generate): test_bad_input.py.

Budget: ``QUOTA`` sums to 2,700 generated examples (asserted at import), plus explicit ones: 5 per codec for
the deepest refusals, and the fixed cases named above; the last test checks that the bodies ran at least
that often. Examples are derandomized, with a seed per test. p1's ``round_timeout_s`` is 0.1 s, so a frame
for a round that is not open yet (answered DEADLINE_EXCEEDED TIMEOUT) costs at most 0.1 s; the strategies
keep such frames rare. The module takes about 30 s.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import struct
import threading
import zlib
from collections import Counter
from collections.abc import Callable, Coroutine, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

import grpc
import numpy as np
import pytest
import torch
import xxhash
import zstandard
from conftest import poll_until, start_ring
from hypothesis import HealthCheck, example, given, seed, settings
from hypothesis import strategies as st
from rawpeer import CLUSTER, MANIFEST, TOKEN, hello_request

from dreamp2p import PROTOCOL_VERSION
from dreamp2p.collective.framecheck import check_early_frame
from dreamp2p.collective.partition import all_gather_recv, reduce_scatter_recv, split_segments
from dreamp2p.compression import ZstdStage, codec_names, get_codec
from dreamp2p.config import PeerConfig, TransportConfig
from dreamp2p.errors import PeerError, RoundFailed, Status
from dreamp2p.messages import Hello
from dreamp2p.peer import MAX_PROBE_BYTES, MAX_ROUNDS_AHEAD, Peer
from dreamp2p.peer.membership import view_id
from dreamp2p.transport import serde
from dreamp2p.transport.outbound import OutboundStream
from dreamp2p.v1 import peer_pb2 as pb
from dreamp2p.v1 import peer_pb2_grpc as pb_grpc

T = TypeVar("T")

GOOD_AUTH = f"Bearer {TOKEN}"
GOOD_MD: tuple[tuple[str, str], ...] = (("authorization", GOOD_AUTH),)
RING = ("p0", "p1")
# Group of the victim rounds; the real all-reduces use group 0.
VICTIM_GROUP = 3
# Elements of a victim buffer: two 64-element segments by default. For the blockwise codecs (64-element
# blocks) the second segment, which the all-gather frame carries, ends in a partial block: 22 elements for
# int8, an odd 3 for the two-per-byte int4 and e3m0.
N = 128
VICTIM_N = {"int8": 150, "int4": 131, "e3m0": 131}
# Element of the victim's received segment set near the top of its codec's range, so that a frame can
# overflow the reduction (fp16 tops out at 65504).
HUGE_AT = 5
HUGE = {"fp16": 6.0e4}
# Victims are abandoned explicitly; this only bounds one that a failing test leaves behind.
VICTIM_TIMEOUT = 300.0
# Deadline of every attacker call: a hang fails the test (its details carry no application status).
CALL_TIMEOUT = 10.0
FLT_MAX = 3.4028234663852886e38
# Not a protobuf message: an endless varint where the first field's key should be.
GARBAGE = b"\xff" * 16
FP32_ID = get_codec("fp32").wire_id
ALL_CODEC_IDS = [get_codec(name).wire_id for name in codec_names()]

# p1 gives up on a frame for a round that is not open after 0.1 s; p0 holds p1's victim frames (for a
# round it never opens) until the victim is abandoned. Both compress with zstd when it helps.
P1_TRANSPORT = TransportConfig(
    probe_interval_s=3600.0, round_timeout_s=0.1, rpc_deadline_s=5.0, connect_timeout_s=5.0, zstd=True
)
P0_TRANSPORT = replace(P1_TRANSPORT, round_timeout_s=120.0)

# Examples per test; the issue asks for >= 2,000 in the suite.
MUTATED_CODECS = ("fp32", "fp16", "int8", "int4", "e3m0")
QUOTA: dict[str, int] = {
    "handshake": 300,
    "probe": 250,
    "status": 200,
    "push_frames": 400,
    "push_raw": 400,
    "unknown_method": 150,
    **{f"push_mutated[{c}]": 200 for c in MUTATED_CODECS},
}
MIN_EXAMPLES = 2000
assert sum(QUOTA.values()) >= MIN_EXAMPLES
EXAMPLES: Counter[str] = Counter()

# gRPC codes each RPC may answer with: the images under serde.GRPC_CODE of the statuses it can raise.
C = grpc.StatusCode
ALLOWED: dict[str, set[grpc.StatusCode]] = {
    "Handshake": {C.OK, C.UNAUTHENTICATED, C.INVALID_ARGUMENT, C.FAILED_PRECONDITION, C.PERMISSION_DENIED},
    "Probe": {C.OK, C.UNAUTHENTICATED, C.INVALID_ARGUMENT, C.RESOURCE_EXHAUSTED},
    "Status": {C.OK, C.UNAUTHENTICATED, C.INVALID_ARGUMENT},
    "Push": {
        C.OK,
        C.UNAUTHENTICATED,
        C.INVALID_ARGUMENT,
        C.PERMISSION_DENIED,
        C.FAILED_PRECONDITION,
        C.ABORTED,
        C.DATA_LOSS,
        C.RESOURCE_EXHAUSTED,
        C.DEADLINE_EXCEEDED,
    },
}
# Statuses a frame that reached the open victim round may be refused with.
ROUND_REFUSALS = {
    Status.BAD_FRAME,
    Status.UNKNOWN_CODEC,
    Status.UNKNOWN_PEER,
    Status.DUPLICATE_CHUNK,
    Status.CHECKSUM_MISMATCH,
    Status.NON_FINITE,
    Status.STALE_ROUND,
    Status.VIEW_MISMATCH,
}
OVERFLOW = "reduction became non-finite"

FUZZ = settings(
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example],
)


# ------------------------------------------------------------------------------------------ wire helpers


def varint(n: int) -> bytes:
    """Protobuf base-128 varint of ``n >= 0`` (more than 64 bits give an over-long, invalid varint)."""
    out = bytearray()
    while n > 0x7F:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def encode_field(number: int, wire_type: int, value: int, blob: bytes, lie: int) -> bytes:
    """One protobuf field of any wire type, valid or not: ``lie`` shifts a declared length or cuts a fixed one."""
    key = varint(number << 3 | wire_type)
    if wire_type == 0:
        return key + varint(value)
    if wire_type in (1, 5):
        width = 8 if wire_type == 1 else 4
        return key + (value % (1 << 8 * width)).to_bytes(width, "little")[: width + min(lie, 0)]
    if wire_type == 2:
        return key + varint(max(0, len(blob) + lie)) + blob
    return key + blob[:4]  # group start/end and the undefined wire types 6 and 7


def checksum(payload: bytes) -> int:
    return xxhash.xxh3_64_intdigest(payload)


def try_parse(cls: type[T], body: bytes) -> T | None:
    try:
        return cls.FromString(body)  # type: ignore[attr-defined]
    except Exception:  # protobuf's DecodeError; any failure means the server cannot decode it either
        return None


def authorized(auth: Sequence[str]) -> bool | None:
    """True: every authorization value is the token; False: none is; None: mixed (either answer is fine)."""
    good = [value == GOOD_AUTH for value in auth]
    if good and all(good):
        return True
    return None if any(good) else False


def metadata(auth: Sequence[str]) -> tuple[tuple[str, str], ...]:
    return tuple(("authorization", value) for value in auth)


# ------------------------------------------------------------------------------------------- strategies


def uint(bits: int) -> st.SearchStrategy[int]:
    edges = [0, 1, 2, 63, 64, 65, 127, 128, 129, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**63 - 1, 2**63, 2**64 - 1]
    return st.one_of(st.sampled_from([v for v in edges if v < 2**bits]), st.integers(0, 2**bits - 1))


# proto3 enums are open int32s: unknown values, the extremes and negatives all reach the server.
ENUMS = st.one_of(st.integers(0, 10), st.sampled_from([2**31 - 1, -1, -(2**31)]))
TEXT = st.text(st.characters(codec="utf-8"), max_size=12)
SENDERS = st.one_of(st.sampled_from(["p0", "p1", "", "mallory", "P0", "p0 ", "p0\x00", "p2"]), TEXT)
AUTH_VALUE = st.one_of(
    st.just(GOOD_AUTH),
    st.sampled_from(
        [TOKEN, f"bearer {TOKEN}", f"Bearer {TOKEN[:-1]}", f"Bearer {TOKEN}x", f"Bearer  {TOKEN}", "Bearer ", ""]
    ),
    st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E), max_size=24),
)
# Three examples in four carry exactly the good token (so that frames get past it); the rest any 0-3
# authorization values.
AUTH = st.sampled_from([True, True, True, False]).flatmap(
    lambda good: st.just((GOOD_AUTH,)) if good else st.lists(AUTH_VALUE, max_size=3).map(tuple)
)
FIELD = st.builds(
    encode_field,
    number=st.one_of(st.integers(1, 20), st.sampled_from([0, 2**29 - 1, 2**29, 2**31])),
    wire_type=st.integers(0, 7),
    value=st.one_of(uint(64), st.integers(0, 2**70)),
    blob=st.binary(max_size=40),
    lie=st.integers(-3, 3),
)
PROTOISH = st.lists(FIELD, max_size=6).map(b"".join)
RAW_BODY = st.one_of(st.binary(max_size=200), PROTOISH)

# Round ids named relative to p1's state, resolved when the example runs (see resolve_round).
ROUND_PICK = st.tuples(
    st.sampled_from(["victim", "zero", "stale", "far", "max", "literal", "victim", "stale", "next"]), uint(64)
)
SPECIAL_FLOATS = [math.nan, -math.nan, math.inf, -math.inf, FLT_MAX, -FLT_MAX, 3e38, FLT_MAX / 128, 6e4, 1e-45, -0.0]


def weighted(*branches: tuple[st.SearchStrategy[Any], int]) -> st.SearchStrategy[Any]:
    """One of ``branches``, each drawn in proportion to its weight (``one_of`` draws them evenly)."""
    indices = [i for i, (_, weight) in enumerate(branches) for _ in range(weight)]
    return st.sampled_from(indices).flatmap(lambda i: branches[i][0])


# "f32" writes a special float into the codec bytes before the zstd stage: at element 0 (for blockwise
# codecs the first block's scale), at HUGE_AT (overflows the reduction) or anywhere.
PAYLOAD_OP = weighted(
    (st.tuples(st.just("f32"), st.sampled_from([0, HUGE_AT]) | st.integers(0, 70), st.sampled_from(SPECIAL_FLOATS)), 4),
    (st.tuples(st.just("flip"), st.integers(0, 2**16), st.integers(0, 7)), 2),
    (st.tuples(st.just("truncate"), st.integers(1, 300)), 1),
    (st.tuples(st.just("extend"), st.binary(min_size=1, max_size=16)), 1),
    (st.tuples(st.just("replace"), st.binary(max_size=300)), 1),
    (st.tuples(st.just("bomb")), 1),
    (
        st.tuples(st.just("zstd"), st.sampled_from(["nosize", "long", "short", "two", "skippable", "badsum", "plain"])),
        2,
    ),
)


def numeric(bits: int) -> st.SearchStrategy[tuple[str, int]]:
    return st.one_of(st.tuples(st.just("set"), uint(bits)), st.tuples(st.just("add"), st.integers(-70, 70)))


# The payload and the size/offset fields go deepest into the round's validation: they weigh most.
MUTATION = weighted(
    (st.tuples(st.just("payload"), PAYLOAD_OP), 6),
    (st.tuples(st.just("chunk_offset"), numeric(64)), 2),
    (st.tuples(st.just("chunk_length"), numeric(64)), 2),
    (st.tuples(st.just("raw_length"), numeric(64)), 2),
    (st.tuples(st.just("codec"), ENUMS), 2),
    (st.tuples(st.just("sender"), SENDERS), 2),
    (st.tuples(st.just("zstd"), st.booleans()), 1),
    (st.tuples(st.just("checksum"), numeric(64)), 1),
    (st.tuples(st.just("dtype"), ENUMS), 1),
    (st.tuples(st.just("phase"), ENUMS), 1),
    (st.tuples(st.just("ring_step"), numeric(32)), 1),
    (st.tuples(st.just("segment_index"), numeric(32)), 1),
    (st.tuples(st.just("element_count"), numeric(64)), 1),
    (st.tuples(st.just("plan_version"), numeric(32)), 1),
    (st.tuples(st.just("round_id"), ROUND_PICK), 1),
    (st.tuples(st.just("group_id"), st.sampled_from([0, 7, 2**32 - 1])), 1),
)


def stream_of(message: st.SearchStrategy[T]) -> st.SearchStrategy[list[T]]:
    """A Push stream: one message two times in three (every message then reaches the checks), else 2-4."""
    return weighted((st.lists(message, min_size=1, max_size=1), 2), (st.lists(message, min_size=2, max_size=4), 1))


@dataclass(frozen=True)
class FrameRecipe:
    """A valid frame of the victim round (reduce-scatter or all-gather, plain or zstd), at most one field off."""

    kind: str
    zstd: bool
    mutation: tuple[str, Any] | None
    fix_checksum: bool


RECIPE = st.builds(
    FrameRecipe,
    kind=st.sampled_from(["rs", "ag"]),
    zstd=st.booleans(),
    mutation=weighted((st.none(), 1), (MUTATION, 3)),
    fix_checksum=st.sampled_from([True, True, True, False]),
)
BYTE_EDIT = st.one_of(
    st.tuples(st.just("flip"), st.integers(0, 2**16), st.integers(0, 7)),
    st.tuples(st.just("delete"), st.integers(0, 2**16), st.integers(1, 8)),
    st.tuples(st.just("insert"), st.integers(0, 2**16), st.binary(min_size=1, max_size=8)),
    st.tuples(st.just("truncate"), st.integers(0, 2**16)),
    st.tuples(st.just("append"), FIELD),
    st.tuples(st.just("prepend"), FIELD),
)
RAW_MESSAGE = st.one_of(
    st.tuples(st.just("bytes"), RAW_BODY),
    st.tuples(
        st.just("edit"), st.sampled_from(["rs", "ag"]), st.booleans(), st.lists(BYTE_EDIT, min_size=1, max_size=3)
    ),
    st.tuples(st.just("valid"), st.sampled_from(["rs", "ag"]), st.booleans()),
)


def keep_or(strategy: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """None (keep the valid frame's value; two times in three) or a value of ``strategy``."""
    return weighted((st.none(), 2), (strategy, 1))


# Several fields at once: each keeps the victim's valid value or takes an arbitrary one.
RANDOM_FRAME = st.fixed_dictionaries(
    {
        "round_id": keep_or(ROUND_PICK),
        "group_id": keep_or(st.sampled_from([0, 0, 7])),
        "plan_version": keep_or(uint(32)),
        "phase": keep_or(ENUMS),
        "ring_step": keep_or(uint(32)),
        "segment_index": keep_or(uint(32)),
        "chunk_offset": keep_or(uint(64)),
        "chunk_length": keep_or(uint(64)),
        "codec": keep_or(ENUMS),
        "dtype": keep_or(ENUMS),
        "element_count": keep_or(uint(64)),
        "checksum": keep_or(uint(64)),
        "zstd": keep_or(st.booleans()),
        "raw_length": keep_or(uint(64)),
        "payload": keep_or(st.binary(max_size=300)),
        "sender": keep_or(SENDERS),
        "fix_checksum": st.booleans(),
        "kind": st.sampled_from(["rs", "ag"]),
    }
)


def apply_edits(body: bytes, edits: Sequence[tuple[Any, ...]]) -> bytes:
    out = bytearray(body)
    for edit in edits:
        kind = edit[0]
        if kind == "flip" and out:
            out[edit[1] % len(out)] ^= 1 << edit[2]
        elif kind == "delete" and out:
            pos = edit[1] % len(out)
            del out[pos : pos + edit[2]]
        elif kind == "insert":
            pos = edit[1] % (len(out) + 1)
            out[pos:pos] = edit[2]
        elif kind == "truncate":
            del out[edit[1] % (len(out) + 1) :]
        elif kind == "append":
            out += edit[1]
        elif kind == "prepend":
            out[0:0] = edit[1]
    return bytes(out)


# ------------------------------------------------------------------------------------------- the cluster


@dataclass(frozen=True)
class RoundState:
    """What a delivered frame changes in a round: its buffer and chunk bookkeeping."""

    received: int
    chunks: tuple[Any, ...]
    acc: torch.Tensor
    done: bool

    def same_as(self, other: RoundState) -> bool:
        return (self.received, self.chunks, self.done) == (other.received, other.chunks, other.done) and torch.equal(
            self.acc.view(torch.int32), other.acc.view(torch.int32)
        )


@dataclass(frozen=True)
class PeerState:
    """p1's state as an attacker could change it, read on p1's loop."""

    admitted: dict[str, Hello]
    next_round: dict[int, int]
    closed: dict[int, frozenset[int]]
    open_rounds: frozenset[tuple[int, int]]
    pending: int
    rounds_completed: int
    rounds_failed: int
    frames_rejected: int
    p0_link_received: int
    victim: RoundState | None


@dataclass
class Victim:
    """An averaging round p1 opened in VICTIM_GROUP; the real p0 never joins it."""

    codec: str
    key: tuple[int, int]
    tensor: torch.Tensor
    pristine: torch.Tensor
    task: asyncio.Task[object] | None
    stream: OutboundStream | None
    dirty: bool = False

    def untouched(self) -> bool:
        return torch.equal(self.tensor.view(torch.int32), self.pristine.view(torch.int32))


@dataclass
class Cluster:
    """p0 and p1 on a private event loop thread, and a synchronous raw client aimed at p1."""

    loop: asyncio.AbstractEventLoop
    thread: threading.Thread
    p0: Peer
    p1: Peer
    channel: grpc.Channel
    stub: pb_grpc.PeerStub
    victim: Victim | None = None
    # (tensor, pristine copy) of every victim so far; the rest of a victim is dropped once it has ended
    held: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)

    @staticmethod
    def start() -> Cluster:
        loop = asyncio.new_event_loop()
        thread = threading.Thread(target=loop.run_forever, name="fuzz-peers", daemon=True)
        thread.start()
        p0, p1 = asyncio.run_coroutine_threadsafe(_start_ring(), loop).result(30)
        # replies (probe bursts) up to 4 MiB exceed the default 4 MiB receive limit of a client
        channel = grpc.insecure_channel(p1.address, options=[("grpc.max_receive_message_length", 64 << 20)])
        c = Cluster(loop, thread, p0, p1, channel, pb_grpc.PeerStub(channel))
        c.stub.Handshake(hello_request(), metadata=GOOD_MD, timeout=CALL_TIMEOUT)
        c.exact_mean()  # group 0 has a finished round: frames for it are stale, far beyond it too far
        return c

    def call(self, coro: Coroutine[Any, Any, T], timeout: float = 60.0) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def on_loop(self, fn: Callable[[], T]) -> T:
        async def run() -> T:
            return fn()

        return self.call(run())

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.abandon_victim()
        self.channel.close()
        self.call(_close_ring(self.p0, self.p1))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        if not self.thread.is_alive():
            self.loop.close()

    # ---------------------------------------------------------------------------- p1's state

    def state(self) -> PeerState:
        victim = self.victim
        return self.on_loop(lambda: _snapshot(self.p1, victim.key if victim else None))

    def status(self) -> pb.StatusResponse:
        """p1's Status over the wire (it must still answer), cross-checked with its counters."""
        reply = self.stub.Status(pb.StatusRequest(), metadata=GOOD_MD, timeout=CALL_TIMEOUT)
        assert (reply.node_id, reply.cluster_id, tuple(reply.ring)) == ("p1", CLUSTER, RING)
        return reply

    # ---------------------------------------------------------------------------- the victim

    def ensure_victim(self, codec: str) -> Victim:
        """The open victim round of ``codec``; a fresh one if the last changed, ended or used another codec."""
        v = self.victim
        if v is not None and v.codec == codec and not v.dirty and v.task and not self.on_loop(v.task.done):
            return v
        self.abandon_victim()
        n = VICTIM_N.get(codec, N)
        tensor = torch.randn(n, generator=torch.Generator().manual_seed(len(self.held)))
        tensor[HUGE_AT] = HUGE.get(codec, 3e38)
        v = self.call(_open_victim(self.p1, codec, tensor))
        self.victim = v
        self.held.append((v.tensor, v.pristine))
        return v

    def abandon_victim(self) -> None:
        """Cancel the victim round and its stream to p0; its tensor must be untouched."""
        v, self.victim = self.victim, None
        if v is None:
            return
        outcome = self.call(_abandon(self.p0, v))
        assert outcome == RoundFailed.__name__, outcome
        assert v.untouched()

    def victims_untouched(self) -> None:
        assert all(torch.equal(t.view(torch.int32), p.view(torch.int32)) for t, p in self.held)

    # ---------------------------------------------------------------------------- real rounds

    def exact_mean(self) -> None:
        """p0 and p1 average in group 0 and both end with the exact mean; p1 counts one more round."""
        before = self.status().rounds_completed
        self.call(_exact_mean(self.p0, self.p1))
        assert self.status().rounds_completed == before + 1

    def finish(self) -> None:
        """End of a test function: drop the victim, then the ring must still average exactly."""
        self.abandon_victim()
        self.victims_untouched()
        self.exact_mean()

    # ---------------------------------------------------------------------------- calls

    def unary(self, method: str, body: bytes, auth: Sequence[str]) -> tuple[grpc.StatusCode, str, bytes]:
        return self.unary_path(f"/dreamp2p.v1.Peer/{method}", body, auth)

    def unary_path(self, path: str, body: bytes, auth: Sequence[str]) -> tuple[grpc.StatusCode, str, bytes]:
        call = self.channel.unary_unary(path)
        try:
            reply = call(body, metadata=metadata(auth), timeout=CALL_TIMEOUT)
        except grpc.RpcError as err:
            return err.code(), err.details() or "", b""
        return grpc.StatusCode.OK, "", reply

    def push(self, messages: Sequence[bytes], auth: Sequence[str]) -> tuple[grpc.StatusCode, str, pb.PushAck | None]:
        call = self.channel.stream_unary(serde.PUSH_METHOD, response_deserializer=pb.PushAck.FromString)
        try:
            ack = call(iter(messages), metadata=metadata(auth), timeout=CALL_TIMEOUT)
        except grpc.RpcError as err:
            return err.code(), err.details() or "", None
        return grpc.StatusCode.OK, "", ack


async def _start_ring() -> tuple[Peer, Peer]:
    configs = [
        PeerConfig(node_id=node, cluster_id=CLUSTER, token=TOKEN, manifest_hash=MANIFEST, transport=transport)
        for node, transport in zip(RING, (P0_TRANSPORT, P1_TRANSPORT), strict=True)
    ]
    p0, p1 = await start_ring(configs, timeout=5.0)
    return p0, p1


async def _close_ring(p0: Peer, p1: Peer) -> None:
    await asyncio.gather(p0.close(grace=0.1), p1.close(grace=0.1))


def _snapshot(p1: Peer, victim_key: tuple[int, int] | None) -> PeerState:
    rnd = p1.rounds.get(victim_key) if victim_key else None
    registry = p1.rounds.snapshot()
    victim = None
    if rnd is not None:
        received, starts, lengths = rnd.progress()
        victim = RoundState(
            received=received,
            chunks=(starts, lengths),
            acc=rnd.acc.clone(),
            done=rnd.done.done(),
        )
    return PeerState(
        admitted=p1.admitted(),
        next_round=registry.next_round,
        closed=registry.closed,
        open_rounds=registry.open_rounds,
        pending=registry.pending,
        rounds_completed=p1.rounds_completed,
        rounds_failed=p1.rounds_failed,
        frames_rejected=p1.frames_rejected,
        p0_link_received=p1.link("p0").stats.bytes_received,
        victim=victim,
    )


async def _open_victim(p1: Peer, codec: str, tensor: torch.Tensor) -> Victim:
    key = (VICTIM_GROUP, p1.rounds.snapshot().next_round.get(VICTIM_GROUP, 0) + 1)
    task = asyncio.ensure_future(p1.allreduce([tensor], group_id=VICTIM_GROUP, codec=codec, timeout=VICTIM_TIMEOUT))
    await poll_until(lambda: p1.rounds.get(key) is not None or task.done(), 0.005)
    victim_round = p1.rounds.get(key)
    assert victim_round is not None, f"victim round {key} did not open"
    stream = victim_round.out
    assert stream is None or isinstance(stream, OutboundStream)
    return Victim(codec, key, tensor, tensor.clone(), task, stream)


async def _abandon(p0: Peer, v: Victim) -> str:
    """End the victim round; returns how its task ended (the error type, or "cancelled").

    p0 closes the round it never opened, so it refuses the frame p1's victim stream carries (ABORTED), the
    stream fails and with it the round. Cancelling the round's task instead would cancel its gRPC call,
    and a cancelled grpc.aio call keeps its HTTP/2 stream until the call object is garbage-collected (the
    failed round's frames hold it in a reference cycle): 64 of them (max_concurrent_streams) stall every
    later call on p1's channel to p0.
    """
    task, v.task = v.task, None
    assert task is not None
    p0.rounds.close(v.key)
    await asyncio.wait({task}, timeout=30.0)
    if not task.done():  # not expected: fall back to cancelling it
        task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        outcome = "cancelled"
    except BaseException as exc:
        outcome = type(exc).__name__
    else:
        raise AssertionError(f"victim round {v.key} completed")
    stream, v.stream = v.stream, None
    await poll_until(lambda: stream is None or stream.calls_done(), 0.005)
    assert stream is None or stream.calls_done(), f"p1's Push of victim round {v.key} to p0 did not end"
    return outcome


async def _exact_mean(p0: Peer, p1: Peer) -> None:
    data = [
        [torch.arange(64, dtype=torch.float32).view(8, 8) * (2 * i + 1), torch.full((5,), float(3 * i))]
        for i in range(2)
    ]
    expected = [(data[0][j] + data[1][j]) / 2 for j in range(2)]
    await asyncio.gather(*(p.allreduce(d, timeout=10.0) for p, d in zip((p0, p1), data, strict=True)))
    for d in data:
        for got, want in zip(d, expected, strict=True):
            assert torch.equal(got, want)


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    c = Cluster.start()
    try:
        yield c
    finally:
        c.close()


# ------------------------------------------------------------------------------------------- frames


ZSTD = ZstdStage(1)
_bomb: list[bytes] = []


def zstd_bomb() -> bytes:
    """8 MiB of zeros as a few hundred bytes of zstd that declares its true size."""
    if not _bomb:
        _bomb.append(ZSTD.compress(bytes(8 << 20), 4))
    return _bomb[0]


def zstd_variant(raw: bytes, itemsize: int, variant: str) -> bytes:
    """``raw`` as zstd the way ZstdStage writes it (byte-shuffled, one frame, size declared), or not quite."""
    shuffled = np.frombuffer(raw, dtype=np.uint8).reshape(-1, itemsize).T.tobytes()
    unsized = zstandard.ZstdCompressor(write_content_size=False)
    if variant == "nosize":  # valid, but the frame does not declare its size
        return unsized.compress(shuffled)
    if variant == "long":  # more than raw_length, size undeclared
        return unsized.compress(shuffled + shuffled)
    if variant == "short":
        return unsized.compress(shuffled[: len(shuffled) // 2])
    if variant == "two":  # trailing data after the frame
        return ZSTD.compress(raw, itemsize) * 2
    if variant == "skippable":  # a skippable frame first
        return b"\x50\x2a\x4d\x18" + struct.pack("<I", 4) + b"skip" + ZSTD.compress(raw, itemsize)
    if variant == "badsum":  # the frame's content checksum is wrong
        data = bytearray(ZSTD.compress(raw, itemsize))
        data[-1] ^= 0xFF
        return bytes(data)
    return zstandard.ZstdCompressor(write_content_size=True).compress(raw)  # not byte-shuffled


def raw_codec_bytes(codec: str, length: int) -> bytes:
    return bytes(get_codec(codec).encode(torch.linspace(-2.0, 2.0, length, dtype=torch.float32)).numpy())


def valid_frame(v: Victim, kind: str, zstd: bool, raw: bytes | None = None) -> pb.DataFrame:
    """The frame the victim round accepts from p0: its whole reduce-scatter or all-gather segment, in one chunk.

    ``raw`` replaces the codec bytes (they are compressed when ``zstd``); the checksum is right.
    """
    c = get_codec(v.codec)
    seg_index = reduce_scatter_recv(1, 2, 0) if kind == "rs" else all_gather_recv(1, 2, 0)
    seg = split_segments(v.tensor.numel(), 2, c.block)[seg_index]
    if raw is None:
        raw = raw_codec_bytes(v.codec, seg.length)
    payload = ZSTD.compress(raw, c.itemsize) if zstd else raw
    wire_id: Any = c.wire_id  # an int the generated enum type accepts
    return pb.DataFrame(
        round_id=v.key[1],
        plan_version=0,
        group_id=VICTIM_GROUP,
        phase=pb.PHASE_REDUCE_SCATTER if kind == "rs" else pb.PHASE_ALL_GATHER,
        ring_step=0,
        segment_index=seg.index,
        chunk_offset=seg.start,
        chunk_length=seg.length,
        codec=wire_id,
        dtype=pb.DTYPE_FP32,
        element_count=v.tensor.numel(),
        checksum=checksum(payload),
        zstd=zstd,
        raw_length=len(raw) if zstd else 0,
        payload=payload,
        sender="p0",
        view_id=view_id(RING),
    )


def resolve_round(pick: tuple[str, int], group: int, s: PeerState, victim_round: int) -> int:
    """A round id of ``pick``'s kind for ``group`` in p1's current state."""
    tag, literal = pick
    newest = s.next_round.get(group, 0)
    if tag == "victim":
        return victim_round
    if tag == "zero":
        return 0
    if tag == "stale":
        return 1 + literal % newest if newest else 0
    if tag == "far":
        return min(2**64 - 1, newest + MAX_ROUNDS_AHEAD + 1 + literal % 1000)
    if tag == "max":
        return 2**64 - 1
    if tag == "next":
        return newest + 1  # not open here: waits round_timeout_s (0.1 s), then TIMEOUT
    return literal


def poke_f32(data: bytes, index: int, value: float) -> bytes:
    if len(data) < 4:
        return data
    out = bytearray(data)
    struct.pack_into("<f", out, 4 * (index % (len(out) // 4)), value)
    return bytes(out)


def mutated(v: Victim, recipe: FrameRecipe, s: PeerState) -> pb.DataFrame:
    """``recipe``'s frame: the valid one with at most one field changed (the checksum follows if asked)."""
    f = valid_frame(v, recipe.kind, recipe.zstd)
    if recipe.mutation is None:
        return f
    name, op = recipe.mutation
    if name == "round_id":
        f.round_id = resolve_round(op, f.group_id, s, v.key[1])
    elif name == "payload":
        kind = op[0]
        if kind == "f32":  # a special value inside the codec bytes (fp32 data, or a block scale)
            raw = raw_codec_bytes(v.codec, f.chunk_length)
            f = valid_frame(v, recipe.kind, recipe.zstd, poke_f32(raw, op[1], op[2]))
        elif kind == "truncate":
            f.payload = f.payload[: max(0, len(f.payload) - op[1])]
        elif kind == "extend":
            f.payload += op[1]
        elif kind == "flip":
            data = bytearray(f.payload)
            data[op[1] % len(data)] ^= 1 << op[2]
            f.payload = bytes(data)
        elif kind == "replace":
            f.payload = op[1]
        elif kind == "bomb":
            f.payload = zstd_bomb()
        elif kind == "zstd":  # another zstd encoding of the valid codec bytes, declared as zstd
            raw = raw_codec_bytes(v.codec, f.chunk_length)
            f.payload = zstd_variant(raw, get_codec(v.codec).itemsize, op[1])
            f.zstd, f.raw_length = True, len(raw)
    elif isinstance(op, tuple):  # numeric: set, or add with wrap-around in the field's width
        bits = 64 if name in ("chunk_offset", "chunk_length", "element_count", "checksum", "raw_length") else 32
        mode, value = op
        setattr(f, name, value if mode == "set" else (getattr(f, name) + value) % 2**bits)
    else:
        setattr(f, name, op)
    if recipe.fix_checksum and name != "checksum":
        f.checksum = checksum(f.payload)
    return f


def random_frame(v: Victim, spec: dict[str, Any], s: PeerState) -> pb.DataFrame:
    """The victim's valid frame with every field ``spec`` gives replaced (round ids resolved against ``s``)."""
    f = valid_frame(v, spec["kind"], zstd=False)
    for name, value in spec.items():
        if name == "round_id" and value is not None:
            f.round_id = resolve_round(value, f.group_id if spec["group_id"] is None else spec["group_id"], s, v.key[1])
        elif value is not None and name not in ("fix_checksum", "kind"):
            setattr(f, name, value)
    if spec["fix_checksum"] and spec["checksum"] is None:
        f.checksum = checksum(f.payload)
    return f


# ------------------------------------------------------------------------------------------ oracles


def refusal(rpc: str, code: grpc.StatusCode, details: str) -> Status | None:
    """None for OK; else the application status leading ``details``, checked against the gRPC code."""
    assert code in ALLOWED[rpc], f"{rpc}: {code} {details!r}"
    if code == grpc.StatusCode.OK:
        return None
    name, sep, _ = details.partition(": ")
    assert sep and name in Status.__members__, f"{rpc}: {code} without an application status: {details!r}"
    status = Status[name]
    assert serde.GRPC_CODE[status] == code, f"{rpc}: {status.name} travelled as {code}: {details!r}"
    return status


def expected_hello(m: pb.HandshakeRequest) -> Status:
    """What p1's admit() must answer, checked in its documented order."""
    if m.cluster_id != CLUSTER:
        return Status.CLUSTER_MISMATCH
    if m.protocol_version != PROTOCOL_VERSION:
        return Status.VERSION_MISMATCH
    if bytes(m.manifest_hash) != MANIFEST:
        return Status.MANIFEST_MISMATCH
    if m.node_id not in RING:
        return Status.UNKNOWN_PEER
    if FP32_ID not in m.codecs:  # p1 averages with fp32 by default
        return Status.UNKNOWN_CODEC
    return Status.OK


def expected_frame(f: pb.DataFrame, s: PeerState, max_payload: int) -> Status | None:
    """The status p1 must refuse ``f`` with before it reaches a round; None when ``f`` reaches the open round.

    Structure (serde), then the sender's admission, then the round: open, stale, too far ahead, refused by
    the checks of a frame that would wait (`collective.framecheck`), or waited for (TIMEOUT after p1's
    round_timeout_s).
    """
    if len(f.payload) > max_payload:
        return Status.OVERSIZE
    if f.phase not in (1, 2) or f.dtype not in (1, 2, 3):
        return Status.BAD_FRAME
    if f.codec == 0:
        return Status.UNKNOWN_CODEC
    if not f.sender or (f.chunk_length == 0 and f.payload):
        return Status.BAD_FRAME
    if f.sender not in s.admitted:  # a ring member must handshake (again); anyone else is unknown
        return Status.NEEDS_HANDSHAKE if f.sender in RING else Status.UNKNOWN_PEER
    if (f.group_id, f.round_id) in s.open_rounds:
        return None
    newest = s.next_round.get(f.group_id, 0)
    if f.round_id == 0 or f.round_id in s.closed.get(f.group_id, ()) or f.round_id <= newest:
        return Status.STALE_ROUND
    if newest and f.round_id > newest + MAX_ROUNDS_AHEAD:
        return Status.BAD_FRAME
    try:  # a frame that would wait is checked as far as it can be without its round (collective.framecheck)
        check_early_frame(serde.frame_from_proto(f, max_payload), len(RING), max_payload)
    except PeerError as err:
        return err.status
    return Status.TIMEOUT


def common_invariants(cluster: Cluster, before: PeerState, after: PeerState, rejected: int, push: bool = False) -> None:
    """What no call may change; Status must still answer and agree with the counters.

    Only a Push may end the victim round (a frame whose reduction overflows fails it), counting a failed round.
    """
    reply = cluster.status()
    assert reply.rounds_completed == after.rounds_completed == before.rounds_completed
    assert before.rounds_failed <= after.rounds_failed <= before.rounds_failed + int(push)
    assert reply.frames_rejected == after.frames_rejected == before.frames_rejected + rejected
    assert after.pending == 0, "a refused frame left a round waiter behind"
    assert after.next_round == before.next_round
    victim_key = {cluster.victim.key} if cluster.victim else set()
    for group, ids in after.closed.items():
        assert ids <= before.closed.get(group, frozenset()) | {k[1] for k in victim_key if k[0] == group}
    assert after.open_rounds <= before.open_rounds
    cluster.victims_untouched()


def same_admissions(before: PeerState, after: PeerState) -> None:
    assert after.admitted.keys() == before.admitted.keys()
    assert all(after.admitted[k] is before.admitted[k] for k in before.admitted)


def check_push(cluster: Cluster, messages: Sequence[bytes], auth: Sequence[str], before: PeerState) -> None:
    """Send one Push stream of ``messages`` to p1 and check the answer and p1's state against ``before``."""
    assert cluster.victim is not None
    code, details, ack = cluster.push(messages, auth)
    after = cluster.state()
    status = refusal("Push", code, details)
    ok = authorized(auth)
    if ok is False:
        assert status == Status.BAD_TOKEN, details
    if status == Status.BAD_TOKEN:
        assert ok is not True, details
    authenticated = status != Status.BAD_TOKEN

    first = try_parse(pb.DataFrame, messages[0])
    predicted: Status | None = None
    allowed: set[Status | None]
    if authenticated:
        if first is None:
            predicted = Status.BAD_FRAME  # protobuf cannot parse it: neither can the server
            allowed = {predicted}
        else:
            predicted = expected_frame(first, before, cluster.p1.max_payload)
            allowed = {predicted}
            if first.SerializeToString() != messages[0]:
                allowed.add(Status.BAD_FRAME)  # hand-encoded: may hold groups, which the server refuses
        if predicted is not None:
            assert status in allowed, (predicted, details)
        elif status is not None and len(messages) == 1:
            assert status in ROUND_REFUSALS, details
    common_invariants(cluster, before, after, rejected=int(authenticated and status is not None), push=True)
    same_admissions(before, after)

    if status is None:
        assert ack is not None
        parsed = [pb.DataFrame.FromString(m) for m in messages]
        assert (ack.status, ack.frames, ack.payload_bytes) == (
            pb.STATUS_OK,
            len(messages),
            sum(len(m.payload) for m in parsed),
        )
    untouched = not authenticated or predicted is not None or (status is not None and len(messages) == 1)
    if untouched and OVERFLOW in details:
        assert cluster.victim.key not in after.open_rounds or (after.victim and after.victim.done), details
    elif untouched:
        assert before.victim is not None and after.victim is not None, "the victim round ended"
        assert after.victim.same_as(before.victim), f"refused frames changed the round: {details!r}"
        assert after.p0_link_received == before.p0_link_received
    if after.victim is None or before.victim is None or not after.victim.same_as(before.victim):
        cluster.victim.dirty = True  # the next example gets a fresh round


# ---------------------------------------------------------------------------------------------- tests


def test_fuzz_handshake(cluster: Cluster) -> None:
    """Handshakes with any field values, or any bytes, with any token: exactly admit()'s answer."""
    fields: dict[str, st.SearchStrategy[Any]] = {
        "cluster_id": st.one_of(st.sampled_from(["", "other", CLUSTER + " ", CLUSTER.upper()]), TEXT),
        "protocol_version": st.one_of(st.just(PROTOCOL_VERSION), uint(32)),
        "node_id": st.one_of(st.sampled_from(["p0", "p1", "", "mallory", "p2", "P1"]), TEXT),
        "manifest_hash": st.one_of(
            st.sampled_from([b"", bytes(32), MANIFEST[:-1], MANIFEST + b"\0"]), st.binary(max_size=64)
        ),
        "codecs": st.lists(st.one_of(st.sampled_from(ALL_CODEC_IDS), ENUMS), max_size=8),
        "advertise_address": TEXT,
    }
    # one field off (each check of admit() in turn), or any subset of them
    one_field = st.sampled_from(sorted(fields)).flatmap(lambda k: fields[k].map(lambda v: {k: v}))
    overrides = st.one_of(one_field, st.fixed_dictionaries({}, optional=fields))
    bodies = st.one_of(overrides.map(lambda o: hello_request(**o).SerializeToString()), RAW_BODY)

    @settings(FUZZ, max_examples=QUOTA["handshake"])
    @seed(zlib.crc32(b"handshake"))
    @example(body=GARBAGE, auth=(GOOD_AUTH,))
    @given(body=bodies, auth=AUTH)
    def run(body: bytes, auth: tuple[str, ...]) -> None:
        EXAMPLES["handshake"] += 1
        before = cluster.state()
        code, details, reply = cluster.unary("Handshake", body, auth)
        after = cluster.state()
        status = refusal("Handshake", code, details)
        request = try_parse(pb.HandshakeRequest, body)
        if status != Status.BAD_TOKEN:
            assert authorized(auth) is not False, details
            want = Status.BAD_FRAME if request is None else expected_hello(request)
            assert (status or Status.OK) == want, details
        else:
            assert authorized(auth) is not True, details
        common_invariants(cluster, before, after, rejected=0)
        if status is not None:
            same_admissions(before, after)
            return
        assert request is not None
        answer = pb.HandshakeResponse.FromString(reply)
        assert (answer.status, answer.node_id, answer.protocol_version, bytes(answer.manifest_hash)) == (
            pb.STATUS_OK,
            "p1",
            PROTOCOL_VERSION,
            MANIFEST,
        )
        assert list(answer.codecs) == ALL_CODEC_IDS
        # the caller (p0 or p1) is admitted with what it said; nobody else's admission changed
        assert after.admitted.keys() == before.admitted.keys() | {request.node_id}
        assert after.admitted[request.node_id].codecs == tuple(request.codecs)
        assert all(after.admitted[k] is before.admitted[k] for k in before.admitted if k != request.node_id)

    run()
    cluster.finish()


def test_fuzz_probe(cluster: Cluster) -> None:
    """Probes of any size (bursts to 8 MiB, replies to 2^32 - 1), or any bytes: an echo or OVERSIZE."""
    probes = st.builds(
        lambda nonce, size, fill, reply, sender: pb.ProbeRequest(
            nonce=nonce, burst=bytes([fill]) * size, reply_bytes=reply, sender=sender
        ).SerializeToString(),
        nonce=uint(64),
        size=st.one_of(
            st.integers(0, 4096),
            st.sampled_from([MAX_PROBE_BYTES - 1, MAX_PROBE_BYTES, MAX_PROBE_BYTES + 1, 8 << 20]),
            st.integers(0, 8 << 20),
        ),
        fill=st.integers(0, 255),
        reply=st.one_of(
            st.integers(0, 4096),
            st.sampled_from([MAX_PROBE_BYTES, MAX_PROBE_BYTES + 1, 2**32 - 1]),
            st.integers(0, 2**32 - 1),
        ),
        sender=SENDERS,
    )

    @settings(FUZZ, max_examples=QUOTA["probe"])
    @seed(zlib.crc32(b"probe"))
    @example(body=GARBAGE, auth=(GOOD_AUTH,))
    @given(body=st.one_of(probes, RAW_BODY), auth=AUTH)
    def run(body: bytes, auth: tuple[str, ...]) -> None:
        EXAMPLES["probe"] += 1
        before = cluster.state()
        code, details, reply = cluster.unary("Probe", body, auth)
        after = cluster.state()
        status = refusal("Probe", code, details)
        request = try_parse(pb.ProbeRequest, body)
        counted = 0
        if status == Status.BAD_TOKEN:
            assert authorized(auth) is not True, details
        else:
            assert authorized(auth) is not False, details
            if request is None:
                want = Status.BAD_FRAME
            elif max(len(request.burst), request.reply_bytes) > MAX_PROBE_BYTES:
                want = Status.OVERSIZE
            else:
                want = Status.OK
            assert (status or Status.OK) == want, details
        if status is None:
            assert request is not None
            answer = pb.ProbeResponse.FromString(reply)
            assert (answer.nonce, answer.received_bytes) == (request.nonce, len(request.burst))
            assert answer.burst == bytes(request.reply_bytes)
            counted = len(request.burst) if request.sender == "p0" else 0
        # only an accepted probe from a linked node counts as received bytes on that link
        assert after.p0_link_received == before.p0_link_received + counted
        common_invariants(cluster, before, after, rejected=0)
        same_admissions(before, after)

    run()
    cluster.finish()


def test_fuzz_status(cluster: Cluster) -> None:
    """Status with any body and token: p1's status, BAD_FRAME for undecodable bytes, or BAD_TOKEN."""

    @settings(FUZZ, max_examples=QUOTA["status"])
    @seed(zlib.crc32(b"status"))
    @example(body=GARBAGE, auth=(GOOD_AUTH,))
    @given(body=st.one_of(st.just(b""), RAW_BODY), auth=AUTH)
    def run(body: bytes, auth: tuple[str, ...]) -> None:
        EXAMPLES["status"] += 1
        before = cluster.state()
        code, details, reply = cluster.unary("Status", body, auth)
        after = cluster.state()
        status = refusal("Status", code, details)
        if status == Status.BAD_TOKEN:
            assert authorized(auth) is not True, details
        else:
            assert authorized(auth) is not False, details
            want = Status.OK if try_parse(pb.StatusRequest, body) is not None else Status.BAD_FRAME
            assert (status or Status.OK) == want, details
        if status is None:
            answer = pb.StatusResponse.FromString(reply)
            assert (answer.node_id, tuple(answer.ring)) == ("p1", RING)
            assert (answer.rounds_completed, answer.frames_rejected) == (
                before.rounds_completed,
                before.frames_rejected,
            )
        common_invariants(cluster, before, after, rejected=0)
        same_admissions(before, after)

    run()
    cluster.finish()


def test_fuzz_push_random_frames(cluster: Cluster) -> None:
    """Streams of 1-4 DataFrames, each the valid frame with any number of fields set to arbitrary values."""

    @settings(FUZZ, max_examples=QUOTA["push_frames"])
    @seed(zlib.crc32(b"push_frames"))
    @given(specs=stream_of(RANDOM_FRAME), auth=AUTH)
    def run(specs: list[dict[str, Any]], auth: tuple[str, ...]) -> None:
        EXAMPLES["push_frames"] += 1
        victim = cluster.ensure_victim("fp32")
        before = cluster.state()
        messages = [random_frame(victim, spec, before).SerializeToString() for spec in specs]
        check_push(cluster, messages, auth, before)

    run()
    cluster.finish()


def test_fuzz_push_raw(cluster: Cluster) -> None:
    """Push streams of raw bytes: random, protobuf-like, or the valid frame with bytes flipped, cut or added."""

    @settings(FUZZ, max_examples=QUOTA["push_raw"])
    @seed(zlib.crc32(b"push_raw"))
    @given(raw=stream_of(RAW_MESSAGE), auth=AUTH)
    def run(raw: list[tuple[Any, ...]], auth: tuple[str, ...]) -> None:
        EXAMPLES["push_raw"] += 1
        victim = cluster.ensure_victim("fp32")
        before = cluster.state()
        messages = []
        for m in raw:
            if m[0] == "bytes":
                messages.append(m[1])
            elif m[0] == "valid":
                messages.append(valid_frame(victim, m[1], m[2]).SerializeToString())
            else:
                messages.append(apply_edits(valid_frame(victim, m[1], m[2]).SerializeToString(), m[3]))
        check_push(cluster, messages, auth, before)

    run()
    cluster.finish()


@pytest.mark.parametrize("codec", MUTATED_CODECS)
def test_fuzz_push_mutated_valid_frames(cluster: Cluster, codec: str) -> None:
    """Valid frames of the open round with at most one field changed, 1-4 per stream, plain or zstd."""
    name = f"push_mutated[{codec}]"
    # p1 admits the attacker as p1 too: frames from "p1" then reach the round, which expects "p0"
    cluster.stub.Handshake(hello_request(node_id="p1"), metadata=GOOD_MD, timeout=CALL_TIMEOUT)

    @settings(FUZZ, max_examples=QUOTA[name])
    @seed(zlib.crc32(name.encode()))  # one inner function for every codec: give each its own examples
    # the deepest refusals, each at least once per codec
    @example(recipes=[FrameRecipe("rs", True, ("payload", ("bomb",)), True)], auth=(GOOD_AUTH,))
    @example(recipes=[FrameRecipe("rs", False, ("payload", ("f32", HUGE_AT, FLT_MAX)), True)], auth=(GOOD_AUTH,))
    @example(recipes=[FrameRecipe("ag", True, ("payload", ("f32", 0, math.nan)), True)], auth=(GOOD_AUTH,))
    @example(recipes=[FrameRecipe("rs", False, ("sender", "p1"), True)], auth=(GOOD_AUTH,))
    @example(recipes=[FrameRecipe("rs", False, None, True), FrameRecipe("ag", True, None, True)], auth=(GOOD_AUTH,))
    @given(recipes=stream_of(RECIPE), auth=AUTH)
    def run(recipes: list[FrameRecipe], auth: tuple[str, ...]) -> None:
        EXAMPLES[name] += 1
        victim = cluster.ensure_victim(codec)
        before = cluster.state()
        messages = [mutated(victim, r, before).SerializeToString() for r in recipes]
        check_push(cluster, messages, auth, before)

    run()
    cluster.finish()


def test_fuzz_unknown_method(cluster: Cluster) -> None:
    """Calls to methods the peer does not have: UNIMPLEMENTED, but only for a caller with the token."""
    names = st.one_of(
        st.sampled_from(["push", "PUSH", "Steal", "Push2", "", "Status/x"]),
        st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E, exclude_characters="/?#"), max_size=20),
    )
    services = st.sampled_from(["dreamp2p.v1.Peer", "dreamp2p.v1.peer", "dreamp2p.v2.Peer", "grpc.health.v1.Health"])

    @settings(FUZZ, max_examples=QUOTA["unknown_method"])
    @seed(zlib.crc32(b"unknown_method"))
    @example(service="dreamp2p.v1.Peer", name="Steal", body=b"", auth=(GOOD_AUTH,))  # UNIMPLEMENTED
    @example(service="dreamp2p.v1.Peer", name="Steal", body=b"", auth=())  # UNAUTHENTICATED BAD_TOKEN
    @given(service=services, name=names, body=RAW_BODY, auth=AUTH)
    def run(service: str, name: str, body: bytes, auth: tuple[str, ...]) -> None:
        EXAMPLES["unknown_method"] += 1
        path = f"/{service}/{name}"
        if service == "dreamp2p.v1.Peer" and name in ALLOWED:  # the four real methods
            return
        before = cluster.state()
        code, details, _ = cluster.unary_path(path, body, auth)
        after = cluster.state()
        if code == grpc.StatusCode.UNAUTHENTICATED:
            assert authorized(auth) is not True, details
            assert details.startswith(f"{Status.BAD_TOKEN.name}: "), details
        else:
            assert authorized(auth) is not False, (code, details)
            assert code == grpc.StatusCode.UNIMPLEMENTED, (path, code, details)
        common_invariants(cluster, before, after, rejected=0)
        same_admissions(before, after)

    run()
    cluster.finish()


def test_fuzz_suite_ran_enough_examples() -> None:
    """The fuzz tests above (when all ran in this session) executed at least 2,000 examples."""
    if set(EXAMPLES) != set(QUOTA):
        pytest.skip("counts only when every fuzz test of this module ran")
    assert sum(EXAMPLES.values()) >= MIN_EXAMPLES, dict(EXAMPLES)
    for name, quota in QUOTA.items():
        assert EXAMPLES[name] >= quota, (name, EXAMPLES[name], quota)
