"""Binding the node id a caller claims to its TLS client certificate (mutual TLS).

With mutual TLS every call arrives with a certificate the cluster's CA signed. Without binding, any
member holding one could claim to be another (handshake as it, send frames or votes in its name); with
it, a claimed node id must be the certificate's common name or one of its subject alternative names.
`deploy/tls/make-certs.sh ID=HOST` issues certificates that satisfy it.
"""

from __future__ import annotations

from collections.abc import Iterable

from grpc import aio

from dreamp2p.errors import PeerError, Status

# auth_context properties gRPC fills from a verified client certificate
_NAME_PROPERTIES = ("x509_common_name", "x509_subject_alternative_name")


def names_from_auth(auth: dict[str, Iterable[bytes]]) -> frozenset[str] | None:
    """The names a certificate vouches for (CN and SANs); None when the call carried no client certificate."""
    if "x509_pem_cert" not in auth and not any(p in auth for p in _NAME_PROPERTIES):
        return None
    return frozenset(n.decode("utf-8", "replace") for p in _NAME_PROPERTIES for n in auth.get(p, ()))


def certificate_names(context: aio.ServicerContext) -> frozenset[str] | None:
    """:func:`names_from_auth` of this call's peer."""
    return names_from_auth(context.auth_context())


def identity_refusal(names: frozenset[str] | None, claimed: str, source: str = "TLS certificate") -> PeerError | None:
    """Why a caller whose certificate (or, ``source`` "token", per-node token) names ``names`` may not act as
    node ``claimed`` (None: it may).

    A call without a client certificate (``names`` None) is not this check's business: the server
    requires one whenever binding is on, so such a call never reaches it.
    """
    if names is None or claimed in names:
        return None
    shown = ", ".join(sorted(names)[:8]) or "no names"
    return PeerError(Status.IDENTITY_MISMATCH, f"claims node id {claimed!r}, but its {source} names only: {shown}")
