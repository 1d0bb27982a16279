"""Client side of one link: channels to a neighbour, chunk streams with backpressure, probes, stats.

A :class:`Link` owns ``streams_per_link`` channels (separate TCP connections) to one peer, and handshakes
on each of them (the server counts frames and votes only from a connection that handshook under the id
they claim, see `transport.callcap`). An
:class:`OutboundStream` spreads a round's frames over them from one queue, paced by the optional
token bucket (WAN emulation) and metered for goodput. Every call has a deadline.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
from grpc import aio

from dreamp2p.config import PeerInfo, TLSConfig, TransportConfig
from dreamp2p.errors import PeerError, Status
from dreamp2p.messages import Frame, Hello, PeerStatus, RoundEvidence
from dreamp2p.statemeta import StateManifest, StateRange
from dreamp2p.transport import serde
from dreamp2p.transport.auth import token_metadata
from dreamp2p.transport.limiter import TokenBucket
from dreamp2p.transport.linkstats import BusyMeter, LinkEstimator
from dreamp2p.transport.options import channel_credentials, channel_options
from dreamp2p.v1 import peer_pb2 as pb
from dreamp2p.v1 import peer_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

_nonces = itertools.count(1)
# How often one round may be resent to a successor that restarted under it.
MAX_REPLAYS = 3
# Transport-level outcomes of a successor process that went away; replaying to a live peer that kept
# its round state fails on its duplicate checks instead, so a wrong guess costs one refused replay.
_PEER_GONE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL, grpc.StatusCode.CANCELLED})


def rpc_error(exc: grpc.RpcError) -> PeerError:
    """Turn a failed call into a PeerError carrying the remote application status when there is one."""
    code = exc.code() if isinstance(exc, aio.AioRpcError) else grpc.StatusCode.UNKNOWN
    details = exc.details() if isinstance(exc, aio.AioRpcError) else str(exc)
    status = serde.status_from_details(details)
    if status == Status.UNSPECIFIED and code == grpc.StatusCode.DEADLINE_EXCEEDED:
        status = Status.TIMEOUT
    return PeerError(status, f"{code.name}: {details}", grpc_code=code.name)


def open_channel(address: str, cfg: TransportConfig, tls: TLSConfig | None) -> aio.Channel:
    if tls is not None:
        return aio.secure_channel(address, channel_credentials(tls), options=channel_options(cfg, tls))
    return aio.insecure_channel(address, options=channel_options(cfg, tls))


class Link:
    """Everything this peer knows and holds about its connection to one other peer."""

    def __init__(self, me: str, dest: PeerInfo, cfg: TransportConfig, tls: TLSConfig | None, token: str | None) -> None:
        self.me = me
        self.dest = dest
        self.cfg = cfg
        self._metadata = token_metadata(token)
        self._channels = [open_channel(dest.address, cfg, tls) for _ in range(cfg.streams_per_link)]
        self._stubs = [pb_grpc.PeerStub(ch) for ch in self._channels]
        # Push bypasses the generated serializer: frames are written with one payload copy (serde)
        self._push = [
            ch.stream_unary(
                serde.PUSH_METHOD,
                request_serializer=serde.frame_to_wire,
                response_deserializer=pb.PushAck.FromString,
            )
            for ch in self._channels
        ]
        self.stats = LinkEstimator()
        self.meter = BusyMeter()
        self.bucket = TokenBucket(cfg.rate_limit) if cfg.rate_limit else None
        self.delay_s = cfg.delay_s
        self.chunk_bytes = 0
        self.remote: Hello | None = None
        self.hello: Hello | None = None  # what we introduced ourselves with, to do it again after a restart

    def set_rate_limit(self, rate_Bps: float | None) -> None:
        self.bucket = TokenBucket(rate_Bps) if rate_Bps else None

    # ------------------------------------------------------------------ calls

    async def handshake(self, hello: Hello, timeout: float) -> Hello:
        """Handshake, retrying while the remote is not up yet, until ``timeout``."""
        self.hello = hello
        deadline = time.monotonic() + timeout
        delay = 0.05
        request = serde.hello_to_proto(hello)
        while True:
            left = deadline - time.monotonic()
            try:
                reply = await self._stubs[0].Handshake(
                    request,
                    timeout=max(0.1, min(self.cfg.rpc_deadline_s, left)),
                    metadata=self._metadata,
                    wait_for_ready=True,
                )
            except aio.AioRpcError as exc:
                if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED) and left > delay:
                    await asyncio.sleep(delay)
                    delay = min(1.0, delay * 2)
                    continue
                raise rpc_error(exc) from None
            self.remote = serde.hello_from_reply(reply)
            await self._introduce_rest(request, deadline)
            return self.remote

    async def _introduce_rest(self, request: pb.HandshakeRequest, deadline: float) -> None:
        """The same handshake on every other channel (each its own connection), the member being up now."""
        timeout = max(0.1, min(self.cfg.rpc_deadline_s, deadline - time.monotonic()))
        calls = [
            stub.Handshake(request, timeout=timeout, metadata=self._metadata, wait_for_ready=True)
            for stub in self._stubs[1:]
        ]
        try:
            await asyncio.gather(*calls)
        except aio.AioRpcError as exc:
            raise rpc_error(exc) from None

    async def status(self) -> PeerStatus:
        try:
            reply = await self._stubs[0].Status(
                pb.StatusRequest(), timeout=self.cfg.rpc_deadline_s, metadata=self._metadata
            )
        except aio.AioRpcError as exc:
            raise rpc_error(exc) from None
        return serde.status_from_proto(reply)

    async def vote(
        self, group_id: int, round_id: int, view_id: int, commit: bool, timeout: float, ev: RoundEvidence | None = None
    ) -> None:
        """Tell this member how our part of a round ended (all-or-none application, see Peer), with what we
        measured of our part (``ev``, for straggler detection)."""
        if self.delay_s:  # the emulated link delays the vote like any other message
            await asyncio.sleep(self.delay_s)
        deadline = time.monotonic() + timeout
        request = serde.vote_request(self.me, group_id, round_id, view_id, commit, ev)
        for again in (True, False):
            try:
                await self._stubs[0].Vote(
                    request, timeout=max(0.05, deadline - time.monotonic()), metadata=self._metadata
                )
                return
            except aio.AioRpcError as exc:
                err = rpc_error(exc)
            # our connection is new to the member (it reconnected under us): introduce it, then vote again
            if not (again and err.status == Status.NEEDS_HANDSHAKE and self.hello is not None):
                raise err
            await self.handshake(self.hello, max(0.1, deadline - time.monotonic()))

    async def heartbeat(self, timeout: float) -> float:
        """A tiny echo with a short deadline (failure detection); returns and records the RTT.

        Raises PeerError; a refused connection comes back as UNAVAILABLE right away.
        """
        t0 = time.perf_counter()
        try:
            await self._stubs[0].Probe(
                serde.probe_request(next(_nonces), b"", 0, self.me), timeout=timeout, metadata=self._metadata
            )
        except aio.AioRpcError as exc:
            raise rpc_error(exc) from None
        rtt = time.perf_counter() - t0 + 2 * self.delay_s
        self.stats.observe_rtt(rtt)
        return rtt

    async def _timed_probe(self, burst: bytes) -> float:
        """Seconds for one Probe call carrying ``burst``, as the (emulated) link would take it."""
        t0 = time.perf_counter()
        if burst and self.bucket is not None:  # the emulated link's pacing is part of what we measure
            await self.bucket.acquire(len(burst))
        try:
            await self._stubs[0].Probe(
                serde.probe_request(next(_nonces), burst, 0, self.me),
                timeout=self.cfg.rpc_deadline_s,
                metadata=self._metadata,
            )
        except aio.AioRpcError as exc:
            raise rpc_error(exc) from None
        if self.delay_s:  # the emulated link delays the echo too, once each way
            await asyncio.sleep(2 * self.delay_s)
        return time.perf_counter() - t0

    async def probe_rtt(self) -> float:
        """One tiny echo; returns and records the round-trip time."""
        rtt = await self._timed_probe(b"")
        self.stats.observe_rtt(rtt)
        return rtt

    async def probe_bandwidth(self, nbytes: int) -> float:
        """Send a burst of ``nbytes`` and time it (minus one RTT); returns and records bytes/s."""
        elapsed = await self._timed_probe(bytes(nbytes))
        rtt = self.stats.min_rtt_s if self.stats.rtt_samples else 0.0
        rate = nbytes / max(elapsed - rtt, elapsed * 0.5)
        self.stats.observe_transfer(nbytes, nbytes / rate)
        self.stats.bytes_sent += nbytes
        return rate

    def open_stream(self, nstreams: int | None = None, timeout: float | None = None) -> OutboundStream:
        n = max(1, min(nstreams or len(self._push), len(self._push)))
        return OutboundStream(
            self,
            self._push[:n],
            self._metadata,
            timeout or self.cfg.round_timeout_s,
            self.cfg.outbound_queue_bytes,
        )

    async def close(self) -> None:
        await asyncio.gather(*(ch.close(grace=None) for ch in self._channels), return_exceptions=True)

    async def state_manifest(self, timeout: float) -> StateManifest:
        """The state snapshot this peer offers; it may wait up to ``timeout`` for its trainer to publish one."""
        try:
            reply = await self._stubs[0].GetStateManifest(
                serde.state_manifest_request(self.me), timeout=max(0.05, timeout), metadata=self._metadata
            )
        except aio.AioRpcError as exc:
            raise rpc_error(exc) from None
        return serde.state_manifest_from_proto(reply)

    async def fetch_state_range(self, snapshot_id: int, tensor: str, offset: int, length: int, timeout: float) -> bytes:
        """Bytes ``[offset, offset + length)`` of one snapshot tensor; PeerError unless exactly those arrive."""
        request = serde.state_chunk_request(StateRange(self.me, snapshot_id, tensor, offset, length))
        call = self._stubs[0].FetchState(request, timeout=max(0.05, timeout), metadata=self._metadata)
        parts: list[bytes] = []
        got = 0
        try:
            async for chunk in call:
                at, data = serde.state_chunk_from_proto(chunk)
                if at != offset + got:
                    raise PeerError(Status.BAD_FRAME, f"state chunk at offset {at}, expected {offset + got}")
                if got + len(data) > length:
                    raise PeerError(Status.OVERSIZE, f"donor sent more than the {length} bytes requested")
                parts.append(data)
                got += len(data)
                self.stats.bytes_received += len(data)
        except aio.AioRpcError as exc:
            raise rpc_error(exc) from None
        finally:
            call.cancel()  # a no-op once the stream ended; stops it when we refuse what it sends
        if got != length:
            raise PeerError(Status.BAD_FRAME, f"state stream ended after {got} of {length} bytes")
        self.stats.last_activity = time.monotonic()
        return b"".join(parts)


class OutboundStream:
    """One round's frames to one peer over several Push streams sharing one queue.

    Forwarded frames (produced from received ones) are queued without waiting, so a receiving handler
    never blocks on a full queue and the ring cannot deadlock; our own frames wait for room
    (backpressure bounded by ``limit_bytes``). Forwarded frames go first: they are later in the pipeline.
    """

    def __init__(
        self,
        link: Link,
        pushes: list[aio.StreamUnaryMultiCallable],
        metadata: tuple[tuple[str, str], ...],
        timeout: float,
        limit_bytes: int,
    ) -> None:
        self._link = link
        self._fwd: collections.deque[Frame] = collections.deque()
        self._own: collections.deque[Frame] = collections.deque()
        self._queued_bytes = 0
        self._limit = limit_bytes
        self._closed = False
        self._failure: PeerError | None = None
        self._wake = asyncio.Event()
        self._space = asyncio.Event()
        self._space.set()
        self.frames_sent = 0
        self.bytes_sent = 0
        self._on_failure: list[asyncio.Future[None]] = []
        self._timed: collections.deque[tuple[float, Frame]] = collections.deque()
        self._timed_wake = asyncio.Event()
        self._timed_done = False
        self._pump = asyncio.ensure_future(self._delay_line()) if link.delay_s > 0 else None
        if self._pump is not None:
            self._pump.add_done_callback(_retrieve)
        self._pushes = pushes
        self._metadata = metadata
        self._deadline = time.monotonic() + timeout
        self._sent: list[Frame] = []  # frames handed to the current connection generation
        self._generation = 0
        self._replays = 0
        self._calls: list[aio.StreamUnaryCall] = []
        self._tasks: list[asyncio.Future[pb.PushAck | None]] = []
        self._start_calls()

    def _start_calls(self) -> None:
        gen = self._generation
        left = max(0.1, self._deadline - time.monotonic())
        # wait_for_ready: a successor that is restarting (from a checkpoint) is waited for, up to the deadline
        self._calls = [
            push(self._frames(gen), timeout=left, metadata=self._metadata, wait_for_ready=True) for push in self._pushes
        ]
        self._tasks = [asyncio.ensure_future(self._await(call, gen)) for call in self._calls]
        for task in self._tasks:
            task.add_done_callback(_retrieve)

    async def _await(self, call: aio.StreamUnaryCall, gen: int) -> pb.PushAck | None:
        try:
            return await call
        except aio.AioRpcError as exc:
            if gen != self._generation:
                return None  # superseded by a replay
            err = rpc_error(exc)
            # the successor restarted (or is restarting): introduce ourselves again and resend the round
            gone = exc.code() == grpc.StatusCode.UNAVAILABLE or err.status in (
                Status.SHUTTING_DOWN,
                Status.NEEDS_HANDSHAKE,
            )
            if gone and self._failure is None and self._replays < MAX_REPLAYS:
                await self._replay(err)
                return None
            self._fail(err)
            raise err from None
        except asyncio.CancelledError:
            task = asyncio.current_task()
            ours = self._failure is not None or gen != self._generation
            if ours and task is not None and not task.cancelling():
                return None  # we cancelled the call ourselves (abort or replay)
            raise

    async def _replay(self, err: PeerError) -> None:
        """The successor went away mid-round (a restart): resend this round's frames on new streams.

        A restarted peer opens the round afresh, so everything the old connection carried goes again,
        after a new handshake (its admissions died with it). Waits for it up to the round's deadline.
        """
        log.info("%s went away during a round (%s); replaying %d frames", self._link.dest.node_id, err, len(self._sent))
        self._generation += 1
        gen = self._generation
        hello = self._link.hello
        if hello is not None:
            try:
                await self._link.handshake(hello, max(0.1, self._deadline - time.monotonic()))
            except PeerError as exc:
                self._fail(exc)
                return
        if gen != self._generation or self._failure is not None:
            return
        self._replays += 1
        for frame in reversed(self._sent):
            self._fwd.appendleft(frame)
            self._queued_bytes += len(frame.payload)
        self._sent = []
        for call in self._calls:
            call.cancel()
        self._start_calls()
        self._wake.set()

    def _fail(self, err: PeerError) -> None:
        if self._failure is None:
            self._failure = err
            for fut in self._on_failure:
                if not fut.done():
                    fut.set_exception(err)
        self._wake.set()
        self._space.set()

    def calls_done(self) -> bool:
        """Whether every gRPC call of the current connection generation has ended (so its HTTP/2 stream is free)."""
        return all(call.done() for call in self._calls)

    def failed(self) -> asyncio.Future[None]:
        """A future that raises as soon as any of this stream's calls fails."""
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if self._failure is not None:
            fut.set_exception(self._failure)
        else:
            self._on_failure.append(fut)
        return fut

    def forward(self, frame: Frame) -> None:
        self._fwd.append(frame)
        self._queued_bytes += len(frame.payload)
        self._wake.set()

    async def put(self, frame: Frame) -> None:
        while self._queued_bytes >= self._limit and self._failure is None and not self._closed:
            self._space.clear()
            await self._space.wait()
        if self._failure is not None:
            raise self._failure
        self._own.append(frame)
        self._queued_bytes += len(frame.payload)
        self._wake.set()

    async def _next(self) -> Frame | None:
        while True:
            if self._failure is not None:
                return None
            if self._fwd:
                return self._fwd.popleft()
            if self._own:
                return self._own.popleft()
            if self._closed:
                return None
            self._wake.clear()
            await self._wake.wait()

    async def _paced(self) -> Frame | None:
        """Next frame, paced by the emulated link rate (token bucket), or None when done."""
        frame = await self._next()
        if frame is None:
            self._wake.set()  # the other generators may be waiting for a frame that will not come
            return None
        n = len(frame.payload)
        self._queued_bytes -= n
        if self._queued_bytes < self._limit:
            self._space.set()
        if self._link.bucket is not None:
            await self._link.bucket.acquire(n)
        return frame

    async def _delay_line(self) -> None:
        """Emulated one-way delay: frames leave ``delay_s`` after the rate limiter released them.

        A separate pump keeps pacing while earlier frames are still in the delay line, so the delay
        adds latency without cutting throughput, as on a real long link.
        """
        try:
            while (frame := await self._paced()) is not None:
                self._timed.append((time.monotonic() + self._link.delay_s, frame))
                stats = self._link.stats
                stats.delay_line_peak = max(stats.delay_line_peak, len(self._timed))
                self._timed_wake.set()
        finally:
            self._timed_done = True
            self._timed_wake.set()

    async def _next_due(self) -> Frame | None:
        while not self._timed:
            if self._timed_done or self._failure is not None:
                return None
            self._timed_wake.clear()
            await self._timed_wake.wait()
        due, frame = self._timed.popleft()
        await asyncio.sleep(max(0.0, due - time.monotonic()))
        return frame

    async def _frames(self, gen: int) -> AsyncIterator[Frame]:
        link = self._link
        while gen == self._generation:
            frame = await (self._next_due() if self._pump is not None else self._paced())
            if frame is None:
                return
            if gen != self._generation:  # a replay started while we waited: the new streams send it
                self._fwd.appendleft(frame)
                self._queued_bytes += len(frame.payload)
                self._wake.set()
                return
            self._sent.append(frame)
            n = len(frame.payload)
            backlogged = bool(self._fwd or self._own or self._timed)
            sample = link.meter.on_send(time.perf_counter(), n, backlogged)
            if sample is not None:
                link.stats.observe_transfer(*sample)
            link.stats.bytes_sent += n
            link.stats.last_activity = time.monotonic()
            self.frames_sent += 1
            self.bytes_sent += n
            yield frame

    async def close(self) -> None:
        """No more frames: flush, then wait for every stream's acknowledgement."""
        self._closed = True
        self._wake.set()
        try:
            while True:
                gen = self._generation
                await asyncio.gather(*self._tasks)
                if self._failure is not None or gen == self._generation:
                    break
        finally:
            self._link.meter.idle()
        if self._failure is not None:
            raise self._failure

    def abort(self, reason: str) -> None:
        self._fail(PeerError(Status.UNSPECIFIED, f"aborted: {reason}"))
        self._timed_wake.set()
        if self._pump is not None:
            self._pump.cancel()
        for call in self._calls:
            call.cancel()


def _retrieve(task: asyncio.Future[Any]) -> None:
    """Mark a task's exception as seen: failures are reported through the stream, not the task."""
    if not task.cancelled():
        task.exception()
