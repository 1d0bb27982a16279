"""The developer subcommands of `dreamp2p` (bench, demo): the entry points the console script loads.

cli/ finds them through the ``dreamp2p.commands`` entry-point group (pyproject.toml) rather than
importing this package, so the console script stays below devtools in the layering. Importing this module
is cheap: `bench`'s parser is `benchargs` (one sub-parser per benchmark), its handlers `benchrun`, and each
handler imports its benchmark, or the demo, only when it runs.
"""

from __future__ import annotations

import argparse
from typing import Any

from dreamp2p.cli.args import duration, link_rate
from dreamp2p.config.codecs import PARAMETER_CODECS
from dreamp2p.config.sync import STRATEGIES
from dreamp2p.devtools.benchargs import add_bench_parser

__all__ = ["add_bench_parser", "add_demo_parser"]


def _demo(args: argparse.Namespace) -> int:
    from dreamp2p.devtools.demo import run_demo

    return run_demo(
        nodes=args.nodes,
        link=args.link,
        rtt=args.rtt,
        minutes=args.minutes,
        codec=args.codec,
        strategy=args.strategy,
        out=args.out,
        device=args.device,
    )


def add_demo_parser(sub: Any) -> None:
    d = sub.add_parser("demo", help="train across N local node daemons over emulated WAN links, then report")
    d.add_argument("--nodes", type=int, default=3)
    d.add_argument("--link", type=link_rate, default="20mbit", help="emulated link rate per hop")
    d.add_argument("--rtt", type=duration, default="80ms", help="emulated round-trip time per hop")
    d.add_argument("--minutes", type=float, default=3.0, help="training time before a clean stop")
    # the demo's codec averages parameters, which a sparse codec (topk) would zero: [sync] refuses it
    d.add_argument("--codec", type=str.lower, choices=PARAMETER_CODECS, default="int8")
    d.add_argument("--strategy", choices=STRATEGIES, default="dreamddp")
    d.add_argument("--out", default=None, help="run folder (default runs/demo-TIMESTAMP)")
    d.add_argument(
        "--device", default="auto", choices=["auto", "cpu", "cuda"], help="where the daemons train (auto: CUDA if any)"
    )
    d.set_defaults(func=_demo)
