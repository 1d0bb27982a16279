"""`dreamp2p status`: a peer's live status (ring, links, counters, plan), once or every few seconds, as text
or one JSON object per answer. With ``--config`` the token, TLS and address come from the node's TOML file.
Asked at local rank 0 of a region of many ranks, it also asks every other rank's peer (rank 0's port + k):
the region's ranks, each one's shard ring and links, and the plan.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import functools
import json
import sys
import time
from pathlib import Path
from typing import Any

from dreamp2p.cli.args import address_with_port, int_at_least, positive_float
from dreamp2p.config import DaemonConfig, PeerConfig, TLSConfig
from dreamp2p.errors import PeerError
from dreamp2p.messages import PeerStatus

# hosts a server listens on to take every interface; a status client on the same host dials loopback instead
_WILDCARDS = {"0.0.0.0": "127.0.0.1", "[::]": "[::1]", "::": "[::1]", "": "127.0.0.1"}


@dataclasses.dataclass(frozen=True)
class Target:
    """Where and how to ask: the peer's address, the cluster token, and TLS (None: plaintext)."""

    address: str
    token: str | None
    tls: TLSConfig | None


def dial_address(cfg: PeerConfig) -> str:
    """The address a status client on the node's host dials: ``advertise``, else ``listen`` with a wildcard
    host (all interfaces) read as loopback."""
    if cfg.advertise:
        return cfg.advertise
    host, sep, port = cfg.listen.rpartition(":")
    if not sep:
        return cfg.listen
    return f"{_WILDCARDS.get(host, host)}:{port}"


def resolve_target(args: argparse.Namespace) -> Target:
    """The flags, over what ``--config`` gives (a flag given on the command line wins)."""
    node = DaemonConfig.from_toml(args.config).node if args.config is not None else None
    address = args.address or (dial_address(node) if node else None)
    if address is None:
        raise ValueError("give the peer's HOST:PORT, or --config FILE of a node")
    token = args.token if args.token is not None else node.token if node else None
    tls = node.tls if node else None
    if args.ca or args.cert:
        tls = TLSConfig(
            cert_file=args.cert or "",
            key_file=args.key or "",
            ca_file=args.ca,
            mutual=bool(args.cert),
            server_name_override=args.server_name,
        )
    elif tls is not None and args.server_name:
        tls = dataclasses.replace(tls, server_name_override=args.server_name)
    return Target(address_with_port(address), token, tls)


# another local rank of a region: its status, or why it gave none
RankAnswer = tuple[int, PeerStatus | str]


def status_json(st: PeerStatus, now: float, ranks: list[RankAnswer] | None = None) -> str:
    """One status as a JSON object on one line, with the time it was read (``t``, Unix seconds); for local
    rank 0 of a region, ``region_ranks_status`` lists the other ranks' (or ``error``)."""
    out = {"t": round(now, 3), **dataclasses.asdict(st)}
    if ranks:
        out["region_ranks_status"] = [
            {"rank": k, **dataclasses.asdict(a)} if isinstance(a, PeerStatus) else {"rank": k, "error": a}
            for k, a in ranks
        ]
    return json.dumps(out, default=str)


def region_text(ranks: list[RankAnswer]) -> str:
    """The other local ranks of a region, each with its shard ring and shard links."""
    blocks = []
    for k, answer in ranks:
        if isinstance(answer, PeerStatus):
            body = "\n".join(f"  {line}" for line in status_text(answer).splitlines())
            blocks.append(f"region rank {k}:\n{body}")
        else:
            blocks.append(f"region rank {k}: no answer ({answer})")
    return "\n".join(blocks)


def status_text(st: PeerStatus) -> str:
    """One status as lines for people."""
    lines = [
        f"node {st.node_id}  cluster {st.cluster_id}  protocol v{st.protocol_version}  up {st.uptime_s:.0f}s",
        f"ring: {' -> '.join(st.ring) or '(none)'}",
        f"rounds: {st.rounds_completed} completed, {st.rounds_failed} failed; frames rejected: {st.frames_rejected}",
    ]
    if st.training is not None:
        tr = st.training
        lines.append(
            f"training: {tr.strategy} at step {tr.step}; plan v{tr.plan_version} since step {tr.plan_effective_step}"
        )
        lines += [f"  {line}" for line in tr.plan_summary.splitlines()]
        if tr.region_ranks > 1:
            lines.append(
                f"region: local rank {tr.region_rank} of {tr.region_ranks}; this peer carries shard "
                f"{tr.region_rank} of every sync over the ring above (rank k listens on rank 0's port + k)"
            )
    for link in st.links:
        lines.append(
            f"  link -> {link.peer:<12} rtt {link.rtt_s * 1e3:7.2f} ms"
            f"  goodput {link.goodput_Bps * 8 / 1e6:9.1f} Mbit/s"
            f"  sent {link.bytes_sent / 1e6:9.1f} MB  recv {link.bytes_received / 1e6:9.1f} MB"
            f"  chunk {link.chunk_bytes}"
        )
    return "\n".join(lines)


async def _region_ranks(target: Target, st: PeerStatus) -> list[RankAnswer]:
    """Local rank 0 of a region: ask every other rank's peer (rank 0's port + k) for its status."""
    tr = st.training
    if tr is None or tr.region_ranks < 2 or tr.region_rank != 0:
        return []
    from dreamp2p.config import PeerInfo, TransportConfig
    from dreamp2p.sync.comm.shards import shift_port
    from dreamp2p.transport.client import Link

    out: list[RankAnswer] = []
    for k in range(1, tr.region_ranks):
        address = shift_port(target.address, k)
        link = Link("status-cli", PeerInfo("?", address), TransportConfig(streams_per_link=1), target.tls, target.token)
        try:
            out.append((k, await link.status()))
        except PeerError as exc:
            out.append((k, f"{address}: {exc}"))
        finally:
            await link.close()
    return out


async def _poll(args: argparse.Namespace, target: Target) -> int:
    """Ask once, or every ``--watch`` seconds (``--count`` times, or until interrupted) over one link."""
    from dreamp2p.config import PeerInfo, TransportConfig
    from dreamp2p.transport.client import Link

    link = Link(
        "status-cli", PeerInfo("?", target.address), TransportConfig(streams_per_link=1), target.tls, target.token
    )
    answers, code = 0, 0
    try:
        while True:
            try:
                st = await link.status()
            except PeerError as exc:
                if args.watch is None:
                    raise
                # a node that restarts is unreachable for a while: say so and keep watching
                print(f"dreamp2p status: {exc}", file=sys.stderr, flush=True)
                code = 1
            else:
                ranks = await _region_ranks(target, st)
                if args.json:
                    print(status_json(st, time.time(), ranks), flush=True)
                else:
                    header = f"== {time.strftime('%Y-%m-%d %H:%M:%S')} ==\n" if args.watch is not None else ""
                    text = status_text(st) + ("\n" + region_text(ranks) if ranks else "")
                    print(header + text, flush=True)
                code = 0
            answers += 1
            if args.watch is None or (args.count is not None and answers >= args.count):
                return code
            await asyncio.sleep(args.watch)
    finally:
        await link.close()


def run_status(args: argparse.Namespace) -> int:
    target = resolve_target(args)
    try:
        return asyncio.run(_poll(args, target))
    except KeyboardInterrupt:  # Ctrl-C ends a --watch: the usual way out, not an error
        return 0


def _check(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.address is None and args.config is None:
        parser.error("give the peer's HOST:PORT, or --config FILE of a node")
    if args.count is not None and args.watch is None:
        parser.error("--count needs --watch SECONDS")


def add_status_parser(sub: Any) -> None:
    s = sub.add_parser("status", help="live status of a peer: ring, links, counters, plan")
    s.add_argument(
        "address",
        nargs="?",
        type=address_with_port,
        default=None,
        help="HOST:PORT of the peer (a port is required: no default is assumed); with --config, the node's own "
        "advertise address, else its listen address (all interfaces: loopback)",
    )
    s.add_argument(
        "--config", type=Path, default=None, help="the node's TOML file: its token and TLS (and address) are used"
    )
    s.add_argument("--token", default=None, help="shared cluster token, if the peer requires one")
    s.add_argument("--ca", default=None, help="CA certificate (PEM) to verify a TLS peer")
    s.add_argument("--cert", default=None, help="client certificate (PEM) for mutual TLS")
    s.add_argument("--key", default=None, help="client key (PEM) for mutual TLS")
    s.add_argument("--server-name", default=None, help="name in the peer's certificate, when dialing an IP")
    s.add_argument("--json", action="store_true", help="print each status as one JSON object on one line")
    s.add_argument(
        "--watch",
        type=positive_float,
        default=None,
        metavar="SECONDS",
        help="ask again every SECONDS until interrupted (errors are reported and the watch goes on)",
    )
    s.add_argument("--count", type=int_at_least(1), default=None, help="with --watch: stop after N answers")
    s.set_defaults(func=run_status, check=functools.partial(_check, s))
