"""`dreamp2p status --config`: which address, token and TLS a status client takes from a node's file."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from dreamp2p.cli.status import dial_address, region_text, resolve_target, status_json, status_text
from dreamp2p.config import PeerConfig
from dreamp2p.messages import LinkSnapshot, PeerStatus, TrainingInfo


@pytest.mark.parametrize(
    ("fields", "address"),
    [
        ({"listen": "127.0.0.1:7070"}, "127.0.0.1:7070"),
        ({"listen": "0.0.0.0:7070", "allow_insecure": True}, "127.0.0.1:7070"),
        ({"listen": "[::]:7070", "allow_insecure": True}, "[::1]:7070"),
        ({"listen": "[::1]:7070"}, "[::1]:7070"),
        ({"listen": "0.0.0.0:7070", "advertise": "eu.example.org:7070", "allow_insecure": True}, "eu.example.org:7070"),
    ],
)
def test_dial_address(fields: dict[str, object], address: str) -> None:
    assert dial_address(PeerConfig(node_id="a", **fields)) == address  # type: ignore[arg-type]


def _args(**kw: object) -> argparse.Namespace:
    base: dict[str, object] = {
        "address": None,
        "config": None,
        "token": None,
        "ca": None,
        "cert": None,
        "key": None,
        "server_name": None,
    }
    return argparse.Namespace(**{**base, **kw})


def test_the_node_file_gives_address_token_and_tls(tmp_path: Path) -> None:
    path = tmp_path / "n.toml"
    path.write_text(
        '[node]\nnode_id = "a"\nlisten = "0.0.0.0:7070"\ntoken = "tok"\n'
        '[node.tls]\ncert_file = "a.pem"\nkey_file = "a.key"\nca_file = "ca.pem"\nmutual = true\n'
    )
    target = resolve_target(_args(config=path))
    assert target.address == "127.0.0.1:7070" and target.token == "tok"
    assert target.tls is not None and target.tls.cert_file == "a.pem" and target.tls.mutual
    # flags given on the command line win over the file
    target = resolve_target(_args(config=path, address="10.0.0.2:7070", token="other", server_name="a.example"))
    assert (target.address, target.token) == ("10.0.0.2:7070", "other")
    assert target.tls is not None and target.tls.server_name_override == "a.example"
    target = resolve_target(_args(config=path, ca="other-ca.pem"))
    assert target.tls is not None and target.tls.ca_file == "other-ca.pem" and not target.tls.mutual


def test_without_a_file_the_flags_alone_decide() -> None:
    target = resolve_target(_args(address="127.0.0.1:7070"))
    assert target == type(target)("127.0.0.1:7070", None, None)
    with pytest.raises(ValueError, match="HOST:PORT"):
        resolve_target(_args())


def _status(node: str, ring: tuple[str, ...], rank: int, ranks: int) -> PeerStatus:
    link = LinkSnapshot(ring[-1], 0.01, 2.5e6, 10**6, 10**6, samples=3, chunk_bytes=65536)
    training = TrainingInfo("dreamddp", 40, 2, 36, "layer 0: every 4", region_rank=rank, region_ranks=ranks)
    return PeerStatus(node, "c", 2, ring, (link,), 5, 0, 0, training=training)


def test_a_region_shows_its_ranks_their_shard_links_and_the_plan() -> None:
    rank0 = _status("eu", ("eu", "us"), 0, 2)
    assert "region: local rank 0 of 2" in status_text(rank0)
    assert "plan v2 since step 36" in status_text(rank0)
    text = region_text([(1, _status("eu.1", ("eu.1", "us.1"), 1, 2)), (2, "127.0.0.1:7072: unreachable")])
    assert "region rank 1:" in text and "link -> us.1" in text and "region: local rank 1 of 2" in text
    assert "region rank 2: no answer (127.0.0.1:7072: unreachable)" in text
    out = json.loads(status_json(rank0, 1.0, [(1, _status("eu.1", ("eu.1", "us.1"), 1, 2)), (2, "gone")]))
    assert [r["rank"] for r in out["region_ranks_status"]] == [1, 2]
    assert out["region_ranks_status"][0]["links"][0]["peer"] == "us.1"
    assert out["region_ranks_status"][1]["error"] == "gone"
    assert "region_ranks_status" not in json.loads(status_json(rank0, 1.0))  # a peer of its own


def test_outside_a_region_no_region_line() -> None:
    assert "region:" not in status_text(_status("eu", ("eu", "us"), 0, 0))
