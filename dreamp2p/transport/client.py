"""Client side of one link: channels to a neighbour, chunk streams with backpressure, probes, stats.

A :class:`Link` owns one control channel and ``streams_per_link`` data channels to one peer, each a TCP
connection of its own, and handshakes on each of them (the server counts frames and votes only from a
connection that handshook under the id they claim, see `transport.callcap`). The control channel carries
only small calls (handshakes, heartbeats, votes, status, state manifests): on a data connection they
would queue behind the frames already in its socket buffer, seconds of them on a slow link, and a member
busy sending would be counted dead. A round's frames leave through an
:class:`~dreamp2p.transport.outbound.OutboundStream` the link opens over the data channels, paced by the
link's optional token bucket (WAN emulation) and metered for goodput; probes and state transfers use the
first data channel. The link keeps the backlog of round bytes handed to it and not acknowledged yet
(`backlog_s`, in seconds of its measured goodput), which tells the heartbeat that this node's uplink is
saturated. Every call has a deadline.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import time

import grpc
from grpc import aio

from dreamp2p.config import PeerInfo, TLSConfig, TransportConfig
from dreamp2p.config.certs import tls_file_problems
from dreamp2p.errors import PeerError, Status
from dreamp2p.messages import Hello, MemberProgress, PeerStatus, RoundEvidence
from dreamp2p.statemeta import StateManifest, StateRange
from dreamp2p.transport import serde
from dreamp2p.transport.auth import token_metadata
from dreamp2p.transport.linkrate.backlog import Backlog
from dreamp2p.transport.linkrate.limiter import TokenBucket
from dreamp2p.transport.linkrate.linkstats import BusyMeter, LinkEstimator, rate_past_latency
from dreamp2p.transport.linkrate.probeburst import MAX_BURSTS, MAX_PROBE_BYTES, burst_again, probe_size, repeat_size
from dreamp2p.transport.options import channel_credentials, channel_options
from dreamp2p.transport.outbound import OutboundStream
from dreamp2p.transport.rpcerror import rpc_error
from dreamp2p.transport.tlsfailure import closed_in_handshake, tls_failure
from dreamp2p.v1 import peer_pb2 as pb
from dreamp2p.v1 import peer_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

_nonces = itertools.count(1)
# how long the call that asks a channel for its last connection error waits (it fails at once when the last
# attempt failed; it waits only while an attempt is under way)
_DIAGNOSE_TIMEOUT_S = 1.0
# the codes of a call that found no connection (DEADLINE_EXCEEDED: one that waited for it in vain)
_UNREADY = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


def _naming(err: PeerError, problem: str | None) -> PeerError:
    """``err`` with the certificate problem behind it added, unless its details name it already."""
    if problem is None or problem in err.detail:
        return err
    return PeerError(err.status, f"{err.detail}; {problem}", grpc_code=err.grpc_code)


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
        # channel 0: control; 1..: data (see the module docstring)
        self._channels = [open_channel(dest.address, cfg, tls) for _ in range(1 + cfg.streams_per_link)]
        self._stubs = [pb_grpc.PeerStub(ch) for ch in self._channels]
        self._control, self._data = self._stubs[0], self._stubs[1]
        # Push bypasses the generated serializer: frames are written with one payload copy (serde)
        self._push = [
            ch.stream_unary(
                serde.PUSH_METHOD,
                request_serializer=serde.frame_to_wire,
                response_deserializer=pb.PushAck.FromString,
            )
            for ch in self._channels[1:]
        ]
        self.stats = LinkEstimator()
        self.meter = BusyMeter()
        self.backlog = Backlog()  # round bytes handed to the link, not acknowledged yet (see `backlog_s`)
        self.bucket = TokenBucket(cfg.rate_limit) if cfg.rate_limit else None
        self.delay_s = cfg.delay_s
        self.chunk_bytes = 0
        self.remote: Hello | None = None
        # the member's training progress as its last heartbeat answer said (None: no trainer, or none yet)
        self.progress: MemberProgress | None = None
        # its last heartbeat answer said it is up but not asking to take part in rounds yet (a joiner)
        self.joining = False
        self.hello: Hello | None = None  # what we introduced ourselves with, to do it again after a restart
        self._tls = tls
        # the certificate problem the last failed attempt to connect met (see `connect_problem`), or None
        self.tls_problem: str | None = None

    def set_rate_limit(self, rate_Bps: float | None) -> None:
        self.bucket = TokenBucket(rate_Bps) if rate_Bps else None

    def goodput(self) -> float:
        """The link's measured goodput in bytes/s; NaN before the first sample."""
        return self.stats.goodput_Bps if self.stats.samples else math.nan

    def backlog_s(self) -> float:
        """The round bytes our open streams handed this link and the member has not acknowledged yet, in
        seconds of its measured goodput: 0 when there are none, inf while its goodput is not measured."""
        return self.backlog.seconds(self.goodput())

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
                reply = await self._control.Handshake(
                    request,
                    timeout=max(0.1, min(self.cfg.rpc_deadline_s, left)),
                    metadata=self._metadata,
                    wait_for_ready=True,
                )
            except aio.AioRpcError as exc:
                problem = await self.connect_problem(exc, warn=True)
                if exc.code() in _UNREADY and left > delay:
                    await asyncio.sleep(delay)
                    delay = min(1.0, delay * 2)
                    continue
                raise _naming(rpc_error(exc), problem) from None
            self.tls_problem = None
            self.remote = serde.hello_from_reply(reply)
            await self._introduce_rest(request, deadline)
            return self.remote

    async def connect_problem(self, exc: aio.AioRpcError, warn: bool = False) -> str | None:
        """The certificate problem behind a call that found no connection (TLS links only), logged as a warning
        when it is new if ``warn``; None when there is none to name. Recorded in ``tls_problem``.

        A call that waits for the connection (the handshake) fails with a bare DEADLINE_EXCEEDED: one call
        that does not wait (Status, which takes no call slot) fetches the channel's last connection error.
        A connection that closed during the handshake is how a server refuses our own certificate under
        mutual TLS; then this node's own files are what can be checked (its certificate may have expired
        since the start).
        """
        if self._tls is None or exc.code() not in _UNREADY:
            return None
        details = exc.details()
        if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
            try:
                await self._control.Status(pb.StatusRequest(), timeout=_DIAGNOSE_TIMEOUT_S, metadata=self._metadata)
                return None  # it connects now
            except aio.AioRpcError as probe:
                details = probe.details()
        problem = tls_failure(details)
        if problem is not None:
            problem = f"TLS handshake failed: {problem}"
        elif closed_in_handshake(details) and self._tls.mutual:
            own = tls_file_problems(self._tls)
            problem = (
                f"TLS handshake failed: this node's own {'; '.join(own)}"
                if own
                else "the connection closed in the TLS handshake: the peer may not trust this node's certificate "
                "(is it signed by the CA in the peer's ca_file?)"
            )
        if warn and problem is not None and problem != self.tls_problem:
            log.warning("%s at %s: %s", self.dest.node_id, self.dest.address, problem)
        self.tls_problem = problem
        return problem

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
            reply = await self._control.Status(
                pb.StatusRequest(), timeout=self.cfg.rpc_deadline_s, metadata=self._metadata
            )
        except aio.AioRpcError as exc:
            raise _naming(rpc_error(exc), await self.connect_problem(exc)) from None
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
                await self._control.Vote(
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

        The answer also carries the member's training progress, kept as :attr:`progress`, and whether it
        is still joining (:attr:`joining`). Raises
        PeerError; a refused connection comes back as UNAVAILABLE right away.
        """
        t0 = time.perf_counter()
        try:
            resp = await self._control.Probe(
                serde.probe_request(next(_nonces), b"", 0, self.me), timeout=timeout, metadata=self._metadata
            )
        except aio.AioRpcError as exc:
            raise rpc_error(exc) from None
        rtt = time.perf_counter() - t0 + 2 * self.delay_s
        self.stats.observe_rtt(rtt)
        self.progress = serde.progress_from_probe(resp)
        self.joining = resp.joining
        return rtt

    async def _timed_probe(self, burst: bytes) -> float:
        """Seconds for one Probe call carrying ``burst``, as the (emulated) link would take it."""
        t0 = time.perf_counter()
        if burst and self.bucket is not None:  # the emulated link's pacing is part of what we measure
            await self.bucket.acquire(len(burst))
        try:
            await self._data.Probe(
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

    async def probe_bandwidth(self, nbytes: int, *, shared: bool = False) -> float:
        """Send a burst and time it (minus one RTT); returns and records bytes/s. The burst is ``nbytes``, or
        more where the link's estimate and RTT ask for it (`transport.linkrate.probeburst.probe_size`); on a long
        path it is sent again, doubled, while TCP's window rather than the link paced it (`burst_again`), and
        the last reading is recorded. ``shared``: other traffic is on the link, so the reading is recorded as a
        floor (`LinkEstimator`)."""
        rtt = self.stats.min_rtt_s if self.stats.rtt_samples else 0.0
        floor = min(nbytes, MAX_PROBE_BYTES)
        previous: float | None = None
        size = probe_size(self.stats.goodput_Bps, rtt, floor, MAX_PROBE_BYTES)
        for _ in range(MAX_BURSTS):
            if previous is not None:
                size = repeat_size(size, previous, rtt, floor, MAX_PROBE_BYTES)
            elapsed = await self._timed_probe(bytes(size))
            self.stats.bytes_sent += size
            rate = rate_past_latency(size, elapsed, rtt)
            again = burst_again(size / rate, rtt, previous, rate)  # size / rate: its time past one RTT
            previous = rate
            if not again:
                break
        self.stats.observe_transfer(size, size / rate, shared=shared)
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
            reply = await self._control.GetStateManifest(
                serde.state_manifest_request(self.me), timeout=max(0.05, timeout), metadata=self._metadata
            )
        except aio.AioRpcError as exc:
            raise rpc_error(exc) from None
        return serde.state_manifest_from_proto(reply)

    async def fetch_state_range(self, snapshot_id: int, tensor: str, offset: int, length: int, timeout: float) -> bytes:
        """Bytes ``[offset, offset + length)`` of one snapshot tensor; PeerError unless exactly those arrive."""
        request = serde.state_chunk_request(StateRange(self.me, snapshot_id, tensor, offset, length))
        call = self._data.FetchState(request, timeout=max(0.05, timeout), metadata=self._metadata)
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
