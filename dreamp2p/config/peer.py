"""Frozen configuration types for a peer and its transport, loaded from TOML or dicts.

Every loader names the offending key and what it accepts; nothing here touches the network.
"""

from __future__ import annotations

import hashlib
import ipaddress
import os
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dreamp2p.config.codecs import PARAMETER_CODECS
from dreamp2p.config.parse import _build, one_of_message


@dataclass(frozen=True)
class TLSConfig:
    """Server TLS, optionally mutual. Paths are PEM files."""

    cert_file: str
    key_file: str
    ca_file: str | None = None  # verifies peers' certificates; required for mutual TLS
    mutual: bool = False
    server_name_override: str | None = None  # when peers are dialled by IP but certs name a host
    # with mutual TLS: the node id a caller claims (handshake, frames, votes, probes, state requests)
    # must be its certificate's CN or one of its SANs (see dreamp2p.transport.identity)
    bind_identity: bool = True

    def __post_init__(self) -> None:
        if self.mutual and not self.ca_file:
            raise ValueError("tls.mutual = true needs tls.ca_file to verify client certificates")


@dataclass(frozen=True)
class TransportConfig:
    """Knobs of the gRPC transport; defaults suit a WAN link of tens of Mbit/s to a few Gbit/s."""

    max_message_bytes: int = 64 << 20
    keepalive_time_s: float = 20.0
    keepalive_timeout_s: float = 10.0
    streams_per_link: int = 2  # data connections per link (a round's frames); one more carries control calls
    rpc_deadline_s: float = 30.0
    connect_timeout_s: float = 60.0
    round_timeout_s: float = 300.0
    chunk_min_bytes: int = 64 << 10
    chunk_max_bytes: int = 4 << 20
    outbound_queue_bytes: int = 32 << 20
    # HTTP/2 streams one client connection may have open on this server at once (grpc.max_concurrent_streams);
    # further streams wait in the client until one ends.
    max_concurrent_streams: int = 64
    # calls this server runs at once (see dreamp2p.transport.callcap): all callers together outside the
    # members' reserved slots, one connection, one member across its connections, and the slots reserved
    # for each admitted member's own connections; a call beyond a cap is refused at once with OVERSIZE.
    # Status calls are not counted (they never wait).
    max_calls: int = 256
    max_calls_per_connection: int = 32
    max_calls_per_member: int = 64
    reserved_calls_per_member: int = 16
    # a Push stream from a connection that never handshook must send its first frame within this time
    first_frame_timeout_s: float = 5.0
    # payload bytes of received frames one sender may have waiting here for their round, across all of
    # its streams; a frame beyond it is refused with OVERSIZE. Must exceed max_message_bytes.
    max_buffered_bytes_per_peer: int = 256 << 20
    zstd: bool = False
    zstd_level: int = 1
    rate_limit: float | None = None  # emulated link rate in bytes/s (token bucket at the sender)
    delay_s: float = 0.0  # emulated one-way delay per hop (netem is absent here; see transport.outbound.OutboundStream)
    probe_interval_s: float = 5.0
    # a bandwidth probe's least burst; larger where the link's estimate and RTT ask for it, up to the
    # peers' 4 MiB limit (transport.linkrate.probeburst)
    probe_burst_bytes: int = 256 << 10
    # failure detection: a member that misses this many heartbeats in a row (or is silent for
    # dead_after_s) is dropped from the ring until it answers again; 0 disables heartbeats. While this
    # node's uplink is saturated (a link still needs heartbeat_s or more of its measured goodput for the
    # round bytes handed to it) silence counts no miss: dead_after_s alone bounds it then. A refused
    # connection drops a member at once.
    heartbeat_s: float = 1.0
    heartbeat_misses: int = 3
    dead_after_s: float = 15.0
    round_retries: int = 1  # a failed round is run again this many times (it failed on every member)
    # stragglers (see dreamp2p.peer.straggler), off while straggler_margin is 0: a live member whose own
    # measured link holds completed rounds past max(straggler_floor_s, straggler_margin x its bytes at the
    # members' median link rate) for straggler_strikes rounds in a row sits out the next rounds for
    # straggler_probation_s (doubled on each relapse, up to 8x), then takes part again
    straggler_margin: float = 0.0
    straggler_floor_s: float = 5.0
    straggler_strikes: int = 2
    straggler_probation_s: float = 30.0

    def __post_init__(self) -> None:
        _positive(
            self,
            "max_message_bytes",
            "keepalive_time_s",
            "keepalive_timeout_s",
            "streams_per_link",
            "rpc_deadline_s",
            "connect_timeout_s",
            "round_timeout_s",
            "chunk_min_bytes",
            "chunk_max_bytes",
            "outbound_queue_bytes",
            "max_concurrent_streams",
            "max_calls",
            "max_calls_per_connection",
            "max_calls_per_member",
            "first_frame_timeout_s",
            "max_buffered_bytes_per_peer",
            "probe_interval_s",
            "probe_burst_bytes",
            "heartbeat_misses",
            "dead_after_s",
            "straggler_floor_s",
            "straggler_strikes",
            "straggler_probation_s",
        )
        if self.straggler_margin != 0 and self.straggler_margin < 1:
            raise ValueError(f"transport.straggler_margin must be 0 (off) or >= 1, got {self.straggler_margin}")
        if not 0 <= self.reserved_calls_per_member <= self.max_calls_per_member:
            raise ValueError(
                f"transport.reserved_calls_per_member must be in 0..max_calls_per_member "
                f"({self.max_calls_per_member}), got {self.reserved_calls_per_member}"
            )
        if self.round_retries < 0:
            raise ValueError(f"transport.round_retries must be >= 0, got {self.round_retries}")
        if self.heartbeat_s < 0:
            raise ValueError(f"transport.heartbeat_s must be >= 0 (0 disables), got {self.heartbeat_s}")
        if self.chunk_min_bytes > self.chunk_max_bytes:
            raise ValueError(
                f"transport.chunk_min_bytes ({self.chunk_min_bytes}) > chunk_max_bytes ({self.chunk_max_bytes})"
            )
        if self.chunk_max_bytes + (1 << 16) > self.max_message_bytes:
            raise ValueError("transport.chunk_max_bytes must leave 64 KiB of headroom below max_message_bytes")
        if self.max_buffered_bytes_per_peer <= self.max_message_bytes:
            raise ValueError(
                f"transport.max_buffered_bytes_per_peer ({self.max_buffered_bytes_per_peer}) must be larger than "
                f"transport.max_message_bytes ({self.max_message_bytes}), or no frame of full size could wait"
            )
        if self.delay_s < 0:
            raise ValueError(f"transport.delay_s must be >= 0, got {self.delay_s}")
        if self.rate_limit is not None and self.rate_limit <= 0:
            raise ValueError(f"transport.rate_limit must be > 0 bytes/s, got {self.rate_limit}")
        if not 1 <= self.zstd_level <= 22:
            raise ValueError(f"transport.zstd_level must be in 1..22, got {self.zstd_level}")


@dataclass(frozen=True)
class PeerInfo:
    """One member of the ring: its node id and the address its server listens on.

    ``ranks``: a region of many ranks that spans hosts lists every rank's address, in region-rank order (rank 0's
    is ``address``); without it, rank k of the region listens on ``address``'s host at its port + k
    (`dreamp2p.sync.comm.shards.rank_config`).

    ``token_sha256``: per-node tokens, the hex SHA-256 of this member's own token (`token_digest`; `dreamp2p config
    token` makes a token and its digest). Listed for every member, a caller presenting a member's token may act
    only as that member (handshake, frames, votes, probes, state requests), as mutual TLS binds ids to
    certificates; without them every member shares one token, and any holder may claim any member's id."""

    node_id: str
    address: str
    ranks: tuple[str, ...] = ()
    token_sha256: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.token_sha256, str) or (self.token_sha256 and not _SHA256.fullmatch(self.token_sha256)):
            raise ValueError(
                f"ring entry {self.node_id!r}: token_sha256 must be 64 hex digits (the SHA-256 of its token), "
                f"got {self.token_sha256!r}"
            )
        object.__setattr__(self, "token_sha256", self.token_sha256.lower())
        if isinstance(self.ranks, str) or not all(isinstance(a, str) and a for a in self.ranks):
            raise ValueError(
                f"ring entry {self.node_id!r}: ranks must be a list of host:port strings, got {self.ranks!r}"
            )
        object.__setattr__(self, "ranks", tuple(self.ranks))  # a TOML list
        if self.ranks and self.ranks[0] != self.address:
            raise ValueError(
                f"ring entry {self.node_id!r}: ranks[0] ({self.ranks[0]!r}) must be its address ({self.address!r}), "
                "the region's rank 0"
            )


_SHA256 = re.compile(r"[0-9a-fA-F]{64}")


def token_digest(token: str) -> str:
    """The hex SHA-256 a ring entry lists for a member whose token is ``token`` (per-node tokens)."""
    return hashlib.sha256(token.encode()).hexdigest()


COMM_MODES = ("thread", "process")


@dataclass(frozen=True)
class PeerConfig:
    node_id: str
    cluster_id: str = "dreamp2p"
    listen: str = "127.0.0.1:0"
    advertise: str | None = None
    ring: tuple[PeerInfo, ...] = ()
    token: str | None = None
    tls: TLSConfig | None = None
    # without tls, every address (listen, advertise, ring) must be loopback unless this is set: for private
    # networks only (a compose network, network namespaces on one host); traffic then crosses in clear text
    allow_insecure: bool = False
    codec: str = "fp32"
    manifest_hash: bytes = b""
    # our contribution is withheld (the round proceeds without it) if its norm exceeds this many times
    # its running norm; 0 disables the check. Non-finite contributions are always withheld.
    max_norm_ratio: float = 1000.0
    transport: TransportConfig = field(default_factory=TransportConfig)
    # grpc.health.v1 on a plaintext listener of its own, for probes that carry no token or certificate
    # (kubelet, grpcurl, load balancers): None serves none. It tells only SERVING or NOT_SERVING (joining,
    # shutting down, or a trainer that published no step for health_stall_s seconds).
    health_listen: str | None = None
    health_stall_s: float = 600.0
    # where the peer's event loop runs: "thread" (in the trainer's process) or "process" (a child process
    # of its own, off the trainer's GIL; see dreamp2p.sync.comm.process)
    comm: str = "thread"

    def __post_init__(self) -> None:
        if self.comm not in COMM_MODES:
            raise ValueError(one_of_message("comm", self.comm, COMM_MODES))
        if not self.health_stall_s > 0:
            raise ValueError(f"health_stall_s must be > 0, got {self.health_stall_s}")
        if not self.node_id or any(c.isspace() for c in self.node_id):
            raise ValueError(f"node_id must be a non-empty word without spaces, got {self.node_id!r}")
        if not self.cluster_id:
            raise ValueError("cluster_id must not be empty")
        if self.codec not in PARAMETER_CODECS:
            raise ValueError(one_of_message("codec", self.codec, PARAMETER_CODECS))
        ids = [p.node_id for p in self.ring]
        if len(set(ids)) != len(ids):
            raise ValueError(f"ring lists a node id twice: {ids}")
        if self.ring and self.node_id not in ids:
            raise ValueError(f"ring does not contain this node ({self.node_id!r}): {ids}")
        self._check_member_tokens()
        if self.tls is None and not self.allow_insecure:
            exposed = self.non_loopback_addresses()
            if exposed:
                raise ValueError(
                    f"no tls is configured, but {' and '.join(exposed)} {'is' if len(exposed) == 1 else 'are'} "
                    "not loopback: TLS is required outside loopback. Configure tls (cert_file, key_file, ca_file, "
                    "mutual = true; [node.tls] in a node daemon's file; deploy/tls/make-certs.sh makes them), or "
                    "set allow_insecure = true to send in clear text on a private network"
                )

    def _check_member_tokens(self) -> None:
        hashed = [p.node_id for p in self.ring if p.token_sha256]
        if not hashed:
            return
        missing = [p.node_id for p in self.ring if not p.token_sha256]
        if missing:
            raise ValueError(
                f"ring lists token_sha256 for {', '.join(hashed)} but not for {', '.join(missing)}: per-node tokens "
                "need one for every member"
            )
        seen: dict[str, str] = {}
        for p in self.ring:
            if p.token_sha256 in seen:
                raise ValueError(
                    f"ring entries {seen[p.token_sha256]!r} and {p.node_id!r} list the same token_sha256: per-node "
                    "tokens need a token of its own for each member"
                )
            seen[p.token_sha256] = p.node_id
        if not self.token:
            raise ValueError("ring lists per-node tokens (token_sha256), but this node has no token")
        own = next(p for p in self.ring if p.node_id == self.node_id)
        if token_digest(self.token) != own.token_sha256:
            raise ValueError(
                f"this node's token does not hash to its ring entry's token_sha256 ({self.node_id!r}): it would be "
                "refused by every member (`dreamp2p config token` prints a token and its digest)"
            )

    def member_tokens(self) -> dict[str, str]:
        """Per-node tokens: each member's token digest -> its node id; empty where the members share one token."""
        return {p.token_sha256: p.node_id for p in self.ring if p.token_sha256}

    def non_loopback_addresses(self) -> list[str]:
        """The addresses this config listens on, advertises or dials that leave the host, each named by key."""
        named = [("listen", self.listen)]
        if self.advertise:
            named.append(("advertise", self.advertise))
        named += [(f"ring[{i}].address", p.address) for i, p in enumerate(self.ring)]
        named += [(f"ring[{i}].ranks[{k}]", a) for i, p in enumerate(self.ring) for k, a in enumerate(p.ranks)]
        return [f"{key} {addr!r}" for key, addr in named if not is_loopback_address(addr)]

    @staticmethod
    def from_toml(path: str | Path) -> PeerConfig:
        with open(path, "rb") as fh:
            data = tomllib.load(fh)
        return PeerConfig.from_dict(data)

    @staticmethod
    def from_dict(data: Mapping[str, Any]) -> PeerConfig:
        data = dict(data)
        if "token_env" in data:
            env = data.pop("token_env")
            if env not in os.environ:
                raise ValueError(f"token_env names environment variable {env!r}, which is not set")
            data["token"] = os.environ[env]
        if "transport" in data:
            data["transport"] = _build(TransportConfig, data["transport"], "transport")
        if "tls" in data:
            data["tls"] = _build(TLSConfig, data["tls"], "tls")
        if "ring" in data:
            ring = data["ring"]
            if not isinstance(ring, list):
                raise ValueError("ring must be a list of {node_id = ..., address = ...} tables")
            data["ring"] = tuple(_build(PeerInfo, r, f"ring[{i}]") for i, r in enumerate(ring))
        if "manifest_hash" in data and isinstance(data["manifest_hash"], str):
            data["manifest_hash"] = bytes.fromhex(data["manifest_hash"])
        return _build(PeerConfig, data, "")


def is_loopback_address(address: str) -> bool:
    """Whether a gRPC address stays on this host: 127.0.0.0/8, ::1, localhost or a unix socket.

    Accepts ``host:port``, ``[v6]:port``, a bare host and the ``ipv4:``/``ipv6:``/``dns:`` schemes. A name other
    than ``localhost`` counts as not loopback (it is not resolved), and so does an empty host (all interfaces).
    """
    addr = address.strip()
    if addr.startswith(("unix:", "unix-abstract:")):
        return True
    for scheme in ("ipv4:", "ipv6:", "dns:"):
        if addr.startswith(scheme):
            addr = addr[len(scheme) :]
            if addr.startswith("//"):  # dns://authority/host:port
                addr = addr[2:].partition("/")[2]
            break
    if addr.startswith("["):
        host = addr[1:].partition("]")[0]
    elif addr.count(":") == 1:
        host = addr.partition(":")[0]
    else:
        host = addr  # a bare name, IPv4 address or unbracketed IPv6 address
    if host.lower() == "localhost":
        return True
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped.is_loopback
    return ip.is_loopback


def _positive(obj: object, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        if value <= 0:
            raise ValueError(f"transport.{name} must be > 0, got {value}")
