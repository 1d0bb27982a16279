"""Limits on what callers may hold together: buffered bytes per sender, streams per connection, rounds waited for.

One frame or call at a time is test_bad_input.py's; here many calls at once (or one after another) try
to pin memory or server slots, and the peer's limits hold: a per-sender budget of frame bytes waiting
for their round (other senders keep theirs), a cap on concurrent streams per connection, and a bound on
rounds that frames wait for, which timed-out waits give back. The budget and its sizing are also checked
in process. Everything else runs a real gRPC server (:class:`~dreamp2p.peer.Peer`) on 127.0.0.1 and
floods it with raw gRPC clients. The call slots a token holder may take (per connection, per member, in
the shared pool) and a flood against a training ring are test_dos.py's.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Awaitable

import grpc
import pytest
from conftest import poll_until
from grpc import aio
from rawpeer import CALL_TIMEOUT, GOOD_MD, hello_request, push, refused, running_peer, waiting_frame

import dreamp2p.peer.rounds as rounds_module
from dreamp2p.config import PeerConfig, TransportConfig
from dreamp2p.errors import PeerError, Status
from dreamp2p.messages import Frame
from dreamp2p.peer import Peer
from dreamp2p.transport.budget import SenderBudget
from dreamp2p.v1 import peer_pb2_grpc as pb_grpc


class InFlight:
    """Wraps a peer's accept_frame to count the frames being handled at once (now and at most)."""

    def __init__(self, peer: Peer) -> None:
        self.now = 0
        self.peak = 0
        self.calls = 0
        inner = peer.accept_frame

        async def counting(frame: Frame) -> None:
            self.calls += 1
            self.now += 1
            self.peak = max(self.peak, self.now)
            try:
                await inner(frame)
            finally:
                self.now -= 1

        peer.accept_frame = counting  # type: ignore[method-assign]

    async def reach(self, n: int) -> None:
        """Until ``n`` frames are in flight (no time limit of its own: see `poll_until`)."""
        await poll_until(lambda: self.now >= n)


# ----------------------------------------------------------------------------------------- limits


def test_sender_budget_accounts_per_sender() -> None:
    budget = SenderBudget(1000)
    budget.reserve("p0", 600)
    budget.reserve("p0", 400)  # exactly at the limit is allowed
    with pytest.raises(PeerError) as info:
        budget.reserve("p0", 1)
    assert info.value.status == Status.OVERSIZE
    assert info.value.detail == (
        "sender 'p0' already has 1000 bytes of frames waiting here; 1 more would exceed the per-peer limit of "
        "1000 bytes (transport.max_buffered_bytes_per_peer)"
    )
    assert budget.held("p0") == 1000  # the refused reservation counted nothing
    budget.reserve("p2", 1000)  # another sender has its own budget
    budget.release("p0", 600)
    budget.reserve("p0", 600)
    budget.release("p0", 1000)
    budget.release("p2", 1000)
    assert budget.held("p0") == budget.held("p2") == 0 and budget.held_by_sender() == {}
    with pytest.raises(ValueError, match="more than it holds"):
        budget.release("p0", 1)


async def test_sender_budget_holding_releases_on_any_exit() -> None:
    budget = SenderBudget(100)

    async def hold(event: asyncio.Event) -> None:
        with budget.holding("p0", 60):
            await event.wait()

    task = asyncio.create_task(hold(asyncio.Event()))
    await asyncio.sleep(0)
    assert budget.held("p0") == 60
    with pytest.raises(PeerError), budget.holding("p0", 41):
        pass
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert budget.held("p0") == 0
    with pytest.raises(RuntimeError), budget.holding("p0", 100):
        raise RuntimeError("handler failed")
    assert budget.held("p0") == 0


def test_budget_sizing_and_config_limits() -> None:
    cfg = PeerConfig(node_id="a", transport=TransportConfig(max_buffered_bytes_per_peer=100 << 20))

    class WithConfig:
        config = cfg

    assert SenderBudget.for_backend(WithConfig()).limit_bytes == 100 << 20
    assert SenderBudget.for_backend(object()).limit_bytes == TransportConfig().max_buffered_bytes_per_peer == 256 << 20
    assert TransportConfig().max_concurrent_streams == 64
    with pytest.raises(ValueError, match=r"max_buffered_bytes_per_peer \(67108864\) must be larger than"):
        TransportConfig(max_buffered_bytes_per_peer=64 << 20)
    with pytest.raises(ValueError, match=re.escape("transport.max_buffered_bytes_per_peer must be > 0")):
        TransportConfig(max_buffered_bytes_per_peer=0)
    with pytest.raises(ValueError, match=re.escape("transport.max_concurrent_streams must be > 0")):
        PeerConfig.from_dict({"node_id": "a", "transport": {"max_concurrent_streams": 0}})


async def _outcome(call: Awaitable[object]) -> str:
    """How a Push ended on the client: "ran" (it ran here and timed out waiting for its round), "refused" (the
    stream cap refused it), or "lost" (the client's gRPC core failed a pending write after the server had
    ended the call, and reports INTERNAL instead of the server's status: seen once under a loaded CI run)."""
    with pytest.raises(aio.AioRpcError) as info:
        await call
    code, details = info.value.code(), info.value.details() or ""
    if code == grpc.StatusCode.UNAVAILABLE and "RST_STREAM" in details:
        return "refused"
    if code == grpc.StatusCode.INTERNAL and "execute_batch" in (info.value.debug_error_string() or ""):
        return "lost"
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED, f"{code} {details!r}"
    assert details.startswith("TIMEOUT: "), details
    return "ran"


async def test_concurrent_streams_per_connection_are_capped() -> None:
    """max_concurrent_streams = 2: of six Push streams on one connection the server runs two at a time."""
    transport = TransportConfig(
        max_concurrent_streams=2, probe_interval_s=3600.0, round_timeout_s=0.6, rpc_deadline_s=5.0
    )
    async with running_peer(transport=transport) as peer:
        inflight = InFlight(peer)
        channel = aio.insecure_channel(peer.address)
        stub = pb_grpc.PeerStub(channel)
        try:
            await stub.Handshake(
                hello_request(node_id="p0"), metadata=GOOD_MD, timeout=CALL_TIMEOUT
            )  # connection up, settings known
            calls = [push(stub, waiting_frame("p0", 100 + i)) for i in range(6)]
            outcomes = asyncio.gather(*(_outcome(c) for c in calls))
            await inflight.reach(2)
            await asyncio.sleep(0.3)
            assert inflight.now == 2  # the others wait in the client for a free stream
            ends = await outcomes  # each that ran waited its round_timeout_s
            ran, lost = ends.count("ran"), ends.count("lost")
            # a stream the client opened before it learnt the limit is refused by HTTP/2 (REFUSED_STREAM)
            # instead of queued; either way no more than two ever ran at once (the server's own count)
            assert ran <= inflight.calls <= ran + lost and inflight.calls >= 2, (ends, inflight.calls)
            assert inflight.peak == 2
        finally:
            await channel.close(grace=None)


async def test_buffered_bytes_per_sender_are_capped() -> None:
    """Frames waiting for rounds that never open: p0 is refused past its limit while p2 is still accepted."""
    limit = 256 << 10
    transport = TransportConfig(
        max_message_bytes=128 << 10,
        chunk_min_bytes=64 << 10,
        chunk_max_bytes=64 << 10,
        max_buffered_bytes_per_peer=limit,
        probe_interval_s=3600.0,
        round_timeout_s=1.5,
        rpc_deadline_s=5.0,
    )
    size = 60_000  # four fit in 256 KiB (240000 bytes), a fifth does not
    async with running_peer(transport=transport) as peer:
        inflight = InFlight(peer)
        channel = aio.insecure_channel(peer.address)
        stub = pb_grpc.PeerStub(channel)

        async def timed_out(call: Awaitable[object]) -> aio.AioRpcError:
            return await refused(call, grpc.StatusCode.DEADLINE_EXCEEDED, "TIMEOUT: ")

        try:
            for node in ("p0", "p2"):
                await stub.Handshake(hello_request(node_id=node), metadata=GOOD_MD, timeout=CALL_TIMEOUT)
            waiting = asyncio.gather(*(timed_out(push(stub, waiting_frame("p0", 100 + i, size))) for i in range(4)))
            await inflight.reach(4)

            await refused(
                push(stub, waiting_frame("p0", 104, size)),
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                "OVERSIZE: ",
                f"sender 'p0' already has 240000 bytes of frames waiting here; {size} more would exceed "
                f"the per-peer limit of {limit} bytes (transport.max_buffered_bytes_per_peer)",
            )
            assert inflight.now == 4  # the refusal came before the backend

            other = asyncio.create_task(timed_out(push(stub, waiting_frame("p2", 105, size))))
            await inflight.reach(5)  # p2 has a budget of its own
            assert not other.done()

            await waiting
            await other
            assert inflight.now == 0
            # once its frames stopped waiting, p0 may buffer again
            again = asyncio.gather(*(timed_out(push(stub, waiting_frame("p0", 110 + i, size))) for i in range(4)))
            await inflight.reach(4)
            await again
        finally:
            await channel.close(grace=None)


async def test_timed_out_waits_do_not_exhaust_pending_rounds(monkeypatch: pytest.MonkeyPatch) -> None:
    """Frames for rounds that never open time out; afterwards nothing is pending, so a new one may wait."""
    monkeypatch.setattr(rounds_module, "MAX_PENDING_ROUNDS", 2)  # the real 256 behaves the same, slower
    transport = TransportConfig(probe_interval_s=3600.0, round_timeout_s=0.3, rpc_deadline_s=5.0)
    async with running_peer(transport=transport) as peer:
        channel = aio.insecure_channel(peer.address)
        stub = pb_grpc.PeerStub(channel)
        try:
            await stub.Handshake(hello_request(node_id="p0"), metadata=GOOD_MD, timeout=CALL_TIMEOUT)
            timed_out = grpc.StatusCode.DEADLINE_EXCEEDED
            await asyncio.gather(
                *(refused(push(stub, waiting_frame("p0", g)), timed_out, Status.TIMEOUT) for g in (100, 101))
            )
            await refused(push(stub, waiting_frame("p0", 102)), timed_out, Status.TIMEOUT)
        finally:
            await channel.close(grace=None)
