"""What is wrong with a TLS configuration's PEM files, found without the network.

Three checks, in the words an operator acts on: a certificate outside its validity dates (expired, or not
valid yet), a key that does not belong to its certificate, and a certificate the CA file does not vouch for
(an in-memory TLS handshake, stdlib :mod:`ssl` only, with the CA file as the trust store). `dreamp2p config
check` reports what these find, and a peer refuses to start its TLS server with such files: the other members
would refuse every connection and name the problem only in their own logs. A file that cannot be read here
is left unchecked: config check may run on another host, or as a user who may not read the key.
"""

from __future__ import annotations

import datetime
import re
import ssl
from dataclasses import dataclass
from pathlib import Path

from dreamp2p.config.peer import TLSConfig

_PEM_CERT = re.compile(r"-----BEGIN CERTIFICATE-----.+?-----END CERTIFICATE-----", re.DOTALL)
_TIME_FORMAT = "%Y-%m-%d %H:%M:%S UTC"
# OpenSSL's X509_V_ERR_CERT_NOT_YET_VALID and X509_V_ERR_CERT_HAS_EXPIRED: the dates, which the date check names
_DATE_ERRORS = (9, 10)
# the rounds an in-memory handshake takes at most (TLS 1.3: three flights; a few more for TLS 1.2)
_HANDSHAKE_ROUNDS = 8


@dataclass(frozen=True)
class Validity:
    """When one certificate is valid (both ends included), in UTC."""

    not_before: datetime.datetime
    not_after: datetime.datetime

    def problem(self, now: datetime.datetime) -> str | None:
        """Why the certificate is not valid at ``now``, or None."""
        if now > self.not_after:
            return f"expired on {self.not_after.strftime(_TIME_FORMAT)}"
        if now < self.not_before:
            return (
                f"is not valid before {self.not_before.strftime(_TIME_FORMAT)} "
                f"(this host's clock says {now.strftime(_TIME_FORMAT)})"
            )
        return None


def tls_file_problems(tls: TLSConfig, where: str = "tls", now: datetime.datetime | None = None) -> list[str]:
    """Every problem of ``tls``'s certificate, key and CA files, each naming its key (``where``.cert_file, ...);
    empty when none is found. ``now`` (UTC) defaults to the current time."""
    now = now or datetime.datetime.now(datetime.UTC)
    problems: list[str] = []
    dated = False  # a date problem was named: the handshake's own words for it are not repeated
    unreadable = False  # a file that is no certificate: the key and CA checks would only repeat it
    for key, path in (("cert_file", tls.cert_file), ("ca_file", tls.ca_file)):
        if not path:
            continue
        pem = _read_text(path)
        if pem is None:
            continue
        certs = _PEM_CERT.findall(pem)
        if not certs:
            problems.append(f"{where}.{key} {path}: no PEM certificate in it")
            unreadable = True
            continue
        for i, cert in enumerate(certs):
            which = "the certificate" if len(certs) == 1 else f"certificate {i + 1} of {len(certs)}"
            try:
                problem = validity(ssl.PEM_cert_to_DER_cert(cert)).problem(now)
            except ValueError as exc:
                problems.append(f"{where}.{key} {path}: {which} cannot be read ({exc})")
                unreadable = True
                continue
            if problem is not None:
                problems.append(f"{where}.{key} {path}: {which} {problem}")
                dated = True
    if unreadable:
        return problems
    server = _server_context(tls, where, problems)
    if server is None or not tls.ca_file or _read_text(tls.ca_file) is None:
        return problems
    refused = _verify(server, tls.ca_file)
    if refused is not None and not (dated and refused.verify_code in _DATE_ERRORS):
        problems.append(
            f"{where}.cert_file {tls.cert_file}: not signed by the CA in {where}.ca_file {tls.ca_file} "
            f"({refused.verify_message})"
        )
    return problems


def validity(der: bytes) -> Validity:
    """The validity dates of one DER-encoded X.509 certificate (RFC 5280: tbsCertificate's fifth or sixth
    element); ValueError when it is not one."""
    _, body, _ = _element(der, 0, 0x30)  # Certificate
    _, pos, _ = _element(der, body, 0x30)  # tbsCertificate
    tag, _, end = _element(der, pos)
    if tag == 0xA0:  # [0] version, absent in v1 certificates
        pos = end
    for _ in range(3):  # serialNumber, signature, issuer
        _, _, pos = _element(der, pos)
    _, dates, _ = _element(der, pos, 0x30)  # validity
    tag, start, end = _element(der, dates)
    not_before = _time(tag, der[start:end])
    tag, start, end = _element(der, end)
    return Validity(not_before, _time(tag, der[start:end]))


def _element(der: bytes, pos: int, want: int | None = None) -> tuple[int, int, int]:
    """(tag, content start, content end) of the DER element at ``pos``; ValueError on anything unexpected."""
    if pos + 2 > len(der):
        raise ValueError("truncated DER")
    tag, length = der[pos], der[pos + 1]
    if want is not None and tag != want:
        raise ValueError(f"DER tag {tag:#04x} where {want:#04x} was expected")
    start = pos + 2
    if length & 0x80:
        size = length & 0x7F
        if not 1 <= size <= 4:
            raise ValueError("unsupported DER length")
        length = int.from_bytes(der[start : start + size], "big")
        start += size
    if start + length > len(der):
        raise ValueError("truncated DER")
    return tag, start, start + length


def _time(tag: int, raw: bytes) -> datetime.datetime:
    """An X.509 Time: UTCTime (YYMMDDHHMMSSZ, 1950-2049) or GeneralizedTime (YYYYMMDDHHMMSSZ)."""
    text = raw.decode("ascii", "replace")
    if tag == 0x17 and len(text) == 13:
        century = "19" if int(text[:2]) >= 50 else "20"
        text = century + text
    elif tag != 0x18 or len(text) != 15:
        raise ValueError(f"unsupported certificate time {text!r}")
    return datetime.datetime.strptime(text, "%Y%m%d%H%M%SZ").replace(tzinfo=datetime.UTC)


def _read_text(path: str) -> str | None:
    try:
        return Path(path).read_text(encoding="ascii", errors="replace")
    except OSError:
        return None


def _no_password() -> bytes:
    """An encrypted key is refused rather than asked for on the terminal (gRPC cannot read one either)."""
    return b""


def _server_context(tls: TLSConfig, where: str, problems: list[str]) -> ssl.SSLContext | None:
    """A server context holding the certificate and key, or None (the reason appended to ``problems``; an
    unreadable key file is left unchecked)."""
    if not tls.cert_file or not tls.key_file or _read_text(tls.key_file) is None:
        return None
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_cert_chain(tls.cert_file, tls.key_file, password=_no_password)
    except ssl.SSLError as exc:
        if "KEY_VALUES_MISMATCH" in str(exc):
            why = f"does not match the certificate in {where}.cert_file {tls.cert_file}"
        else:
            why = f"cannot be used with {where}.cert_file: {exc.reason or exc} (an unencrypted PEM key is needed)"
        problems.append(f"{where}.key_file {tls.key_file}: {why}")
        return None
    except OSError:
        return None
    return context


def _verify(server: ssl.SSLContext, ca_file: str) -> ssl.SSLCertVerificationError | None:
    """How a client trusting only ``ca_file`` refuses ``server``'s certificate, or None if it accepts it.

    The two ends run a TLS handshake through memory buffers; the host name is not checked (the name a
    certificate must carry depends on the address a peer dials, which config check cannot know).
    """
    client = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    client.check_hostname = False
    try:
        client.load_verify_locations(ca_file)
    except (ssl.SSLError, OSError):
        return None  # no usable CA certificate: reported by the date check (no PEM certificate in it)
    to_server, to_client = ssl.MemoryBIO(), ssl.MemoryBIO()
    ends = (
        client.wrap_bio(to_client, to_server, server_side=False),
        server.wrap_bio(to_server, to_client, server_side=True),
    )
    for _ in range(_HANDSHAKE_ROUNDS):
        finished = 0
        for end in ends:
            try:
                end.do_handshake()
                finished += 1
            except ssl.SSLWantReadError:
                pass
            except ssl.SSLCertVerificationError as exc:
                return exc
            except ssl.SSLError:
                return None  # the server end saw the client give up, or something unrelated to trust
        if finished == len(ends):
            return None
    return None
