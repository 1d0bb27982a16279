"""gRPC failures as PeerErrors: the remote application status and the gRPC code kept as fields."""

from __future__ import annotations

import grpc
from grpc import aio

from dreamp2p.errors import PeerError, Status
from dreamp2p.transport import serde
from dreamp2p.transport.tlsfailure import tls_failure


def rpc_error(exc: grpc.RpcError) -> PeerError:
    """Turn a failed call into a PeerError carrying the remote application status when there is one; a TLS
    handshake that failed on a certificate leads its details with the problem in words."""
    code = exc.code() if isinstance(exc, aio.AioRpcError) else grpc.StatusCode.UNKNOWN
    details = exc.details() if isinstance(exc, aio.AioRpcError) else str(exc)
    status = serde.status_from_details(details)
    if status == Status.UNSPECIFIED and code == grpc.StatusCode.DEADLINE_EXCEEDED:
        status = Status.TIMEOUT
    problem = tls_failure(details) if code == grpc.StatusCode.UNAVAILABLE else None
    if problem is not None:
        details = f"TLS handshake failed: {problem}; gRPC said: {details}"
    return PeerError(status, f"{code.name}: {details}", grpc_code=code.name)
