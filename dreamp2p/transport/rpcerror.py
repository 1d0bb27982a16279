"""gRPC failures as PeerErrors: the remote application status and the gRPC code kept as fields."""

from __future__ import annotations

import grpc
from grpc import aio

from dreamp2p.errors import PeerError, Status
from dreamp2p.transport import serde


def rpc_error(exc: grpc.RpcError) -> PeerError:
    """Turn a failed call into a PeerError carrying the remote application status when there is one."""
    code = exc.code() if isinstance(exc, aio.AioRpcError) else grpc.StatusCode.UNKNOWN
    details = exc.details() if isinstance(exc, aio.AioRpcError) else str(exc)
    status = serde.status_from_details(details)
    if status == Status.UNSPECIFIED and code == grpc.StatusCode.DEADLINE_EXCEEDED:
        status = Status.TIMEOUT
    return PeerError(status, f"{code.name}: {details}", grpc_code=code.name)
