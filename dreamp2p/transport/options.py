"""The one factory for gRPC channel/server options and credentials, so both ends agree on limits."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import grpc

from dreamp2p.config import TLSConfig, TransportConfig
from dreamp2p.config.certs import tls_file_problems


def _common(cfg: TransportConfig) -> list[tuple[str, Any]]:
    return [
        ("grpc.max_send_message_length", cfg.max_message_bytes),
        ("grpc.max_receive_message_length", cfg.max_message_bytes),
        ("grpc.keepalive_time_ms", int(cfg.keepalive_time_s * 1000)),
        ("grpc.keepalive_timeout_ms", int(cfg.keepalive_timeout_s * 1000)),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        # HTTP/2 windows grow with the measured bandwidth-delay product (on by default; stated for intent).
        ("grpc.http2.bdp_probe", 1),
    ]


def max_reconnect_backoff_ms(cfg: TransportConfig) -> int:
    """The longest wait between two connection attempts to an unreachable peer: one heartbeat interval
    (at least 0.5 s, at most 5 s; 5 s with heartbeats off)."""
    if cfg.heartbeat_s <= 0:
        return 5000
    return int(min(5.0, max(0.5, cfg.heartbeat_s)) * 1000)


def channel_options(cfg: TransportConfig, tls: TLSConfig | None = None) -> list[tuple[str, Any]]:
    opts = _common(cfg)
    # A separate TCP connection per channel: parallel streams per link only help across connections.
    opts.append(("grpc.use_local_subchannel_pool", 1))
    opts.append(("grpc.enable_retries", 0))
    # A restarted peer or a healed link should be found again within a heartbeat, not after the backoff
    # grown while it was gone: until our own echo gets through, we keep the member out of our rounds
    # while it, reaching us sooner, counts us in its own (asymmetric views, rounds failing on both).
    opts.append(("grpc.initial_reconnect_backoff_ms", 500))
    opts.append(("grpc.min_reconnect_backoff_ms", 500))
    opts.append(("grpc.max_reconnect_backoff_ms", max_reconnect_backoff_ms(cfg)))
    if tls is not None and tls.server_name_override:
        opts.append(("grpc.ssl_target_name_override", tls.server_name_override))
    return opts


def server_options(cfg: TransportConfig) -> list[tuple[str, Any]]:
    opts = _common(cfg)
    opts += [
        ("grpc.max_concurrent_streams", cfg.max_concurrent_streams),
        ("grpc.http2.min_ping_interval_without_data_ms", int(cfg.keepalive_time_s * 500)),
        ("grpc.so_reuseport", 0),
    ]
    return opts


def _read(path: str | None) -> bytes | None:
    return Path(path).read_bytes() if path else None


def server_credentials(tls: TLSConfig) -> grpc.ServerCredentials:
    """The server's TLS credentials; ValueError naming each problem of its files (`dreamp2p.config.certs`): with
    an expired certificate, say, every member would refuse every connection, saying so only in its own log."""
    problems = tls_file_problems(tls)
    if problems:
        raise ValueError(f"{'; '.join(problems)}: other members would refuse this node's TLS connections")
    key = Path(tls.key_file).read_bytes()
    cert = Path(tls.cert_file).read_bytes()
    return grpc.ssl_server_credentials(
        [(key, cert)], root_certificates=_read(tls.ca_file), require_client_auth=tls.mutual
    )


def channel_credentials(tls: TLSConfig) -> grpc.ChannelCredentials:
    if tls.mutual:
        return grpc.ssl_channel_credentials(
            root_certificates=_read(tls.ca_file),
            private_key=Path(tls.key_file).read_bytes(),
            certificate_chain=Path(tls.cert_file).read_bytes(),
        )
    return grpc.ssl_channel_credentials(root_certificates=_read(tls.ca_file))
