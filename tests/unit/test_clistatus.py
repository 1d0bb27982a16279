"""`dreamp2p status --config`: which address, token and TLS a status client takes from a node's file."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from dreamp2p.clistatus import dial_address, resolve_target
from dreamp2p.config import PeerConfig


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
