"""Who may connect: TLS required off loopback, mutual TLS, and node ids bound to certificates.

Config checks run in process (a peer or daemon that would listen or dial outside loopback without TLS
is refused at start, naming every such address); the rest runs a real gRPC server
(:class:`~dreamp2p.peer.Peer`) on 127.0.0.1 and talks to it with raw gRPC clients over TLS channels made
by hand. Certificates come from deploy/tls/make-certs.sh (openssl), so the script operators use is
exercised too. What a caller without the token gets is in test_bad_input.py; limits on what an admitted
caller may hold are in test_hardening.py.
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc
import pytest
from conftest import MAKE_CERTS, ROOT, make_certs
from grpc import aio
from rawpeer import BAD_MD, CALL_TIMEOUT, GOOD_MD, hello_request, push, refused, running_peer, waiting_frame

from dreamp2p.config import DaemonConfig, PeerConfig, PeerInfo, TLSConfig, is_loopback_address
from dreamp2p.v1 import peer_pb2 as pb
from dreamp2p.v1 import peer_pb2_grpc as pb_grpc

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
            ok = await stub.Handshake(hello_request(node_id="p0"), metadata=GOOD_MD, timeout=CALL_TIMEOUT)
            assert ok.node_id == "p1"
            # p0's certificate, another member's name: every call that claims a node id refuses it
            lead = "IDENTITY_MISMATCH: "
            why = "claims node id 'p2', but its TLS certificate names only: p0"
            denied = grpc.StatusCode.PERMISSION_DENIED
            await refused(
                stub.Handshake(hello_request(node_id="p2"), metadata=GOOD_MD, timeout=CALL_TIMEOUT), denied, lead, why
            )
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
            ok = await pb_grpc.PeerStub(channel).Handshake(
                hello_request(node_id="p2"), metadata=GOOD_MD, timeout=CALL_TIMEOUT
            )
            assert ok.node_id == "p1" and "p2" in peer.admitted()
        finally:
            await channel.close(grace=None)
