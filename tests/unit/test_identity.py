"""The pure part of binding a claimed node id to a TLS certificate: which names a certificate vouches for."""

from __future__ import annotations

import pytest

from dreamp2p.errors import Status
from dreamp2p.transport.identity import identity_refusal, names_from_auth

CERT = {
    "transport_security_type": [b"ssl"],
    "x509_common_name": [b"eu-west"],
    "x509_subject_alternative_name": [b"eu-west.example.org", b"203.0.113.10"],
    "x509_pem_cert": [b"-----BEGIN CERTIFICATE-----..."],
}


@pytest.mark.parametrize(
    ("auth", "names"),
    [
        (CERT, {"eu-west", "eu-west.example.org", "203.0.113.10"}),
        ({"x509_common_name": [b"p0"]}, {"p0"}),
        ({"x509_pem_cert": [b"..."]}, set()),  # a certificate naming nothing vouches for nothing
        ({"transport_security_type": [b"ssl"]}, None),  # server-only TLS: no client certificate
        ({}, None),  # plaintext
    ],
)
def test_names_come_from_the_common_name_and_the_alternative_names(
    auth: dict[str, list[bytes]], names: set[str] | None
) -> None:
    got = names_from_auth(auth)
    assert got == (frozenset(names) if names is not None else None)


@pytest.mark.parametrize("claimed", ["eu-west", "eu-west.example.org", "203.0.113.10"])
def test_a_name_the_certificate_carries_may_be_claimed(claimed: str) -> None:
    assert identity_refusal(names_from_auth(CERT), claimed) is None


@pytest.mark.parametrize("claimed", ["us-east", "EU-WEST", "eu-west ", "", "eu"])
def test_any_other_claim_is_refused_with_the_names_shown(claimed: str) -> None:
    err = identity_refusal(names_from_auth(CERT), claimed)
    assert err is not None and err.status == Status.IDENTITY_MISMATCH
    assert err.detail == (
        f"claims node id {claimed!r}, but its TLS certificate names only: 203.0.113.10, eu-west, eu-west.example.org"
    )


def test_without_a_client_certificate_the_check_does_not_apply() -> None:
    assert identity_refusal(None, "anyone") is None
