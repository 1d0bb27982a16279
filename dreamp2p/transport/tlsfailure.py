"""What a failed TLS handshake was about, in words, from the error text gRPC gives the dialling side.

gRPC reports a refused certificate as ``UNAVAILABLE`` with OpenSSL's (BoringSSL's) reason deep in the
details, e.g. ``failed to connect to all addresses; last error: UNKNOWN: ipv4:10.0.0.2:7070: Tls handshake
failed (TSI_PROTOCOL_FAILURE): SSL_ERROR_SSL: error:1000007d:SSL routines:OPENSSL_internal:
CERTIFICATE_VERIFY_FAILED: certificate has expired``. The dialler verifies the server's certificate, so
these reasons are about the peer's certificate as this node sees it. A server that refuses the dialler's own
certificate (mutual TLS) tells it nothing gRPC passes on: the connection just closes (``Socket closed``), so
the dialler can only look at its own files (see `dreamp2p.transport.client.Link`).
"""

from __future__ import annotations

# (fragments of gRPC's details, lower case; the problem in words), the first match wins
_REASONS: tuple[tuple[tuple[str, ...], str], ...] = (
    (("certificate has expired",), "the peer's certificate has expired (by this host's clock)"),
    (
        ("certificate is not yet valid",),
        "the peer's certificate is not valid yet (by this host's clock: check the clocks of both hosts)",
    ),
    (
        (
            "unable to get local issuer certificate",
            "unable to get issuer certificate",
            "unable to verify the first certificate",
            "self signed certificate",
            "self-signed certificate",
            "certificate signature failure",
        ),
        "the peer's certificate is not signed by a CA in this node's ca_file (unknown CA)",
    ),
    (
        ("hostname verification check failed", "hostname/ip doesn't match", "hostname mismatch"),
        "the peer's certificate does not name the address dialled (name mismatch: dial a name or IP address it "
        "lists, set tls.server_name_override, or reissue it with that name)",
    ),
    (("tlsv1 alert unknown ca", "alert_unknown_ca"), "the peer does not trust this node's certificate (unknown CA)"),
    (
        ("sslv3 alert certificate expired", "alert_certificate_expired"),
        "the peer says this node's certificate has expired",
    ),
    (("alert bad certificate", "alert_bad_certificate"), "the peer refused this node's certificate"),
    (("wrong_version_number", "wrong version number"), "the peer does not speak TLS (a server without tls?)"),
    (("certificate_verify_failed",), "the peer's certificate failed verification"),
)


def tls_failure(details: str | None) -> str | None:
    """The certificate problem a failed call's gRPC details name, in words; None when they name none."""
    text = (details or "").lower()
    for fragments, problem in _REASONS:
        if any(f in text for f in fragments):
            return problem
    return None


def closed_in_handshake(details: str | None) -> bool:
    """Whether the connection closed before any answer, how a TLS server refuses a client's certificate."""
    return "socket closed" in (details or "").lower()
