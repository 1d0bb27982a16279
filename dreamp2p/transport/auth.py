"""Shared-token authentication: every call carries ``authorization: Bearer <token>``, checked here.

A server interceptor, so no servicer method can forget the check; comparison is constant-time.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
from grpc import aio

from dreamp2p.errors import PeerError, Status
from dreamp2p.transport.serde import error_details

METADATA_KEY = "authorization"


def token_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    return ((METADATA_KEY, f"Bearer {token}"),) if token else ()


class TokenAuthInterceptor(aio.ServerInterceptor):
    def __init__(self, token: str) -> None:
        if not token:
            raise ValueError("token must not be empty")
        self._expected = f"Bearer {token}".encode()

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        got = ""
        for key, value in handler_call_details.invocation_metadata or ():
            if key == METADATA_KEY:
                got = value if isinstance(value, str) else value.decode("latin-1")
        if got and hmac.compare_digest(got.encode(), self._expected):
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
