"""A failed TLS handshake's gRPC error text, in words: the texts are those grpcio 1.85 gives the dialling side."""

from __future__ import annotations

import pytest

from dreamp2p.transport.tlsfailure import closed_in_handshake, tls_failure

LEAD = "failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:7070: "
VERIFY = LEAD + "Tls handshake failed (TSI_PROTOCOL_FAILURE): SSL_ERROR_SSL: error:1000007d:SSL routines:"
VERIFY += "OPENSSL_internal:CERTIFICATE_VERIFY_FAILED: "


@pytest.mark.parametrize(
    ("details", "problem"),
    [
        (VERIFY + "certificate has expired: OK", "the peer's certificate has expired"),
        (VERIFY + "certificate is not yet valid: OK", "the peer's certificate is not valid yet"),
        (VERIFY + "unable to get local issuer certificate: OK", "not signed by a CA in this node's ca_file"),
        (VERIFY + "self signed certificate: OK", "not signed by a CA in this node's ca_file"),
        (
            LEAD + "Custom verification check failed with error: UNAUTHENTICATED: Hostname Verification Check failed.",
            "does not name the address dialled",
        ),
        (
            LEAD + "Tls handshake failed (TSI_PROTOCOL_FAILURE): SSL_ERROR_SSL: error:100000f7:SSL routines:"
            "OPENSSL_internal:WRONG_VERSION_NUMBER: Invalid certificate verification context: OK",
            "the peer does not speak TLS",
        ),
        (VERIFY + "certificate revoked: OK", "the peer's certificate failed verification"),
    ],
)
def test_a_certificate_problem_is_named(details: str, problem: str) -> None:
    named = tls_failure(details)
    assert named is not None and problem in named


@pytest.mark.parametrize(
    "details",
    [
        "failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:1: Failed to connect to remote host: "
        "Connection refused",
        "Deadline Exceeded",
        "BAD_TOKEN: missing or wrong token",
        None,
    ],
)
def test_other_failures_name_no_certificate_problem(details: str | None) -> None:
    assert tls_failure(details) is None


def test_a_connection_closed_in_the_handshake_is_told_apart() -> None:
    assert closed_in_handshake(
        "failed to connect to all addresses; last error: UNAVAILABLE: ipv4:127.0.0.1:7: Socket closed"
    )
    assert not closed_in_handshake(VERIFY + "certificate has expired: OK")
