"""What the adversarial tests share: a token-protected peer's identity, a lone started peer, raw calls to it.

A raw client is a plain gRPC stub on an insecure (or hand-made TLS) channel that sends hand-built
``peer_pb2`` messages with whatever metadata the test chooses. ``refused`` is the one precise-refusal
assertion: the gRPC code, the application status that leads the details (``"BAD_FRAME: ..."``) and the
fragments the details must name. Imported by name (``from rawpeer import refused``): pytest puts this
folder on the path, as tests/conftest.py's folder is.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Sequence
from typing import Any

import grpc
import pytest
from grpc import aio

from dreamp2p import PROTOCOL_VERSION
from dreamp2p.collective.ring import checksum
from dreamp2p.compression import codec_names, get_codec
from dreamp2p.config import PeerConfig, PeerInfo, TransportConfig
from dreamp2p.errors import Status
from dreamp2p.peer import Peer
from dreamp2p.v1 import peer_pb2 as pb
from dreamp2p.v1 import peer_pb2_grpc as pb_grpc

TOKEN = "s3cret"
CLUSTER = "adversarial-test"
MANIFEST = bytes(range(32))
GOOD_MD: tuple[tuple[str, str], ...] = (("authorization", f"Bearer {TOKEN}"),)
BAD_MD: tuple[tuple[str, str], ...] = (("authorization", "Bearer wrong"),)
# Deadline of every raw call, so a wrongly accepted stream fails the test instead of hanging it.
CALL_TIMEOUT = 10.0
# No probes in the background; rounds, calls and connects give up after 5 s.
FAST = TransportConfig(probe_interval_s=3600.0, round_timeout_s=5.0, rpc_deadline_s=5.0, connect_timeout_s=5.0)
SERVICE = pb.DESCRIPTOR.services_by_name["Peer"]


def hello_request(**fields: Any) -> pb.HandshakeRequest:
    """A handshake a peer of CLUSTER accepts from node p0, with ``fields`` overriding single values."""
    base: dict[str, Any] = {
        "cluster_id": CLUSTER,
        "protocol_version": PROTOCOL_VERSION,
        "node_id": "p0",
        "manifest_hash": MANIFEST,
        "codecs": [get_codec(name).wire_id for name in codec_names()],
        "advertise_address": "127.0.0.1:1",
    }
    base.update(fields)
    return pb.HandshakeRequest(**base)


@contextlib.asynccontextmanager
async def running_peer(**fields: Any) -> AsyncIterator[Peer]:
    """A started token-protected peer ``p1`` on 127.0.0.1 whose ring also lists p0 and p2 (never started).

    ``fields`` override PeerConfig keyword arguments (cluster, token, manifest and FAST by default; the ring too).
    """
    ring = fields.pop("ring", tuple(PeerInfo(f"p{i}", f"127.0.0.1:{i + 1}") for i in range(3)))
    kw: dict[str, Any] = {"cluster_id": CLUSTER, "token": TOKEN, "manifest_hash": MANIFEST, "transport": FAST}
    kw.update(fields)
    peer = Peer(PeerConfig(node_id="p1", ring=ring, **kw))
    await peer.start()
    try:
        yield peer
    finally:
        await peer.close(grace=0.1)


def waiting_frame(sender: str, group: int, payload_bytes: int = 256) -> pb.DataFrame:
    """A well-formed frame for round 1 of ``group``, a round the receiver never opens (so it waits).

    Its checksum is right: a frame that would wait is checked first (`dreamp2p.collective.framecheck`).
    """
    elements = payload_bytes // 4
    payload = bytes(payload_bytes)
    return pb.DataFrame(
        round_id=1,
        group_id=group,
        phase=pb.PHASE_REDUCE_SCATTER,
        chunk_offset=0,
        chunk_length=elements,
        codec=get_codec("fp32").wire_id,  # type: ignore[arg-type]  # an int the generated enum type accepts
        dtype=pb.DTYPE_FP32,
        element_count=2 * elements,
        payload=payload,
        checksum=checksum(payload),
        sender=sender,
    )


def push(stub: pb_grpc.PeerStub, *frames: pb.DataFrame, md: Sequence[tuple[str, str]] = GOOD_MD) -> Any:
    """One Push stream of ``frames`` (awaitable: the PushAck or the refusal)."""

    async def stream() -> AsyncIterator[pb.DataFrame]:
        for f in frames:
            yield f

    return stub.Push(stream(), metadata=md, timeout=CALL_TIMEOUT)


async def refused(
    call: Awaitable[object], code: grpc.StatusCode, lead: Status | str | None = None, *fragments: str
) -> aio.AioRpcError:
    """Await ``call``: it must fail with ``code``, details led by ``lead`` and naming every one of ``fragments``.

    A :class:`Status` lead means ``"STATUS_NAME: "``; a string is taken as it is; None checks no lead
    (an error gRPC itself raised carries no application status).
    """
    with pytest.raises(aio.AioRpcError) as info:
        await call
    err = info.value
    details = err.details() or ""
    assert err.code() == code, f"{err.code()} {details!r}"
    if isinstance(lead, Status):
        lead = f"{lead.name}: "
    if lead is not None:
        assert details.startswith(lead), details
    for fragment in fragments:
        assert fragment in details, f"{fragment!r} not in {details!r}"
    return err
