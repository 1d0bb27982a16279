"""No cheap denial of service by a token holder (#14 deliver 5).

A hostile client holding the cluster token (plain stubs from the proto, no handshake) floods one node of a
training ring with held calls: silent Push streams and Push calls that claim a member's id, plus forged
"round failed" votes in a member's name. The members keep training: their calls have reserved slots
(`transport.callcap`), one connection and the shared pool are capped, a silent stream from a connection
that never handshook is closed after `first_frame_timeout_s`, and frames and votes count only from a
connection that handshook under the id they claim. Around it, the same rules one at a time on a lone
peer, and the checks a frame that would wait for its round passes first (`collective.framecheck`).
All on 127.0.0.1; time limits here are hang guards, never asserted bounds.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Sequence
from typing import Any

import grpc
import pytest
import torch
from conftest import poll_until, ring_configs, running_ring
from grpc import aio

from dreamp2p import PROTOCOL_VERSION
from dreamp2p.collective.ring import checksum
from dreamp2p.compression import codec_names, get_codec
from dreamp2p.config import PeerConfig, PeerInfo, TransportConfig
from dreamp2p.peer import Peer
from dreamp2p.peer.rounds import MAX_PENDING_ROUNDS_PER_SENDER
from dreamp2p.transport.serde import PUSH_METHOD
from dreamp2p.v1 import peer_pb2 as pb
from dreamp2p.v1 import peer_pb2_grpc as pb_grpc

TOKEN = "dos-token"
CLUSTER = "dos-test"
MD = (("authorization", f"Bearer {TOKEN}"),)
CALL_TIMEOUT = 20.0  # hang guard of every raw call
# heartbeats tolerate a loaded loop (three peers and the flood share one process): a member is never
# declared dead here for slowness, so a failed round can only come from the attack
TRANSPORT = TransportConfig(
    probe_interval_s=3600.0,
    round_timeout_s=60.0,
    rpc_deadline_s=20.0,
    connect_timeout_s=20.0,
    heartbeat_s=1.0,
    heartbeat_misses=30,
    dead_after_s=120.0,
    max_calls=64,
    max_calls_per_connection=16,
    first_frame_timeout_s=1.0,
)
GROUP = 5
FP32 = get_codec("fp32").wire_id


def hello(node_id: str) -> pb.HandshakeRequest:
    fields: dict[str, Any] = {
        "cluster_id": CLUSTER,
        "protocol_version": PROTOCOL_VERSION,
        "node_id": node_id,
        "manifest_hash": b"",
        "codecs": [get_codec(name).wire_id for name in codec_names()],
        "advertise_address": "127.0.0.1:1",
    }
    return pb.HandshakeRequest(**fields)


def data_frame(sender: str, group: int, **fields: Any) -> pb.DataFrame:
    """A well-formed reduce-scatter frame (checksum right) of round 1 of ``group``, ``fields`` overriding."""
    payload = fields.pop("payload", bytes(256))
    base: dict[str, Any] = {
        "round_id": 1,
        "group_id": group,
        "phase": pb.PHASE_REDUCE_SCATTER,
        "chunk_offset": 0,
        "chunk_length": len(payload) // 4,
        "codec": FP32,
        "dtype": pb.DTYPE_FP32,
        "element_count": len(payload) // 2,
        "payload": payload,
        "checksum": checksum(payload),
        "sender": sender,
    }
    base.update(fields)
    return pb.DataFrame(**base)


def channel(address: str) -> aio.Channel:
    """A channel of its own connection (no subchannel shared with another channel to the same address)."""
    return aio.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)])


def push(ch: aio.Channel, frames: Sequence[pb.DataFrame], hold: asyncio.Event | None = None) -> Any:
    """A Push of ``frames`` that then keeps its stream open until ``hold`` is set (None: closes it at once)."""

    async def body() -> AsyncIterator[bytes]:
        for f in frames:
            yield f.SerializeToString()
        if hold is not None:
            await hold.wait()

    call = ch.stream_unary(PUSH_METHOD, response_deserializer=pb.PushAck.FromString)
    return call(body(), metadata=MD, timeout=CALL_TIMEOUT)


def vote(ch: aio.Channel, sender: str, round_id: int, commit: bool = False) -> Any:
    request = pb.VoteRequest(sender=sender, group_id=GROUP, round_id=round_id, view_id=0, commit=commit)
    return pb_grpc.PeerStub(ch).Vote(request, metadata=MD, timeout=CALL_TIMEOUT)


def outcome(err: aio.AioRpcError) -> str:
    """A refusal as ``CODE STATUS what``: the gRPC code, the application status and the knob that refused
    (``claim`` for a frame or vote claiming an id its connection did not handshake as)."""
    details = err.details() or ""
    knob = re.search(r"\(transport\.(\w+)\)", details)
    status = details.split(":", 1)[0] if ":" in details else ""
    what = knob.group(1) if knob else "claim"
    return f"{err.code().name} {status} {what}"


async def refusal(call: Awaitable[object]) -> str:
    with pytest.raises(aio.AioRpcError) as info:
        await call
    return outcome(info.value)


class Flood:
    """The hostile client: ``silent`` Push streams that send nothing and ``claiming`` Push calls that send a
    frame in p0's name and then hold, spread over ``connections`` connections; each is opened again after
    the server ends it, until `stop`. It never handshakes."""

    def __init__(self, address: str, connections: int) -> None:
        self.channels = [channel(address) for _ in range(connections)]
        self.outcomes: Counter[str] = Counter()
        self.pool_full = asyncio.Event()
        self.connection_full = asyncio.Event()
        self.silent_closed = asyncio.Event()
        self.claim_refused = asyncio.Event()
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []

    async def _slot(self, i: int, frames: Sequence[pb.DataFrame]) -> None:
        ch = self.channels[i % len(self.channels)]
        while not self._stop.is_set():
            try:
                await push(ch, frames, hold=self._stop)
                self.outcomes["ended"] += 1
            except aio.AioRpcError as err:
                what = outcome(err)
                self.outcomes[what] += 1
                if what.endswith(" max_calls"):
                    self.pool_full.set()
                if what.endswith(" max_calls_per_connection"):
                    self.connection_full.set()
                if what.endswith(" first_frame_timeout_s"):
                    self.silent_closed.set()
                if what.endswith(" claim"):
                    self.claim_refused.set()
            await asyncio.sleep(2.0)  # holding is the attack, not a flood of new calls

    async def start(self, silent: int, claiming: int) -> None:
        """Open every call: first those of one connection, until its cap refuses some, then all others.
        Silent and claiming calls interleave, so both kinds are among the first the shared pool admits (a
        claiming call opened only after the pool filled could be refused for the pool every time)."""
        forged = [data_frame("p0", 900)]
        total = silent + claiming

        def claims(i: int) -> bool:  # exactly ``claiming`` of the ``total``, evenly spread
            return (i + 1) * claiming // total > i * claiming // total

        slots = [(i, forged if claims(i) else []) for i in range(total)]
        n = len(self.channels)
        for first in (True, False):
            for i, frames in slots:
                if (i % n == 0) == first:
                    self._tasks.append(asyncio.create_task(self._slot(i, frames)))
            if first:
                await self.connection_full.wait()  # pytest's timeout is the hang guard

    async def stop(self) -> None:
        self._stop.set()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await asyncio.gather(*(ch.close(grace=None) for ch in self.channels))


async def train_round(peers: Sequence[Peer], step: int) -> None:
    """One averaging round of every member (round id ``step``): each gets the exact mean."""
    n = 4096
    tensors = [torch.full((n,), float(10 * i + step)) for i in range(len(peers))]
    await asyncio.gather(
        *(p.allreduce([t], group_id=GROUP, round_id=step) for p, t in zip(peers, tensors, strict=True))
    )
    want = sum(10 * i + step for i in range(len(peers))) / len(peers)
    for t in tensors:
        assert torch.equal(t, torch.full((n,), want))


async def forge_votes(address: str, round_id: int, count: int, batch: int) -> Counter[str]:
    """``count`` "round failed" votes in p0's name from a connection that never handshook, ``batch`` at once."""
    ch = channel(address)
    try:
        seen: Counter[str] = Counter()
        for start in range(0, count, batch):
            n = min(batch, count - start)
            for what in await asyncio.gather(*(refusal(vote(ch, "p0", round_id)) for _ in range(n))):
                seen[what] += 1
        return seen
    finally:
        await ch.close(grace=None)


FORGED_VOTE = "FAILED_PRECONDITION NEEDS_HANDSHAKE claim"


async def test_members_train_through_a_token_holders_flood() -> None:
    """400 silent streams and 300 held Push calls against p1, forged votes in p0's name: no round fails."""
    configs = ring_configs(3, token=TOKEN, cluster_id=CLUSTER, transport=TRANSPORT)
    async with running_ring(configs, grace=1.0) as peers:
        victim = peers[1]
        await train_round(peers, 1)  # the ring works before the attack
        flood = Flood(victim.address, connections=16)
        try:
            await flood.start(silent=400, claiming=300)
            # the attack in full swing: the shared pool is full, silent streams it held have been closed,
            # and a call claiming p0 has been refused for its claim
            # (no time limit of their own: the module's pytest timeout is the hang guard)
            await flood.pool_full.wait()
            await flood.silent_closed.wait()
            await flood.claim_refused.wait()
            for step in range(2, 8):
                # forged "failed" votes for the next round, before it opens: counted, they would fail it
                votes = await forge_votes(victim.address, step, 100, 16)
                assert set(votes) <= {FORGED_VOTE, "RESOURCE_EXHAUSTED OVERSIZE max_calls"}, votes
                await train_round(peers, step)
                # Status answers a stranger's connection while the pool is full (it takes no slot)
                ch = channel(victim.address)
                try:
                    status = await pb_grpc.PeerStub(ch).Status(pb.StatusRequest(), metadata=MD, timeout=CALL_TIMEOUT)
                finally:
                    await ch.close(grace=None)
                assert status.node_id == "p1" and status.rounds_failed == 0
                assert (await peers[0].link("p1").status()).rounds_completed == step
        finally:
            await flood.stop()
        seen = flood.outcomes
        # every rule held its part of the flood: the per-connection cap, the shared pool, the silent
        # streams closed after first_frame_timeout_s, and the frames claiming p0 from a stranger
        assert seen["RESOURCE_EXHAUSTED OVERSIZE max_calls_per_connection"] > 0, seen
        assert seen["RESOURCE_EXHAUSTED OVERSIZE max_calls"] > 0, seen
        assert seen["FAILED_PRECONDITION NEEDS_HANDSHAKE first_frame_timeout_s"] > 0, seen
        assert seen["FAILED_PRECONDITION NEEDS_HANDSHAKE claim"] > 0, seen
        assert set(seen) <= {
            "ended",  # a call that the stop let end on its own
            "RESOURCE_EXHAUSTED OVERSIZE max_calls_per_connection",
            "RESOURCE_EXHAUSTED OVERSIZE max_calls",
            "FAILED_PRECONDITION NEEDS_HANDSHAKE first_frame_timeout_s",
            "FAILED_PRECONDITION NEEDS_HANDSHAKE claim",
        }, seen
        # with the pool free again, 1,000 forged votes are each refused for their claim
        await wait_for_room(victim.address)
        votes = await forge_votes(victim.address, 8, 1000, 16)
        assert votes == Counter({FORGED_VOTE: 1000})
        await train_round(peers, 8)
        for p in peers:
            assert (p.rounds_completed, p.rounds_failed, p.rounds_retried) == (8, 0, 0), p.config.node_id
            assert not p.rounds.failures


async def wait_for_room(address: str) -> None:
    """Until the flood's calls have all ended on the server (one more call gets a slot); no time limit of its
    own, since how long the server takes to end them depends on the host's load (pytest's timeout guards)."""
    ch = channel(address)
    try:
        while True:  # polls the server: no event of ours would tell when its calls have ended
            if await refusal(vote(ch, "p0", 1)) == FORGED_VOTE:
                return
            await asyncio.sleep(0.1)
    finally:
        await ch.close(grace=None)


# ------------------------------------------------------------------------------ one rule at a time


@contextlib.asynccontextmanager
async def lone_peer(**transport: Any) -> AsyncIterator[Peer]:
    """A started peer p1 whose ring also lists p0 and p2 (never started)."""
    ring = tuple(PeerInfo(f"p{i}", f"127.0.0.1:{i + 1}") for i in range(3))
    fields: dict[str, Any] = {"probe_interval_s": 3600.0, "round_timeout_s": 30.0, "rpc_deadline_s": 10.0}
    fields.update(transport)
    peer = Peer(
        PeerConfig(node_id="p1", ring=ring, cluster_id=CLUSTER, token=TOKEN, transport=TransportConfig(**fields))
    )
    await peer.start()
    try:
        yield peer
    finally:
        await peer.close(grace=0.1)


async def test_votes_and_frames_count_only_from_the_connection_that_handshook() -> None:
    async with lone_peer() as peer:
        own, other = channel(peer.address), channel(peer.address)
        try:
            await pb_grpc.PeerStub(own).Handshake(hello("p0"), metadata=MD, timeout=CALL_TIMEOUT)
            with pytest.raises(aio.AioRpcError) as info:
                await vote(other, "p0", 3)
            err = info.value
            assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert re.fullmatch(
                r"NEEDS_HANDSHAKE: a vote claims node id 'p0', but connection ipv4:127\.0\.0\.1:\d+ has not "
                r"handshaken as it",
                err.details() or "",
            ), err.details()
            assert peer.failed_vote((GROUP, 3), ["p0"]) is None  # nothing was recorded
            with pytest.raises(aio.AioRpcError) as info:
                await push(other, [data_frame("p0", 7)])
            assert (info.value.details() or "").startswith("NEEDS_HANDSHAKE: a frame claims node id 'p0'")
            assert peer.rounds.snapshot().pending == 0
            # from its own connection the same vote counts
            reply = await vote(own, "p0", 3)
            assert reply.status == pb.STATUS_OK
            assert peer.failed_vote((GROUP, 3), ["p0"]) == "p0"
        finally:
            await asyncio.gather(own.close(grace=None), other.close(grace=None))


async def test_a_strangers_silent_stream_is_closed_but_a_members_may_wait() -> None:
    async with lone_peer(first_frame_timeout_s=0.5) as peer:
        member, stranger = channel(peer.address), channel(peer.address)
        hold = asyncio.Event()
        try:
            await pb_grpc.PeerStub(member).Handshake(hello("p0"), metadata=MD, timeout=CALL_TIMEOUT)
            waiting = asyncio.ensure_future(push(member, [], hold=hold))
            with pytest.raises(aio.AioRpcError) as info:
                await push(stranger, [], hold=hold)
            assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert re.fullmatch(
                r"NEEDS_HANDSHAKE: connection ipv4:127\.0\.0\.1:\d+ has not handshaken and sent no frame within "
                r"0\.5 s \(transport\.first_frame_timeout_s\)",
                info.value.details() or "",
            ), info.value.details()
            assert not waiting.done()  # a member's stream may wait for its data (its deadline is the round's)
            hold.set()
            ack = await waiting
            assert (ack.frames, ack.payload_bytes) == (0, 0)
        finally:
            hold.set()
            await asyncio.gather(member.close(grace=None), stranger.close(grace=None))


async def test_calls_per_connection_are_capped_and_status_still_answers() -> None:
    async with lone_peer(max_calls_per_connection=4) as peer:
        ch = channel(peer.address)
        hold = asyncio.Event()
        try:
            await pb_grpc.PeerStub(ch).Handshake(hello("p0"), metadata=MD, timeout=CALL_TIMEOUT)
            held = [asyncio.ensure_future(push(ch, [data_frame("p0", 100 + i)], hold=hold)) for i in range(4)]
            await poll_until(lambda: peer.rounds.snapshot().frames_waiting == 4)
            assert await refusal(push(ch, [data_frame("p0", 104)])) == (
                "RESOURCE_EXHAUSTED OVERSIZE max_calls_per_connection"
            )
            status = await pb_grpc.PeerStub(ch).Status(pb.StatusRequest(), metadata=MD, timeout=CALL_TIMEOUT)
            assert status.node_id == "p1"
            # another connection of the same member is not held back by this one's cap
            other = channel(peer.address)
            try:
                await pb_grpc.PeerStub(other).Handshake(hello("p0"), metadata=MD, timeout=CALL_TIMEOUT)
            finally:
                await other.close(grace=None)
            hold.set()
            for call in held:
                call.cancel()
            await asyncio.gather(*held, return_exceptions=True)
        finally:
            hold.set()
            await ch.close(grace=None)


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({"chunk_length": 1 << 40, "element_count": 1 << 41}, "INVALID_ARGUMENT BAD_FRAME element_count"),
        ({"chunk_offset": (1 << 64) - 8}, "INVALID_ARGUMENT BAD_FRAME chunk ["),
        ({"zstd": True, "raw_length": 1 << 40, "payload": bytes(64)}, "INVALID_ARGUMENT BAD_FRAME raw_length"),
        ({"checksum": 12345}, "DATA_LOSS CHECKSUM_MISMATCH payload checksum"),
        ({"ring_step": 2}, "INVALID_ARGUMENT BAD_FRAME ring_step 2 out of range for a ring of 3"),
        ({"codec": 250}, "INVALID_ARGUMENT UNKNOWN_CODEC unknown codec id 250"),
    ],
    ids=["absurd-length", "offset-near-2^64", "zstd-raw-2^40", "checksum", "ring-step", "codec"],
)
async def test_a_frame_that_would_wait_is_checked_first(fields: dict[str, Any], expected: str) -> None:
    async with lone_peer() as peer:
        ch = channel(peer.address)
        try:
            await pb_grpc.PeerStub(ch).Handshake(hello("p0"), metadata=MD, timeout=CALL_TIMEOUT)
            with pytest.raises(aio.AioRpcError) as info:
                await push(ch, [data_frame("p0", 300, **fields)])
            err = info.value
            code, (status, detail) = err.code().name, (err.details() or "").split(": ", 1)
            assert f"{code} {status} {detail}".startswith(expected), err.details()
            assert peer.rounds.snapshot().pending == 0  # refused at once, nothing held
            assert peer.frames_rejected == 1
        finally:
            await ch.close(grace=None)


async def test_rounds_one_sender_waits_for_are_capped() -> None:
    cap = MAX_PENDING_ROUNDS_PER_SENDER
    async with lone_peer(max_calls_per_connection=cap + 8, max_calls_per_member=cap + 8) as peer:
        p0, p2 = channel(peer.address), channel(peer.address)
        hold = asyncio.Event()
        held: list[asyncio.Future[Any]] = []
        try:
            await pb_grpc.PeerStub(p0).Handshake(hello("p0"), metadata=MD, timeout=CALL_TIMEOUT)
            await pb_grpc.PeerStub(p2).Handshake(hello("p2"), metadata=MD, timeout=CALL_TIMEOUT)
            held += [asyncio.ensure_future(push(p0, [data_frame("p0", 100 + i)], hold=hold)) for i in range(cap)]
            await poll_until(lambda: peer.rounds.snapshot().frames_waiting == cap)
            with pytest.raises(aio.AioRpcError) as info:
                await push(p0, [data_frame("p0", 100 + cap)])
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert info.value.details() == (
                f"OVERSIZE: sender 'p0' already has frames waiting for {cap} rounds that have not opened here"
            )
            # a frame of p0 for a round it already waits for, and p2's frames, may still wait
            held.append(asyncio.ensure_future(push(p0, [data_frame("p0", 100, chunk_offset=64)], hold=hold)))
            held.append(asyncio.ensure_future(push(p2, [data_frame("p2", 100 + cap)], hold=hold)))
            await poll_until(lambda: peer.rounds.snapshot().frames_waiting == cap + 2)
        finally:
            hold.set()
            for call in held:
                call.cancel()
            await asyncio.gather(*held, return_exceptions=True)
            await asyncio.gather(p0.close(grace=None), p2.close(grace=None))
