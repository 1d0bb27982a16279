"""`dreamp2p node` (one region's daemon) and `dreamp2p health` (a probe of a node's health listener)."""

from __future__ import annotations

import argparse
import asyncio
import faulthandler
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any, NoReturn

from dreamp2p.cli.args import address_with_port, int_at_least, positive_float
from dreamp2p.config.daemon import LOG_FORMATS

# the services a node's health listener answers for (transport.health, held equal by a test; not imported
# here, so that the console script starts without loading gRPC)
HEALTH_SERVICES = ("", "dreamp2p.v1.Peer")


def _node(args: argparse.Namespace) -> int:
    from dreamp2p.config import DaemonConfig

    cfg = DaemonConfig.from_toml(args.config)  # before torch loads: a bad file fails in a fraction of a second

    from dreamp2p.service.daemon import StopFlag, run_node
    from dreamp2p.service.logsetup import configure_logging

    # a node logs at INFO (progress lines, lifecycle events) unless -vv asks for DEBUG
    log_format = args.log_format or ("json" if cfg.metrics.json_format else "text")
    level = logging.DEBUG if args.verbose >= 2 else logging.INFO
    configure_logging(level, log_format, cfg.node.node_id, cfg.node.cluster_id)
    args.log_errors = True  # from here on an error goes to the node's log, with its traceback
    # a fatal signal (a native abort or crash) leaves every thread's Python stack in the node's log
    faulthandler.enable()
    stop = StopFlag()
    stop.install()
    summary = run_node(
        cfg, resume=args.resume, stop=stop, stop_at_file=args.stop_at_file, join=args.join, quiet_steps=args.quiet_steps
    )
    print(json.dumps(summary))
    # The run is over and saved (checkpoint, metrics, summary): leave without interpreter teardown, so
    # that third-party daemon threads still alive then (gRPC's aio poller, torch's pools) cannot turn a
    # clean run into a crash at exit (CI once saw a node exit -6 at the end of a run; cause not found).
    exit_now(0)


def _health(args: argparse.Namespace) -> int:
    from dreamp2p.transport.health import check_health

    status = asyncio.run(check_health(args.address, args.service, args.timeout))
    print(status)
    return 0 if status == "SERVING" else 1


def exit_now(code: int) -> NoReturn:
    """Flush and leave at once, without interpreter teardown (see `_node`): a node's way out, also on error."""
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(code)


def add_node_parser(sub: Any) -> None:
    n = sub.add_parser("node", help="run one region's daemon (trainer + peer) from a TOML config")
    n.add_argument("--config", required=True, help="path to the node's TOML file (see nodes/)")
    n.add_argument(
        "--log-format",
        choices=LOG_FORMATS,
        default=None,
        help="log lines as text, or one JSON object per line (default: [metrics] log_format, text)",
    )
    n.add_argument(
        "--resume",
        action="store_true",
        help="continue from the newest checkpoint (or join the members if they trained on without this node)",
    )
    n.add_argument(
        "--join",
        action="store_true",
        help="join a running cluster (new node, or restarted after a crash): take state and step from live peers",
    )
    n.add_argument(
        "--stop-at-file",
        type=Path,
        default=None,
        help="file that may hold a step number: stop cleanly after it (used to end multi-node runs)",
    )
    n.add_argument(
        "--quiet-steps",
        type=int_at_least(0),
        default=0,
        help="run the last N steps before the stop step at learning rate 0: only averaging moves the "
        "parameters, so every member ends with the same ones (a check for tests and benchmarks)",
    )
    n.set_defaults(func=_node)


def add_health_parser(sub: Any) -> None:
    h = sub.add_parser("health", help="ask a node's health listener (grpc.health.v1); exit 0 only when SERVING")
    h.add_argument("address", type=address_with_port, help="HOST:PORT of the node's health_listen")
    h.add_argument(
        "--service",
        choices=HEALTH_SERVICES,
        default="",
        help="service name ('' = the whole node, or dreamp2p.v1.Peer)",
    )
    h.add_argument("--timeout", type=positive_float, default=5.0, help="seconds to wait for the answer")
    h.set_defaults(func=_health)
