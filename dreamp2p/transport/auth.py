"""Token authentication: every call carries ``authorization: Bearer <token>``, checked here.

A server interceptor, so no servicer method can forget the check; comparison is constant-time. With per-node
tokens (each ring entry lists the SHA-256 of its member's token) a call may carry any member's token, and
:func:`token_names` tells the servicer whose it is, so a member's id can be claimed only with its token.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any

import grpc
from grpc import aio

from dreamp2p.errors import PeerError, Status
from dreamp2p.transport.serde import error_details

METADATA_KEY = "authorization"


def token_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    return ((METADATA_KEY, f"Bearer {token}"),) if token else ()


def _bearer(metadata: Iterable[tuple[str, str | bytes]] | None) -> str:
    for key, value in metadata or ():
        if key == METADATA_KEY:
            return value if isinstance(value, str) else value.decode("latin-1")
    return ""


def _owner(bearer: str, members: Mapping[str, str]) -> str | None:
    """The member whose token ``bearer`` ("Bearer <token>") carries; every digest is compared, in constant time."""
    if not bearer.startswith("Bearer "):
        return None
    digest = hashlib.sha256(bearer[len("Bearer ") :].encode()).hexdigest().encode()
    owner = None
    for known, node in members.items():
        if hmac.compare_digest(digest, known.encode()):
            owner = node
    return owner


def token_names(metadata: Iterable[tuple[str, str | bytes]] | None, members: Mapping[str, str]) -> frozenset[str]:
    """The node id a call's token belongs to (per-node tokens, ``members``: digest -> node id); none if no member's."""
    owner = _owner(_bearer(metadata), members)
    return frozenset((owner,)) if owner is not None else frozenset()


class TokenAuthInterceptor(aio.ServerInterceptor):
    """Admits calls with this node's token, or with per-node tokens (``members``: digest -> node id) any member's."""

    def __init__(self, token: str, members: Mapping[str, str] | None = None) -> None:
        if not token:
            raise ValueError("token must not be empty")
        self._expected = f"Bearer {token}".encode()
        self._members = dict(members or {})

    def _admits(self, bearer: str) -> bool:
        if self._members:
            return _owner(bearer, self._members) is not None
        return hmac.compare_digest(bearer.encode(), self._expected)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        got = _bearer(handler_call_details.invocation_metadata)
        if got and self._admits(got):
            return await continuation(handler_call_details)
        reason = "missing authorization token" if not got else "bad authorization token"
        handler = await continuation(handler_call_details)
        return _refusing(handler, PeerError(Status.BAD_TOKEN, reason))


def _refusing(handler: grpc.RpcMethodHandler | None, err: PeerError) -> grpc.RpcMethodHandler:
    details = error_details(err)

    async def abort(_request: Any, context: aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, details)

    if handler is None:  # unknown method: let gRPC answer UNIMPLEMENTED, but only after auth
        return grpc.unary_unary_rpc_method_handler(abort)
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(abort)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(abort)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(abort)
    return grpc.unary_unary_rpc_method_handler(abort)
