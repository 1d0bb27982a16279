"""Certificate problems named: `config check` and a starting peer read the files, a failed TLS handshake says why.

An expired, not-yet-valid or wrongly signed certificate used to surface only as "no member answered the
handshake" on the node that had it, and as gRPC core lines on the others. Here each problem must be named
where it can be seen: in the files themselves (config check, peer start), by a dialer that verifies the
server's certificate (the gRPC error text, classified), and by a node whose own certificate its peer refused
(the peer only closes the connection, so the node looks at its own files). Certificates come from
deploy/tls/make-certs.sh; expired and not-yet-valid ones from ``openssl ca`` with explicit dates
(conftest.make_dated_cert). Every server listens on 127.0.0.1.
"""

from __future__ import annotations

import contextlib
import datetime
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from conftest import make_certs, make_dated_cert, server_credentials_of
from grpc import aio
from rawpeer import CLUSTER, MANIFEST, TOKEN, running_peer

from dreamp2p import PROTOCOL_VERSION
from dreamp2p.config import PeerConfig, PeerInfo, TLSConfig, TransportConfig
from dreamp2p.config.check import check_file
from dreamp2p.errors import PeerError
from dreamp2p.messages import Hello
from dreamp2p.peer import Peer
from dreamp2p.transport.client import Link

Certs = dict[str, str]
# calls and attempts give up after a second; a handshake after 3 s
QUICK = TransportConfig(probe_interval_s=3600.0, rpc_deadline_s=1.0, connect_timeout_s=3.0, heartbeat_s=0.0)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Certs]:
    """The cluster's CA and good certificate, and one set of files per problem (each trusting the cluster CA)."""
    cluster, stranger = tmp_path_factory.mktemp("cluster"), tmp_path_factory.mktemp("stranger")
    good, other = make_certs(cluster), make_certs(stranger)
    now = datetime.datetime.now(datetime.UTC)
    day = datetime.timedelta(days=1)
    y2020 = datetime.datetime(2020, 1, 1, tzinfo=datetime.UTC)
    y2099 = datetime.datetime(2099, 1, 1, tzinfo=datetime.UTC)
    return {
        "good": good,
        "expired": make_dated_cert(cluster, "expired", y2020, y2020 + day),
        "not-yet-valid": make_dated_cert(cluster, "future", y2099, y2099 + day),
        "unknown-ca": {**other, "ca_file": good["ca_file"]},
        "wrong-key": {**good, "key_file": other["key_file"]},
        "other-name": make_dated_cert(cluster, "elsewhere", now - day, now + day, hosts=("elsewhere.example",)),
    }


# what config check and a starting peer say of each set of files
FILE_PROBLEMS = {
    "expired": "expired on 2020-01-02 00:00:00 UTC",
    "not-yet-valid": "not valid before 2099-01-01 00:00:00 UTC",
    "unknown-ca": "not signed by the CA in node.tls.ca_file",
    "wrong-key": "does not match the certificate",
}


def _node_file(tmp_path: Path, certs: Certs) -> Path:
    path = tmp_path / "node.toml"
    path.write_text(
        '[node]\nnode_id = "a"\n[node.tls]\nmutual = true\n'
        + "".join(f'{key} = "{value}"\n' for key, value in certs.items())
    )
    return path


@pytest.mark.parametrize("problem", sorted(FILE_PROBLEMS))
def test_config_check_names_the_certificate_problem(pki: dict[str, Certs], problem: str, tmp_path: Path) -> None:
    errors = check_file(_node_file(tmp_path, pki[problem]))
    assert len(errors) == 1, errors
    assert FILE_PROBLEMS[problem] in errors[0], errors
    field = "node.tls.key_file" if problem == "wrong-key" else "node.tls.cert_file"
    assert errors[0].startswith(field), errors


def test_config_check_passes_good_files_and_leaves_absent_ones_unchecked(pki: dict[str, Certs], tmp_path: Path) -> None:
    assert check_file(_node_file(tmp_path, pki["good"])) == []
    # a file config check cannot read here (another host's path, a key only the node's user may read)
    absent = {k: str(tmp_path / "elsewhere" / Path(v).name) for k, v in pki["good"].items()}
    assert check_file(_node_file(tmp_path, absent)) == []


@pytest.mark.parametrize("problem", ["expired", "wrong-key"])
async def test_a_peer_refuses_to_start_with_a_bad_certificate(pki: dict[str, Certs], problem: str) -> None:
    peer = Peer(PeerConfig(node_id="p1", tls=TLSConfig(**pki[problem], mutual=True)))
    with pytest.raises(ValueError, match="tls") as err:
        await peer.start()
    assert FILE_PROBLEMS[problem] in str(err.value)
    await peer.close()


@contextlib.asynccontextmanager
async def tls_server(certs: Certs) -> AsyncIterator[str]:
    """A gRPC server on 127.0.0.1 presenting ``certs``' certificate (whatever its dates or signer; no
    service: every test here fails in the TLS handshake), its address."""
    server = aio.server()
    port = server.add_secure_port("127.0.0.1:0", server_credentials_of(certs, mutual=True))
    await server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop(None)


def _hello(node: str = "p0") -> Hello:
    return Hello(CLUSTER, PROTOCOL_VERSION, node, MANIFEST, (0,), "127.0.0.1:1")


# what a dialer that verifies the server's certificate says of each
SERVER_PROBLEMS = {
    "expired": "the peer's certificate has expired",
    "not-yet-valid": "the peer's certificate is not valid yet",
    "unknown-ca": "the peer's certificate is not signed by a CA in this node's ca_file",
    "other-name": "the peer's certificate does not name the address dialled",
}


@pytest.mark.parametrize("problem", sorted(SERVER_PROBLEMS))
async def test_a_dialer_names_the_problem_of_the_servers_certificate(pki: dict[str, Certs], problem: str) -> None:
    async with tls_server(pki[problem]) as address:
        link = Link("p0", PeerInfo("p1", address), QUICK, TLSConfig(**pki["good"], mutual=True), TOKEN)
        try:
            with pytest.raises(PeerError) as err:  # a call that does not wait for the connection
                await link.status()
            assert err.value.grpc_code == "UNAVAILABLE"
            assert SERVER_PROBLEMS[problem] in str(err.value)
            with pytest.raises(PeerError) as err:  # the handshake waits for it, until its timeout
                await link.handshake(_hello(), timeout=2.0)
            assert SERVER_PROBLEMS[problem] in str(err.value)
        finally:
            await link.close()


async def test_a_node_whose_own_certificate_expired_is_told_so(pki: dict[str, Certs]) -> None:
    """With mutual TLS the server refuses the client's certificate and closes the connection, telling the client
    nothing it could show: the client looks at its own certificate and names what is wrong with it."""
    async with running_peer(tls=TLSConfig(**pki["good"], mutual=True), transport=QUICK) as peer:
        tls = TLSConfig(**pki["expired"], mutual=True)
        link = Link("p0", PeerInfo("p1", peer.address), QUICK, tls, TOKEN)
        try:
            with pytest.raises(PeerError) as err:
                await link.handshake(_hello(), timeout=2.0)
            assert "this node's own tls.cert_file" in str(err.value)
            assert FILE_PROBLEMS["expired"] in str(err.value)
        finally:
            await link.close()


async def test_no_member_answered_says_which_certificate_problem_it_met(pki: dict[str, Certs]) -> None:
    async with tls_server(pki["expired"]) as address:
        ring = (PeerInfo("p0", "127.0.0.1:0"), PeerInfo("p1", address))
        tls = TLSConfig(**pki["good"], mutual=True)
        peer = Peer(PeerConfig(node_id="p0", ring=ring, token=TOKEN, tls=tls, transport=QUICK))
        await peer.start()
        try:
            with pytest.raises(PeerError) as err:
                await peer.connect(require_all=False)
            message = str(err.value)
            assert "no member of the ring answered the handshake" in message
            assert "p1: TLS handshake failed: the peer's certificate has expired" in message
        finally:
            await peer.close(grace=0.1)
