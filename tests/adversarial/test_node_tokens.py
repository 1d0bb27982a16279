"""Per-node tokens: with each ring entry's ``token_sha256``, a caller may act only as the member whose token it
presents, as mutual TLS binds ids to certificates; a node sharing one token with the others warns at start.

Config checks run in process; the rest runs a real gRPC server (:class:`~dreamp2p.peer.Peer`, node p1) on
127.0.0.1 and talks to it with raw gRPC clients.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import grpc
import pytest
from grpc import aio
from rawpeer import CALL_TIMEOUT, hello_request, push, refused, running_peer, waiting_frame

from dreamp2p.cli import main
from dreamp2p.config import PeerConfig, PeerInfo, token_digest
from dreamp2p.errors import Status
from dreamp2p.v1 import peer_pb2 as pb
from dreamp2p.v1 import peer_pb2_grpc as pb_grpc

TOKENS = {f"p{i}": f"token-of-p{i}" for i in range(3)}


def ring(**digests: str) -> tuple[PeerInfo, ...]:
    """p0..p2 on loopback, each listing its own token's digest unless ``digests`` names another."""
    return tuple(
        PeerInfo(node, f"127.0.0.1:{i + 1}", token_sha256=digests.get(node, token_digest(TOKENS[node])))
        for i, node in enumerate(TOKENS)
    )


def md(node: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {TOKENS[node]}"),)


@pytest.mark.parametrize(
    ("fields", "why"),
    [
        ({"ring": ring(p2="")}, "ring lists token_sha256 for p0, p1 but not for p2"),
        ({"ring": ring(p2=token_digest(TOKENS["p0"]))}, "'p0' and 'p2' list the same token_sha256"),
        ({"token": None}, "this node has no token"),
        ({"token": TOKENS["p0"]}, "this node's token does not hash to its ring entry's token_sha256 ('p1')"),
    ],
)
def test_per_node_tokens_are_checked_at_load(fields: dict[str, Any], why: str) -> None:
    with pytest.raises(ValueError, match=why.replace("(", r"\(").replace(")", r"\)")):
        PeerConfig(**{"node_id": "p1", "token": TOKENS["p1"], "ring": ring(), **fields})


@pytest.mark.parametrize("digest", ["abc", "g" * 64, "0" * 65])
def test_a_digest_must_be_64_hex_digits(digest: str) -> None:
    with pytest.raises(ValueError, match="ring entry 'p2': token_sha256 must be 64 hex digits"):
        PeerInfo("p2", "127.0.0.1:3", token_sha256=digest)


def test_a_digest_in_capitals_and_from_toml_loads(tmp_path: Any) -> None:
    toml = tmp_path / "p.toml"
    entries = ", ".join(
        f'{{ node_id = "{n}", address = "127.0.0.1:{i + 1}", token_sha256 = "{token_digest(t).upper()}" }}'
        for i, (n, t) in enumerate(TOKENS.items())
    )
    toml.write_text(f'node_id = "p1"\ntoken = "{TOKENS["p1"]}"\nring = [{entries}]\n')
    cfg = PeerConfig.from_toml(toml)
    assert cfg.member_tokens() == {token_digest(t): n for n, t in TOKENS.items()}
    assert PeerConfig(node_id="p1", token="shared", ring=ring(p0="", p1="", p2="")).member_tokens() == {}


async def test_a_member_may_claim_only_the_node_id_its_token_belongs_to() -> None:
    async with running_peer(token=TOKENS["p1"], ring=ring()) as peer:
        channel = aio.insecure_channel(peer.address)
        stub = pb_grpc.PeerStub(channel)
        try:
            # p0's token, p0's name: admitted
            ok = await stub.Handshake(hello_request(node_id="p0"), metadata=md("p0"), timeout=CALL_TIMEOUT)
            assert ok.node_id == "p1"
            # p0's token, another member's name: every call that claims a node id refuses it
            lead, why = "IDENTITY_MISMATCH: ", "claims node id 'p2', but its token names only: p0"
            denied = grpc.StatusCode.PERMISSION_DENIED
            hello = stub.Handshake(hello_request(node_id="p2"), metadata=md("p0"), timeout=CALL_TIMEOUT)
            await refused(hello, denied, lead, why)
            vote = pb.VoteRequest(sender="p2", group_id=1, round_id=1, view_id=0, commit=False)
            await refused(stub.Vote(vote, metadata=md("p0"), timeout=CALL_TIMEOUT), denied, lead, why)
            probe = pb.ProbeRequest(nonce=1, sender="p2")
            await refused(stub.Probe(probe, metadata=md("p0"), timeout=CALL_TIMEOUT), denied, lead, why)
            await refused(push(stub, waiting_frame("p2", 7), md=md("p0")), denied, lead, why)
            manifest = pb.StateManifestRequest(sender="p2")
            await refused(stub.GetStateManifest(manifest, metadata=md("p0"), timeout=CALL_TIMEOUT), denied, lead, why)
            # nothing of it reached the peer: no frame waits, and p2 was never admitted
            assert peer.rounds.snapshot().pending == 0
            assert "p2" not in peer.admitted()
            # p2's own token may speak for p2; a token of no member is refused before any handler
            echo = await stub.Probe(pb.ProbeRequest(nonce=2, sender="p2"), metadata=md("p2"), timeout=CALL_TIMEOUT)
            assert echo.nonce == 2
            stranger = (("authorization", "Bearer token-of-nobody"),)
            status = stub.Status(pb.StatusRequest(), metadata=stranger, timeout=CALL_TIMEOUT)
            await refused(status, grpc.StatusCode.UNAUTHENTICATED, Status.BAD_TOKEN)
        finally:
            await channel.close(grace=None)


async def test_a_shared_token_warns_at_start_and_per_node_tokens_do_not(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="dreamp2p.transport.server"):
        async with running_peer():
            pass
        shared = [r.getMessage() for r in caplog.records if "shares one token" in r.getMessage()]
        assert shared and "token_sha256" in shared[0], shared
        caplog.clear()
        async with running_peer(token=TOKENS["p1"], ring=ring()):
            pass
        assert not [r for r in caplog.records if "shares one token" in r.getMessage()]


def test_config_token_prints_a_token_and_its_digest(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["config", "token", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["token"]) >= 40 and out["token_sha256"] == token_digest(out["token"])
    assert main(["config", "token"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith('token = "') and lines[1].startswith('token_sha256 = "')
