"""gRPC failures as PeerErrors: the remote application status, the gRPC code and the connection's fate as fields."""

from __future__ import annotations

import grpc
from grpc import aio

from dreamp2p.errors import Connection, PeerError, Status
from dreamp2p.transport import serde
from dreamp2p.transport.tlsfailure import tls_failure

# gRPC core's words (from the errno's text) for a connection attempt the member's host refused, and for an
# established connection that ended under a call; matched lower-case, anywhere in the details
_REFUSED = ("connection refused",)
_BROKEN = ("connection reset", "connection timed out", "socket closed", "broken pipe", "goaway received")


def connection_fate(code: grpc.StatusCode, details: str) -> Connection | None:
    """What became of the connection under a failed call (see `Connection`): only UNAVAILABLE calls have one.

    A refusal is named in the details of a connection attempt ("failed to connect to all addresses; ...:
    Connection refused"); a broken connection in those of a call it carried ("Stream removed
    (recvmsg:Connection reset by peer)", "... Connection timed out (110)", "Socket closed").
    """
    if code != grpc.StatusCode.UNAVAILABLE:
        return None
    words = details.lower()
    if any(w in words for w in _REFUSED):
        return Connection.REFUSED
    if "failed to connect" in words:
        return None  # no connection was made (an unreachable host, a timed-out attempt): silence, not a break
    if any(w in words for w in _BROKEN):
        return Connection.BROKEN
    return None


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
    fate = connection_fate(code, details)
    return PeerError(status, f"{code.name}: {details}", grpc_code=code.name, connection=fate)
