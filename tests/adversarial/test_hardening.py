"""Hardening (issue #5 item 4): TLS by default off loopback, mutual TLS, the token on every call, and limits.

Config checks run in process; everything else runs real gRPC servers (:class:`~dreamp2p.peer.Peer`) on
127.0.0.1 and talks to them with raw gRPC clients, as tests/test_bad_input.py does. Certificates come
from deploy/tls/make-certs.sh (openssl), so the script operators use is exercised too.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import grpc
import pytest
from conftest import make_certs
from grpc import aio

from dreamp2p import PROTOCOL_VERSION
from dreamp2p.collective.ring import checksum
from dreamp2p.compression import codec_names, get_codec
from dreamp2p.config import DaemonConfig, PeerConfig, PeerInfo, TLSConfig, TransportConfig, is_loopback_address
from dreamp2p.errors import PeerError, Status
from dreamp2p.messages import Frame
from dreamp2p.peer import Peer
from dreamp2p.transport.budget import SenderBudget
from dreamp2p.transport.server import PeerServicer
from dreamp2p.v1 import peer_pb2 as pb
from dreamp2p.v1 import peer_pb2_grpc as pb_grpc

ROOT = Path(__file__).resolve().parents[2]
MAKE_CERTS = ROOT / "deploy" / "tls" / "make-certs.sh"
TOKEN = "hardening-token"
CLUSTER = "hardening-test"
MANIFEST = bytes(range(32))
GOOD_MD = (("authorization", f"Bearer {TOKEN}"),)
BAD_MD = (("authorization", "Bearer wrong"),)
CALL_TIMEOUT = 10.0
FAST = TransportConfig(probe_interval_s=3600.0, round_timeout_s=5.0, rpc_deadline_s=5.0, connect_timeout_s=5.0)
SERVICE = pb.DESCRIPTOR.services_by_name["Peer"]

# ---------------------------------------------------------------------------------- TLS by default


@pytest.mark.parametrize(
    "address",
    [
        "127.0.0.1:0",
        "127.9.8.7:7070",
        "localhost:7070",
        "LocalHost:1",
        "[::1]:7070",
        "::1",
        "[::ffff:127.0.0.1]:1",
        "ipv4:127.0.0.1:7070",
        "dns:///localhost:7070",
        "unix:/run/dreamp2p.sock",
    ],
)
def test_loopback_addresses(address: str) -> None:
    assert is_loopback_address(address)


@pytest.mark.parametrize(
    "address",
    [
        "0.0.0.0:7070",
        "[::]:7070",
        ":7070",
        "10.199.7.1:7070",
        "192.0.2.30:7070",
        "[2001:db8::1]:7070",
        "eu-west.example.org:7070",
        "localhost.example.org:7070",
        "eu-west:7070",
        "dns:///eu-west.example.org:7070",
    ],
)
def test_non_loopback_addresses(address: str) -> None:
    assert not is_loopback_address(address)


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        pytest.param({"listen": "0.0.0.0:7070"}, "listen '0.0.0.0:7070' is not loopback", id="listen"),
        pytest.param({"advertise": "eu.example.org:7070"}, "advertise 'eu.example.org:7070'", id="advertise"),
        pytest.param(
            {"ring": (PeerInfo("a", "127.0.0.1:7070"), PeerInfo("b", "10.0.0.2:7070"))},
            "ring[1].address '10.0.0.2:7070' is not loopback",
            id="ring-member",
        ),
        pytest.param(
            {"listen": "[::]:7070", "ring": (PeerInfo("a", "[::1]:7070"), PeerInfo("b", "b.example.org:7070"))},
            "listen '[::]:7070' and ring[1].address 'b.example.org:7070' are not loopback",
            id="several",
        ),
    ],
)
def test_non_loopback_without_tls_is_refused(fields: dict[str, Any], named: str) -> None:
    with pytest.raises(ValueError) as info:
        PeerConfig(node_id="a", **fields)
    message = str(info.value)
    assert named in message
    assert "TLS is required outside loopback" in message
    assert "Configure tls (cert_file, key_file" in message
    assert "set allow_insecure = true" in message
    # the opt-out and TLS are each accepted
    assert PeerConfig(node_id="a", allow_insecure=True, **fields).allow_insecure
    tls = TLSConfig(cert_file="node.pem", key_file="node.key", ca_file="ca.pem", mutual=True)
    assert PeerConfig(node_id="a", tls=tls, **fields).tls == tls


def test_loopback_needs_neither_tls_nor_opt_out() -> None:
    ring = (PeerInfo("a", "127.0.0.1:7070"), PeerInfo("b", "localhost:7071"), PeerInfo("c", "[::1]:7072"))
    cfg = PeerConfig(node_id="a", listen="127.0.0.1:7070", ring=ring)
    assert cfg.tls is None and not cfg.allow_insecure and cfg.non_loopback_addresses() == []


def test_opt_out_from_toml_and_its_type(tmp_path: Path) -> None:
    path = tmp_path / "peer.toml"
    path.write_text('node_id = "a"\nlisten = "0.0.0.0:7070"\nallow_insecure = true\n')
    assert PeerConfig.from_toml(path).allow_insecure
    with pytest.raises(ValueError, match="allow_insecure must be true or false"):
        PeerConfig.from_dict({"node_id": "a", "listen": "0.0.0.0:7070", "allow_insecure": "yes"})
    with pytest.raises(ValueError, match="set allow_insecure = true"):
        PeerConfig.from_dict({"node_id": "a", "listen": "0.0.0.0:7070", "allow_insecure": False})


def test_shipped_configs_load(monkeypatch: pytest.MonkeyPatch) -> None:
    """nodes/*.toml use mutual TLS; the compose rehearsal opts out explicitly on its private network."""
    monkeypatch.setenv("DREAMP2P_TOKEN", "t")
    for path in sorted((ROOT / "nodes").glob("*.toml")):
        node = DaemonConfig.from_toml(path).node
        assert node.tls is not None and node.tls.mutual and not node.allow_insecure, path
    compose = sorted((ROOT / "deploy" / "nodes-compose").glob("*.toml"))
    assert compose
    for path in compose:
        node = DaemonConfig.from_toml(path).node
        assert node.tls is None and node.allow_insecure, path


def _daemon_toml(tmp_path: Path, extra: str = "") -> Path:
    path = tmp_path / "node.toml"
    path.write_text(
        'device = "cpu"\n\n[node]\nnode_id = "eu-west"\nlisten = "0.0.0.0:7070"\n'
        f'token = "t"\n{extra}\n[task]\nsteps = 1\n'
    )
    return path


def test_daemon_without_tls_outside_loopback_fails_at_start(tmp_path: Path) -> None:
    path = _daemon_toml(tmp_path)
    with pytest.raises(ValueError, match=re.escape("listen '0.0.0.0:7070' is not loopback")):
        DaemonConfig.from_toml(path)
    out = subprocess.run(
        [sys.executable, "-m", "dreamp2p.cli", "node", "--config", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 1
    assert "dreamp2p: error: no tls is configured, but listen '0.0.0.0:7070' is not loopback" in out.stderr
    assert "set allow_insecure = true" in out.stderr
    assert DaemonConfig.from_toml(_daemon_toml(tmp_path, "allow_insecure = true")).node.allow_insecure


# ------------------------------------------------------------------------------------- raw clients


def hello(node_id: str) -> pb.HandshakeRequest:
    return pb.HandshakeRequest(
        cluster_id=CLUSTER,
        protocol_version=PROTOCOL_VERSION,
        node_id=node_id,
        manifest_hash=MANIFEST,
        codecs=[get_codec(name).wire_id for name in codec_names()],
        advertise_address="127.0.0.1:1",
    )


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
        codec=get_codec("fp32").wire_id,
        dtype=pb.DTYPE_FP32,
        element_count=2 * elements,
        payload=payload,
        checksum=checksum(payload),
        sender=sender,
    )


def push(stub: pb_grpc.PeerStub, *frames: pb.DataFrame, md: Sequence[tuple[str, str]] = GOOD_MD) -> Any:
    async def stream() -> AsyncIterator[pb.DataFrame]:
        for f in frames:
            yield f

    return stub.Push(stream(), metadata=md, timeout=CALL_TIMEOUT)


async def refused(call: Awaitable[object], code: grpc.StatusCode, lead: str = "", *fragments: str) -> str:
    """Await ``call``: it must fail with ``code``, details starting with ``lead`` and naming ``fragments``."""
    with pytest.raises(aio.AioRpcError) as info:
        await call
    details = info.value.details() or ""
    assert info.value.code() == code, f"{info.value.code()} {details!r}"
    assert details.startswith(lead), details
    for fragment in fragments:
        assert fragment in details, f"{fragment!r} not in {details!r}"
    return details


@contextlib.asynccontextmanager
async def running_peer(**fields: Any) -> AsyncIterator[Peer]:
    """A started token-protected peer ``p1`` on 127.0.0.1 whose ring also lists p0 and p2 (never started)."""
    ring = tuple(PeerInfo(f"p{i}", f"127.0.0.1:{i + 1}") for i in range(3))
    kw: dict[str, Any] = {"cluster_id": CLUSTER, "token": TOKEN, "manifest_hash": MANIFEST, "transport": FAST}
    kw.update(fields)
    peer = Peer(PeerConfig(node_id="p1", ring=ring, **kw))
    await peer.start()
    try:
        yield peer
    finally:
        await peer.close(grace=0.1)


class InFlight:
    """Wraps a peer's accept_frame to count the frames being handled at once (now and at most)."""

    def __init__(self, peer: Peer) -> None:
        self.now = 0
        self.peak = 0
        self.calls = 0
        inner = peer.accept_frame

        async def counting(frame: Frame) -> None:
            self.calls += 1
            self.now += 1
            self.peak = max(self.peak, self.now)
            try:
                await inner(frame)
            finally:
                self.now -= 1

        peer.accept_frame = counting  # type: ignore[method-assign]

    async def reach(self, n: int, timeout: float = 5.0) -> None:
        for _ in range(int(timeout / 0.01)):
            if self.now >= n:
                return
            await asyncio.sleep(0.01)
        raise AssertionError(f"{self.now} frames in flight, expected {n}")


# ----------------------------------------------------------------------------- token on every call


def _raw_call(channel: aio.Channel, method: Any, md: Sequence[tuple[str, str]]) -> Awaitable[object]:
    """Call ``method`` of the Peer service with an empty body (raw bytes, no serializers)."""
    path = f"/{SERVICE.full_name}/{method.name}"
    if method.client_streaming and method.server_streaming:
        raise AssertionError(f"{method.name}: bidirectional streams are not covered here")
    if method.client_streaming:

        async def body() -> AsyncIterator[bytes]:
            yield b""

        return channel.stream_unary(path)(body(), metadata=md, timeout=CALL_TIMEOUT)
    if method.server_streaming:
        stream = channel.unary_stream(path)(b"", metadata=md, timeout=CALL_TIMEOUT)

        async def drain() -> None:
            async for _ in stream:
                pass

        return drain()
    return channel.unary_unary(path)(b"", metadata=md, timeout=CALL_TIMEOUT)


def test_every_servicer_rpc_is_in_the_service() -> None:
    """The token test below walks the proto service; the servicer implements nothing outside it."""
    rpcs = {name for name in vars(PeerServicer) if name[:1].isupper()}
    assert rpcs <= {m.name for m in SERVICE.methods}
    assert {"Handshake", "Push", "Probe", "Status"} <= rpcs


@pytest.mark.parametrize("method", list(SERVICE.methods), ids=lambda m: m.name)
async def test_every_rpc_refuses_a_bad_or_missing_token(method: Any) -> None:
    async with running_peer() as peer:
        channel = aio.insecure_channel(peer.address)
        try:
            await refused(_raw_call(channel, method, ()), grpc.StatusCode.UNAUTHENTICATED, "BAD_TOKEN: missing")
            await refused(_raw_call(channel, method, BAD_MD), grpc.StatusCode.UNAUTHENTICATED, "BAD_TOKEN: bad")
            # with the token the same call reaches the handler (which answers however it answers)
            try:
                await _raw_call(channel, method, GOOD_MD)
            except aio.AioRpcError as err:
                assert err.code() != grpc.StatusCode.UNAUTHENTICATED, err.details()
        finally:
            await channel.close(grace=None)


# ------------------------------------------------------------------------------------- mutual TLS


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two CAs from deploy/tls/make-certs.sh, each with one certificate for localhost / 127.0.0.1."""
    out: dict[str, Path] = {}
    for ca in ("cluster", "stranger"):
        d = tmp_path_factory.mktemp(ca)
        make_certs(d)
        out[ca] = d
    return out


def server_tls(d: Path, mutual: bool) -> TLSConfig:
    return TLSConfig(str(d / "localhost.pem"), str(d / "localhost.key"), str(d / "ca.pem"), mutual=mutual)


def client_creds(trust: Path, identity: Path | None) -> grpc.ChannelCredentials:
    """Trust ``trust``'s CA; present ``identity``'s certificate when given (mutual TLS)."""
    if identity is None:
        return grpc.ssl_channel_credentials((trust / "ca.pem").read_bytes())
    return grpc.ssl_channel_credentials(
        (trust / "ca.pem").read_bytes(),
        (identity / "localhost.key").read_bytes(),
        (identity / "localhost.pem").read_bytes(),
    )


async def status_over(channel: aio.Channel, md: Sequence[tuple[str, str]] = GOOD_MD) -> pb.StatusResponse:
    try:
        return await pb_grpc.PeerStub(channel).Status(pb.StatusRequest(), metadata=md, timeout=CALL_TIMEOUT)
    finally:
        await channel.close(grace=None)


async def test_mutual_tls_requires_a_client_certificate_from_the_cluster_ca(certs: dict[str, Path]) -> None:
    cluster, stranger = certs["cluster"], certs["stranger"]
    async with running_peer(tls=server_tls(cluster, mutual=True)) as peer:
        addr = peer.address
        assert addr.startswith("127.0.0.1:")

        ok = await status_over(aio.secure_channel(addr, client_creds(cluster, cluster)))
        assert ok.node_id == "p1"

        # no client certificate, one from another CA, or no TLS at all: refused in the TLS handshake
        for channel in (
            aio.secure_channel(addr, client_creds(cluster, None)),
            aio.secure_channel(addr, client_creds(cluster, stranger)),
            aio.insecure_channel(addr),
        ):
            await refused(status_over(channel), grpc.StatusCode.UNAVAILABLE)

        # a cluster certificate does not replace the token
        channel = aio.secure_channel(addr, client_creds(cluster, cluster))
        await refused(status_over(channel, BAD_MD), grpc.StatusCode.UNAUTHENTICATED, "BAD_TOKEN: ")


async def test_server_only_tls_admits_clients_without_certificates(certs: dict[str, Path]) -> None:
    cluster, stranger = certs["cluster"], certs["stranger"]
    async with running_peer(tls=server_tls(cluster, mutual=False)) as peer:
        ok = await status_over(aio.secure_channel(peer.address, client_creds(cluster, None)))
        assert ok.node_id == "p1"
        # the client still verifies the server: a client trusting another CA refuses it
        await refused(
            status_over(aio.secure_channel(peer.address, client_creds(stranger, None))), grpc.StatusCode.UNAVAILABLE
        )


# ------------------------------------------------------------------------ node id bound to certificate


@pytest.fixture(scope="module")
def node_certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One CA; p1 (the server) as localhost, p0 and p2 each with a certificate of its own node id."""
    d = tmp_path_factory.mktemp("nodes")
    subprocess.run(
        ["bash", str(MAKE_CERTS), "--out", str(d), "--days", "2", "p1=localhost,127.0.0.1", "p0=p0", "p2=p2"],
        check=True,
        capture_output=True,
        timeout=60,
    )
    return d


def bound_peer_tls(d: Path, bind: bool = True) -> TLSConfig:
    return TLSConfig(
        str(d / "localhost.pem"), str(d / "localhost.key"), str(d / "ca.pem"), mutual=True, bind_identity=bind
    )


def channel_as(d: Path, node: str, addr: str) -> aio.Channel:
    """A mutual-TLS channel to ``addr`` presenting node ``node``'s certificate (CN = node)."""
    creds = grpc.ssl_channel_credentials(
        (d / "ca.pem").read_bytes(), (d / f"{node}.key").read_bytes(), (d / f"{node}.pem").read_bytes()
    )
    return aio.secure_channel(addr, creds, options=(("grpc.ssl_target_name_override", "localhost"),))


async def test_a_member_may_claim_only_the_node_id_its_certificate_names(node_certs: Path) -> None:
    async with running_peer(tls=bound_peer_tls(node_certs)) as peer:
        channel = channel_as(node_certs, "p0", peer.address)
        stub = pb_grpc.PeerStub(channel)
        try:
            # p0's certificate, p0's name: admitted
            ok = await stub.Handshake(hello("p0"), metadata=GOOD_MD, timeout=CALL_TIMEOUT)
            assert ok.node_id == "p1"
            # p0's certificate, another member's name: every call that claims a node id refuses it
            lead = "IDENTITY_MISMATCH: "
            why = "claims node id 'p2', but its TLS certificate names only: p0"
            denied = grpc.StatusCode.PERMISSION_DENIED
            await refused(stub.Handshake(hello("p2"), metadata=GOOD_MD, timeout=CALL_TIMEOUT), denied, lead, why)
            vote = pb.VoteRequest(sender="p2", group_id=1, round_id=1, view_id=0, commit=False)
            await refused(stub.Vote(vote, metadata=GOOD_MD, timeout=CALL_TIMEOUT), denied, lead, why)
            probe = pb.ProbeRequest(nonce=1, sender="p2")
            await refused(stub.Probe(probe, metadata=GOOD_MD, timeout=CALL_TIMEOUT), denied, lead, why)
            await refused(push(stub, waiting_frame("p2", 7)), denied, lead, why)
            manifest = pb.StateManifestRequest(sender="p2")
            await refused(stub.GetStateManifest(manifest, metadata=GOOD_MD, timeout=CALL_TIMEOUT), denied, lead, why)
            # nothing of it reached the peer: no frame waits, and p2 was never admitted
            assert peer.rounds.snapshot().pending == 0
            assert "p2" not in peer.admitted()
            # the refusal was about the name, not the connection: calls in its own name still answer
            echo = await stub.Probe(pb.ProbeRequest(nonce=2, sender="p0"), metadata=GOOD_MD, timeout=CALL_TIMEOUT)
            assert echo.nonce == 2
        finally:
            await channel.close(grace=None)


async def test_identity_binding_can_be_turned_off(node_certs: Path) -> None:
    """The check above is what refuses: with bind_identity = false the same impostor handshake is admitted."""
    async with running_peer(tls=bound_peer_tls(node_certs, bind=False)) as peer:
        channel = channel_as(node_certs, "p0", peer.address)
        try:
            ok = await pb_grpc.PeerStub(channel).Handshake(hello("p2"), metadata=GOOD_MD, timeout=CALL_TIMEOUT)
            assert ok.node_id == "p1" and "p2" in peer.admitted()
        finally:
            await channel.close(grace=None)


# ----------------------------------------------------------------------------------------- limits


def test_sender_budget_accounts_per_sender() -> None:
    budget = SenderBudget(1000)
    budget.reserve("p0", 600)
    budget.reserve("p0", 400)  # exactly at the limit is allowed
    with pytest.raises(PeerError) as info:
        budget.reserve("p0", 1)
    assert info.value.status == Status.OVERSIZE
    assert info.value.detail == (
        "sender 'p0' already has 1000 bytes of frames waiting here; 1 more would exceed the per-peer limit of "
        "1000 bytes (transport.max_buffered_bytes_per_peer)"
    )
    assert budget.held("p0") == 1000  # the refused reservation counted nothing
    budget.reserve("p2", 1000)  # another sender has its own budget
    budget.release("p0", 600)
    budget.reserve("p0", 600)
    budget.release("p0", 1000)
    budget.release("p2", 1000)
    assert budget.held("p0") == budget.held("p2") == 0 and not budget._held
    with pytest.raises(ValueError, match="more than it holds"):
        budget.release("p0", 1)


async def test_sender_budget_holding_releases_on_any_exit() -> None:
    budget = SenderBudget(100)

    async def hold(event: asyncio.Event) -> None:
        with budget.holding("p0", 60):
            await event.wait()

    task = asyncio.create_task(hold(asyncio.Event()))
    await asyncio.sleep(0)
    assert budget.held("p0") == 60
    with pytest.raises(PeerError), budget.holding("p0", 41):
        pass
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert budget.held("p0") == 0
    with pytest.raises(RuntimeError), budget.holding("p0", 100):
        raise RuntimeError("handler failed")
    assert budget.held("p0") == 0


def test_budget_sizing_and_config_limits() -> None:
    cfg = PeerConfig(node_id="a", transport=TransportConfig(max_buffered_bytes_per_peer=100 << 20))

    class WithConfig:
        config = cfg

    assert SenderBudget.for_backend(WithConfig()).limit_bytes == 100 << 20
    assert SenderBudget.for_backend(object()).limit_bytes == TransportConfig().max_buffered_bytes_per_peer == 256 << 20
    assert TransportConfig().max_concurrent_streams == 64
    with pytest.raises(ValueError, match=r"max_buffered_bytes_per_peer \(67108864\) must be larger than"):
        TransportConfig(max_buffered_bytes_per_peer=64 << 20)
    with pytest.raises(ValueError, match=re.escape("transport.max_buffered_bytes_per_peer must be > 0")):
        TransportConfig(max_buffered_bytes_per_peer=0)
    with pytest.raises(ValueError, match=re.escape("transport.max_concurrent_streams must be > 0")):
        PeerConfig.from_dict({"node_id": "a", "transport": {"max_concurrent_streams": 0}})


async def _ran_or_refused(call: Awaitable[object]) -> bool:
    """True if the Push ran here (and timed out waiting for its round), False if the stream cap refused it."""
    with pytest.raises(aio.AioRpcError) as info:
        await call
    details = info.value.details() or ""
    if info.value.code() == grpc.StatusCode.UNAVAILABLE and "RST_STREAM" in details:
        return False
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED, f"{info.value.code()} {details!r}"
    assert details.startswith("TIMEOUT: "), details
    return True


async def test_concurrent_streams_per_connection_are_capped() -> None:
    """max_concurrent_streams = 2: of six Push streams on one connection the server runs two at a time."""
    transport = TransportConfig(
        max_concurrent_streams=2, probe_interval_s=3600.0, round_timeout_s=0.6, rpc_deadline_s=5.0
    )
    async with running_peer(transport=transport) as peer:
        inflight = InFlight(peer)
        channel = aio.insecure_channel(peer.address)
        stub = pb_grpc.PeerStub(channel)
        try:
            await stub.Handshake(hello("p0"), metadata=GOOD_MD, timeout=CALL_TIMEOUT)  # connection up, settings known
            calls = [push(stub, waiting_frame("p0", 100 + i)) for i in range(6)]
            outcomes = asyncio.gather(*(_ran_or_refused(c) for c in calls))
            await inflight.reach(2)
            await asyncio.sleep(0.3)
            assert inflight.now == 2  # the others wait in the client for a free stream
            ran = sum(await outcomes)  # each waited its round_timeout_s once it ran
            # a stream the client opened before it learnt the limit is refused by HTTP/2 (REFUSED_STREAM)
            # instead of queued; either way no more than two ever ran at once
            assert inflight.calls == ran >= 2
            assert inflight.peak == 2
        finally:
            await channel.close(grace=None)


async def test_buffered_bytes_per_sender_are_capped() -> None:
    """Frames waiting for rounds that never open: p0 is refused past its limit while p2 is still accepted."""
    limit = 256 << 10
    transport = TransportConfig(
        max_message_bytes=128 << 10,
        chunk_min_bytes=64 << 10,
        chunk_max_bytes=64 << 10,
        max_buffered_bytes_per_peer=limit,
        probe_interval_s=3600.0,
        round_timeout_s=1.5,
        rpc_deadline_s=5.0,
    )
    size = 60_000  # four fit in 256 KiB (240000 bytes), a fifth does not
    async with running_peer(transport=transport) as peer:
        inflight = InFlight(peer)
        channel = aio.insecure_channel(peer.address)
        stub = pb_grpc.PeerStub(channel)
        timed_out: Callable[[Any], Awaitable[str]] = lambda c: refused(  # noqa: E731
            c, grpc.StatusCode.DEADLINE_EXCEEDED, "TIMEOUT: "
        )
        try:
            for node in ("p0", "p2"):
                await stub.Handshake(hello(node), metadata=GOOD_MD, timeout=CALL_TIMEOUT)
            waiting = asyncio.gather(*(timed_out(push(stub, waiting_frame("p0", 100 + i, size))) for i in range(4)))
            await inflight.reach(4)

            await refused(
                push(stub, waiting_frame("p0", 104, size)),
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                "OVERSIZE: ",
                f"sender 'p0' already has 240000 bytes of frames waiting here; {size} more would exceed "
                f"the per-peer limit of {limit} bytes (transport.max_buffered_bytes_per_peer)",
            )
            assert inflight.now == 4  # the refusal came before the backend

            other = asyncio.create_task(timed_out(push(stub, waiting_frame("p2", 105, size))))
            await inflight.reach(5)  # p2 has a budget of its own
            assert not other.done()

            await waiting
            await other
            assert inflight.now == 0
            # once its frames stopped waiting, p0 may buffer again
            again = asyncio.gather(*(timed_out(push(stub, waiting_frame("p0", 110 + i, size))) for i in range(4)))
            await inflight.reach(4)
            await again
        finally:
            await channel.close(grace=None)
