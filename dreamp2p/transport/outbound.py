"""One round's frames to one neighbour: several Push streams fed from one queue, with backpressure.

Forwarded frames go first and never wait (so the ring cannot deadlock); own frames wait for room. Frames
are paced by the link's token bucket and optional delay line (WAN emulation), metered for goodput, counted
into the link's backlog until acknowledged (`transport.linkrate.backlog`), and
replayed once more to a successor process that restarted under the round. Moved out of `transport.client`
(which opens these streams from a :class:`~dreamp2p.transport.client.Link`).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import grpc
from grpc import aio

from dreamp2p.errors import PeerError, Status
from dreamp2p.messages import Frame
from dreamp2p.transport.linkrate.linkstats import delivery_checked
from dreamp2p.transport.rpcerror import rpc_error
from dreamp2p.v1 import peer_pb2 as pb

if TYPE_CHECKING:
    from dreamp2p.transport.client import Link

log = logging.getLogger(__name__)

# How often one round may be resent to a successor that restarted under it.
MAX_REPLAYS = 3
# Transport-level outcomes of a successor process that went away (or of a connection the kernel gave up on, its
# process alive: a live peer that kept its round state ignores the chunks it already holds, `RingRound`).
_PEER_GONE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL, grpc.StatusCode.CANCELLED})


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
        self._first_t: float | None = None  # when the first frame was handed to gRPC (perf_counter)
        self._meter_samples: list[tuple[int, float]] = []  # the link meter's samples while this stream sent
        self._generation = 0
        self._replays = 0
        self._committed = 0  # bytes this stream took on for the link (its share of the link's backlog)
        self._ended = False  # that share is settled (the stream closed or was aborted)
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
            if task is None or task.cancelling():
                raise  # our own task is being cancelled: that propagates
            if self._failure is not None or gen != self._generation:
                return None  # we cancelled the call ourselves (abort or replay)
            # gRPC cancelled the call beneath us (it does when writing a request fails): the stream is
            # broken, which fails the round like any other stream failure, never as a bare cancellation
            err = PeerError(Status.UNSPECIFIED, f"the stream to {self._link.dest.node_id} was cancelled locally")
            self._fail(err)
            raise err from None

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
            self._commit(len(frame.payload))  # the link carries it once more
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
        self._commit(len(frame.payload))
        self._wake.set()

    async def put(self, frame: Frame) -> None:
        while self._queued_bytes >= self._limit and self._failure is None and not self._closed:
            self._space.clear()
            await self._space.wait()
        if self._failure is not None:
            raise self._failure
        self._own.append(frame)
        self._queued_bytes += len(frame.payload)
        self._commit(len(frame.payload))
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
            now = time.perf_counter()
            if self._first_t is None:
                self._first_t = now
            sample = link.meter.on_send(now, n, backlogged)
            if sample is not None:
                self._meter_samples.append(sample)  # taken at close, where the delivery confirms it
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
            self._end()
        if self._failure is not None:
            raise self._failure
        self._observe_delivered()

    def _observe_delivered(self) -> None:
        """Record the meter's samples of this stream that its acknowledged delivery confirms."""
        if self._first_t is None:
            return
        stats = self._link.stats
        kept = delivery_checked(
            self._meter_samples, self.bytes_sent, time.perf_counter() - self._first_t, stats.min_rtt_s
        )
        if len(kept) < len(self._meter_samples):
            log.debug(
                "%s: %d of %d goodput samples read faster than the stream's delivery; dropped",
                self._link.dest.node_id,
                len(self._meter_samples) - len(kept),
                len(self._meter_samples),
            )
        for sample in kept:
            stats.observe_transfer(*sample)

    def _commit(self, nbytes: int) -> None:
        """``nbytes`` more for the link to carry, pending in its backlog until this stream ends."""
        if not self._ended:
            self._committed += nbytes
            self._link.backlog.add(nbytes)

    def _end(self) -> None:
        """Our frames are acknowledged or given up: the link's backlog no longer holds this stream's bytes."""
        if not self._ended:
            self._ended = True
            self._link.backlog.settle(self._committed)

    def abort(self, reason: str) -> None:
        self._end()
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
