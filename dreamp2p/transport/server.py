"""Thin gRPC servicer: decode requests with serde, call the peer, map PeerError to a gRPC status.

No protocol logic lives here; see `dreamp2p.peer` for what each call means. Every call but Status first
takes a slot from the call policy (`transport.callcap`: per connection, per member, members' reserved
slots), and frames and votes count only from a connection that handshook under the id they claim.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from typing import Any, Protocol, runtime_checkable

import grpc
from grpc import aio

from dreamp2p.config import PeerConfig, TransportConfig
from dreamp2p.errors import PeerError, Status
from dreamp2p.messages import Frame, Hello, MemberProgress, PeerStatus, Vote
from dreamp2p.statemeta import STREAM_CHUNK_BYTES, StateManifest
from dreamp2p.transport import serde
from dreamp2p.transport.auth import TokenAuthInterceptor, token_names
from dreamp2p.transport.budget import SenderBudget
from dreamp2p.transport.callcap import CallLimits, CallSlots, ConnectionBindings, Ticket
from dreamp2p.transport.identity import certificate_names, identity_refusal
from dreamp2p.transport.options import server_credentials, server_options
from dreamp2p.v1 import peer_pb2 as pb
from dreamp2p.v1 import peer_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)


class PeerBackend(Protocol):
    """What the servicer needs from the peer behind it."""

    max_payload: int
    max_probe_bytes: int

    def admit(self, hello: Hello) -> Hello: ...

    async def accept_frame(self, frame: Frame) -> None: ...

    def stream_broken(self, sender: str, keys: set[tuple[int, int]], reason: str) -> None: ...

    def note_rejected(self, err: PeerError) -> None: ...

    def note_probe(self, sender: str, nbytes: int) -> None: ...

    def status(self) -> PeerStatus: ...

    def progress(self) -> MemberProgress | None: ...

    def out_of_ring(self) -> bool: ...

    def vote(self, v: Vote) -> None: ...


@runtime_checkable
class StateBackend(Protocol):
    """What serving state needs from the backend besides `PeerBackend` (a backend without it serves none)."""

    config: PeerConfig
    state_donor: Any  # a StateSource, or None where this node does not serve its state
    ready: bool  # False while this node is joining itself: it has no state to give yet

    def is_admitted(self, sender: str) -> bool: ...


class ServedSnapshot(Protocol):
    """A captured state as the servicer sees it (see `dreamp2p.state.snapshot.Snapshot`)."""

    @property
    def manifest(self) -> StateManifest: ...


class StateSource(Protocol):
    """What the servicer needs from a node's state donor (see `dreamp2p.state.donor.StateDonor`)."""

    async def manifest(self, timeout: float) -> ServedSnapshot: ...

    def chunks(
        self, snapshot_id: int, tensor: str, offset: int, length: int, chunk_bytes: int
    ) -> Iterator[tuple[int, memoryview]]: ...


class PeerServicer(pb_grpc.PeerServicer):
    def __init__(
        self, backend: PeerBackend, bind_identity: bool = False, member_tokens: Mapping[str, str] | None = None
    ) -> None:
        self._b = backend
        self._budget = SenderBudget.for_backend(backend)  # bytes each sender has waiting in Push
        transport = _transport_of(backend)
        self.slots = CallSlots(CallLimits.of(transport))  # calls running, per connection and member
        self.bindings = ConnectionBindings()  # which connections handshook as which member
        self._first_frame_s = transport.first_frame_timeout_s
        # mutual TLS with binding: every node id a caller claims must be named by its certificate
        self._bind = bind_identity
        # per-node tokens (digest -> node id): every node id a caller claims must be its token's
        self._tokens = dict(member_tokens or {})

    def _claim_check(self, context: aio.ServicerContext) -> Callable[[str], PeerError | None]:
        """Why this call may not claim a node id (None: it may), from its certificate and its token."""
        cert = certificate_names(context) if self._bind else None
        token = token_names(context.invocation_metadata(), self._tokens) if self._tokens else None

        def refusal(claimed: str) -> PeerError | None:
            return identity_refusal(cert, claimed) or identity_refusal(token, claimed, "token")

        return refusal

    async def _refuse_impostor(self, context: aio.ServicerContext, claimed: str) -> None:
        err = self._claim_check(context)(claimed)
        if err is not None:
            await _abort(context, err)

    async def _slot(self, context: aio.ServicerContext) -> Ticket:
        """A slot for this call from the call policy, or the call is refused (OVERSIZE) before its handler runs."""
        connection = context.peer()
        try:
            return self.slots.acquire(connection, self.bindings.member_of(connection))
        except PeerError as err:
            # at debug: a caller holding calls would otherwise write a log line per refusal (the count is kept)
            await _abort(context, err, logging.DEBUG)
            raise

    def capped(self, handler: Callable[[Any, aio.ServicerContext], Awaitable[Any]]) -> Any:
        """``handler`` (a unary call) run only with a slot from the call policy."""

        async def run(request: Any, context: aio.ServicerContext) -> Any:
            ticket = await self._slot(context)
            try:
                return await handler(request, context)
            finally:
                self.slots.release(ticket)

        return run

    async def Handshake(self, request: pb.HandshakeRequest, context: aio.ServicerContext) -> pb.HandshakeResponse:
        await _refuse_undecodable(request, context)
        await self._refuse_impostor(context, request.node_id)
        try:
            mine = self._b.admit(serde.hello_from_proto(request))
        except PeerError as err:
            await _abort(context, err)
        self.bindings.bind(request.node_id, context.peer())  # its frames and votes count from here on
        return serde.hello_reply(mine)

    async def Push(self, request_iterator: AsyncIterator[bytes], context: aio.ServicerContext) -> pb.PushAck:
        """Frames arrive as raw serialized DataFrames (see `add_to_server`) and are parsed without copying."""
        ticket = await self._slot(context)
        try:
            messages = request_iterator
            if ticket.member is None:  # a stranger's stream must speak at once (a member's may wait for data)
                messages = self._first_in_time(request_iterator, ticket.connection)
            return await self._push(messages, context, ticket.connection)
        finally:
            self.slots.release(ticket)

    async def _first_in_time(self, messages: AsyncIterator[bytes], connection: str) -> AsyncIterator[bytes]:
        """``messages``, refused (NEEDS_HANDSHAKE) unless the first arrives within ``first_frame_timeout_s``."""
        it = aiter(messages)
        try:
            first = await asyncio.wait_for(_next(it), self._first_frame_s)
        except TimeoutError:
            raise PeerError(
                Status.NEEDS_HANDSHAKE,
                f"connection {connection} has not handshaken and sent no frame within {self._first_frame_s:g} s "
                "(transport.first_frame_timeout_s)",
            ) from None
        if first is None:
            return
        yield first
        async for message in it:
            yield message

    async def _push(self, messages: AsyncIterator[bytes], context: aio.ServicerContext, connection: str) -> pb.PushAck:
        frames = 0
        nbytes = 0
        sender = ""
        keys: set[tuple[int, int]] = set()  # rounds this stream carried: only they fail if it breaks
        impostor_of = self._claim_check(context)
        try:
            async for message in messages:
                frame = serde.frame_from_wire(message, self._b.max_payload)
                if (impostor := impostor_of(frame.sender)) is not None:
                    raise impostor
                if (unbound := self.bindings.refusal(frame.sender, connection, "a frame")) is not None:
                    raise unbound
                sender = frame.sender
                # a frame ahead of its round waits in accept_frame: bounded per sender across its streams
                with self._budget.holding(sender, len(frame.payload)):
                    await self._b.accept_frame(frame)
                keys.add((frame.group_id, frame.round_id))
                frames += 1
                nbytes += len(frame.payload)
        except PeerError as err:
            self._b.note_rejected(err)
            await _abort(context, err)
        except asyncio.CancelledError:
            if sender:
                self._b.stream_broken(sender, keys, "upstream cancelled its stream")
            raise
        return serde.push_ack(frames, nbytes)

    async def Probe(self, request: pb.ProbeRequest, context: aio.ServicerContext) -> pb.ProbeResponse:
        await _refuse_undecodable(request, context)
        if request.reply_bytes > self._b.max_probe_bytes or len(request.burst) > self._b.max_probe_bytes:
            await _abort(context, PeerError(Status.OVERSIZE, f"probe larger than {self._b.max_probe_bytes} bytes"))
        await self._refuse_impostor(context, request.sender)
        self._b.note_probe(request.sender, len(request.burst))
        return serde.probe_response(
            request.nonce, len(request.burst), request.reply_bytes, self._b.progress(), self._b.out_of_ring()
        )

    async def Status(self, request: pb.StatusRequest, context: aio.ServicerContext) -> pb.StatusResponse:
        await _refuse_undecodable(request, context)
        return serde.status_to_proto(self._b.status())

    async def Vote(self, request: pb.VoteRequest, context: aio.ServicerContext) -> pb.VoteReply:
        await _refuse_undecodable(request, context)
        await self._refuse_impostor(context, request.sender)
        # a vote counts only from a connection that handshook as its sender: no forged "failed" votes
        unbound = self.bindings.refusal(request.sender, context.peer(), "a vote")
        if unbound is not None:
            await _abort(context, unbound)
        try:
            self._b.vote(serde.vote_from_proto(request))
        except PeerError as err:
            await _abort(context, err)
        return pb.VoteReply(status=pb.STATUS_OK)

    async def GetStateManifest(
        self, request: pb.StateManifestRequest, context: aio.ServicerContext
    ) -> pb.StateManifest:
        """Describe a snapshot of this node's state, waiting (bounded) for the trainer to publish one."""
        await _refuse_undecodable(request, context)
        await self._refuse_impostor(context, request.sender)
        try:
            backend, donor = self._state_donor(serde.state_manifest_request_from_proto(request))
            wait = backend.config.transport.rpc_deadline_s
            left = context.time_remaining()
            snapshot = await donor.manifest(wait if left is None else min(wait, left))
        except PeerError as err:
            await _abort(context, err)
        return serde.state_manifest_to_proto(snapshot.manifest, backend.config.manifest_hash)

    async def FetchState(self, request: pb.StateChunkRequest, context: aio.ServicerContext) -> AsyncIterator[bytes]:
        """Stream one byte range of one snapshot tensor as pre-serialized StateChunks (see `add_to_server`)."""
        ticket = await self._slot(context)
        try:
            async for piece in self._fetch_state(request, context):
                yield piece
        finally:
            self.slots.release(ticket)

    async def _fetch_state(self, request: pb.StateChunkRequest, context: aio.ServicerContext) -> AsyncIterator[bytes]:
        await _refuse_undecodable(request, context)
        await self._refuse_impostor(context, request.sender)
        try:
            r = serde.state_range_from_proto(request)
            _, donor = self._state_donor(r.sender)
            chunk = min(self._b.max_payload, STREAM_CHUNK_BYTES)
            pieces = donor.chunks(r.snapshot_id, r.tensor, r.offset, r.length, chunk)
        except PeerError as err:
            await _abort(context, err)
        for offset, data in pieces:
            yield serde.state_chunk_to_wire(offset, data)

    def _state_donor(self, sender: str) -> tuple[StateBackend, StateSource]:
        """The backend and its donor, once ``sender`` is known to be admitted here."""
        b = self._b
        if not isinstance(b, StateBackend):
            raise PeerError(Status.NOT_FOUND, "this node does not serve state")
        if not b.is_admitted(sender):
            raise PeerError(Status.UNKNOWN_PEER, f"{sender!r} has not completed a handshake with this process")
        donor: StateSource | None = b.state_donor
        if donor is None:
            raise PeerError(Status.NOT_FOUND, "this node does not serve state")
        if not b.ready:
            # answered at once, so a joiner turns to the members that have a state instead of waiting
            raise PeerError(Status.JOINING, "joining itself: no training state to give yet")
        return b, donor


def _transport_of(backend: object) -> TransportConfig:
    """``backend.config.transport`` (a PeerConfig's, as `dreamp2p.peer.Peer` has), else the defaults."""
    cfg = getattr(backend, "config", None)
    return cfg.transport if isinstance(cfg, PeerConfig) else TransportConfig()


async def _next(it: AsyncIterator[bytes]) -> bytes | None:
    """The next message, None at the end (StopAsyncIteration does not cross a task boundary well)."""
    try:
        return await anext(it)
    except StopAsyncIteration:
        return None


class _Undecodable:
    """Stands in for a request whose bytes protobuf could not parse (gRPC would answer a vague UNKNOWN)."""

    def __init__(self, reason: str) -> None:
        self.reason = reason


def _decoder(cls: Any) -> Callable[[bytes], Any]:
    def decode(data: bytes) -> Any:
        try:
            return cls.FromString(data)
        except Exception as exc:  # protobuf's DecodeError and friends: any failure means malformed input
            return _Undecodable(f"malformed {cls.__name__}: {exc}")

    return decode


async def _refuse_undecodable(request: Any, context: aio.ServicerContext) -> None:
    if isinstance(request, _Undecodable):
        await _abort(context, PeerError(Status.BAD_FRAME, request.reason))


async def _abort(context: aio.ServicerContext, err: PeerError, level: int = logging.INFO) -> None:
    log.log(level, "refusing call: %s", err)
    await context.abort(serde.GRPC_CODE[err.status], serde.error_details(err))


def add_to_server(servicer: PeerServicer, server: aio.Server) -> None:
    """Register the Peer service like the generated helper; Push gets raw bytes, FetchState yields them.

    Every call but Status runs under the call policy (`PeerServicer.capped`; Push and FetchState take
    their slot themselves): Status never waits, so an operator and the members can always ask it.
    """
    capped = servicer.capped
    handlers = {
        "Handshake": grpc.unary_unary_rpc_method_handler(
            capped(servicer.Handshake),
            request_deserializer=_decoder(pb.HandshakeRequest),
            response_serializer=pb.HandshakeResponse.SerializeToString,
        ),
        "Push": grpc.stream_unary_rpc_method_handler(
            servicer.Push, request_deserializer=None, response_serializer=pb.PushAck.SerializeToString
        ),
        "Probe": grpc.unary_unary_rpc_method_handler(
            capped(servicer.Probe),
            request_deserializer=_decoder(pb.ProbeRequest),
            response_serializer=pb.ProbeResponse.SerializeToString,
        ),
        "Status": grpc.unary_unary_rpc_method_handler(
            servicer.Status,
            request_deserializer=_decoder(pb.StatusRequest),
            response_serializer=pb.StatusResponse.SerializeToString,
        ),
        "Vote": grpc.unary_unary_rpc_method_handler(
            capped(servicer.Vote),
            request_deserializer=_decoder(pb.VoteRequest),
            response_serializer=pb.VoteReply.SerializeToString,
        ),
        "GetStateManifest": grpc.unary_unary_rpc_method_handler(
            capped(servicer.GetStateManifest),
            request_deserializer=_decoder(pb.StateManifestRequest),
            response_serializer=pb.StateManifest.SerializeToString,
        ),
        # chunks are serialized by serde with one copy of the tensor bytes: no serializer here
        "FetchState": grpc.unary_stream_rpc_method_handler(
            servicer.FetchState, request_deserializer=_decoder(pb.StateChunkRequest), response_serializer=None
        ),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("dreamp2p.v1.Peer", handlers),))


def build_server(config: PeerConfig, backend: PeerBackend) -> tuple[aio.Server, int]:
    """Create (not start) the aio server bound to ``config.listen``; returns it and the bound port."""
    members = config.member_tokens()
    interceptors = [TokenAuthInterceptor(config.token, members)] if config.token else []
    server = aio.server(
        options=server_options(config.transport),
        interceptors=interceptors,
        # no gRPC-wide cap: it would refuse a member's calls once strangers held every slot; the servicer's
        # call policy caps calls per connection, per member and in all, and keeps slots for each member
        maximum_concurrent_rpcs=None,
    )
    tls = config.tls
    bind = tls is not None and tls.mutual and tls.bind_identity
    if config.token and not members and not bind and len(config.ring) > 1:
        log.warning(
            "node %s: every member shares one token, so any holder of it can handshake as another member and send "
            "frames and votes in its name. Give each node a token of its own (ring[].token_sha256; `dreamp2p config "
            "token` makes one) or use mutual TLS (deploy/tls/make-certs.sh)",
            config.node_id,
        )
    add_to_server(PeerServicer(backend, bind_identity=bind, member_tokens=members), server)
    if config.tls is not None:
        port = server.add_secure_port(config.listen, server_credentials(config.tls))
    else:
        port = server.add_insecure_port(config.listen)
    if port == 0:
        raise OSError(f"could not bind {config.listen}")
    return server, port
