"""The developer subcommands of `dreamp2p` (bench, demo): their parsers, checks and handlers.

cli.py finds them through the ``dreamp2p.commands`` entry-point group (pyproject.toml) rather than
importing this package, so the console script stays below devtools in the layering. Importing this module
is cheap: each handler imports its benchmark or the demo only when it runs.
"""

from __future__ import annotations

import argparse
import functools
import json
from collections.abc import Callable
from typing import Any

from dreamp2p.cli.args import check_delay, duration, int_at_least, link_rate, open_fraction, positive_float
from dreamp2p.config.codecs import CODEC_NAMES, DENSE_CODECS
from dreamp2p.config.parse import parse_duration
from dreamp2p.config.sync import STRATEGIES

# Per-benchmark defaults of the flags the benchmarks share (None on the command line: not given).
BENCH_DEFAULTS: dict[str, dict[str, Any]] = {
    "strategies": {"steps": 150, "period": 10, "width": 512, "depth": 4, "rtt": "20ms", "rate": "100mbit"},
    "lm": {"steps": 200, "period": 20, "width": 256, "depth": 4, "rtt": "0ms", "rate": "20mbit"},
    "plancheck": {"steps": 100, "period": 20, "width": 256, "depth": 4, "rtt": "0ms", "rate": "20mbit"},
    # steps: unused (the run is timed); width/depth: the daemons' LM dim and blocks
    "chaos": {"steps": 1, "period": 5, "width": 64, "depth": 2, "rtt": "4ms", "rate": "50mbit"},
    # steps: per phase (step 0 untimed); period: only for a strategy that uses it (--strategies)
    "regions": {"steps": 12, "period": 10, "width": 256, "depth": 4, "rtt": "0ms", "rate": "20mbit"},
}
FALLBACK_DEFAULTS: dict[str, Any] = {
    "steps": 150,
    "period": 10,
    "width": 512,
    "depth": 4,
    "rtt": "20ms",
    "rate": "100mbit",
}
# transport: no emulated round trip unless asked (--rtt/--jitter/--loss switch --netns to the packet emulator)
BENCH_DEFAULTS["transport"] = {**FALLBACK_DEFAULTS, "rtt": "0ms"}


def loss_fraction(text: str) -> float:
    """An argparse type: a packet loss fraction, ``0.1%`` or ``0.001``, in [0, 1)."""
    from dreamp2p.devtools.wanmodel import parse_loss

    try:
        return parse_loss(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _bench_check(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Fill the shared flags' defaults for the chosen benchmark, then check them across options."""
    for key, value in BENCH_DEFAULTS.get(args.what, FALLBACK_DEFAULTS).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    check_delay(parser, args)
    if args.what == "chaos":
        if not 0 <= args.down[0] <= args.down[1]:
            parser.error(f"argument --down: need 0 <= MIN <= MAX, got {args.down[0]:g} {args.down[1]:g}")
        if args.peers is not None and not args.max_down < args.peers <= 8:
            parser.error(f"argument --peers: chaos needs more than --max-down ({args.max_down}) and at most 8")
    if args.what == "transport" and not args.netns and (args.loss or args.jitter or parse_duration(args.rtt)):
        parser.error("arguments --rtt/--jitter/--loss: transport emulates them only with --netns (the packet emulator)")
    if args.what == "regions" and args.strategies is not None and len(args.strategies) != 1:
        parser.error("argument --strategies: regions runs one strategy (default ssgd)")


def emit(result: dict[str, Any], as_json: bool) -> None:
    if not as_json:
        for key, value in result.items():
            print(f"{key}: {json.dumps(value)}")
    # the last line is always the JSON object, so scripts can `tail -1`
    print(json.dumps(result))


def _bench_codec(args: argparse.Namespace) -> dict[str, Any]:
    from dreamp2p.devtools.bench.codec import bench_codecs

    return bench_codecs(mbytes=args.mbytes or 64.0, repeats=args.repeats, names=args.codecs)


def _bench_transport(args: argparse.Namespace) -> dict[str, Any]:
    from dreamp2p.devtools.bench.transport import bench_transport

    return bench_transport(
        mbytes=args.mbytes or 64.0,
        seconds=args.seconds,
        streams=args.streams,
        netns=args.netns,
        rate=args.rate,
        rtt=args.rtt,
        jitter=args.jitter or "0ms",
        loss=args.loss,
    )


def _bench_allreduce(args: argparse.Namespace) -> dict[str, Any]:
    from dreamp2p.devtools.bench.allreduce import bench_allreduce

    return bench_allreduce(
        peers=args.peers or 4,
        mbytes=args.mbytes or 64.0,
        codecs=args.codecs,
        rounds=args.repeats,
        streams=args.streams,
        netns=args.netns,
        rate=args.rate,
    )


def _bench_soak(args: argparse.Namespace) -> dict[str, Any]:
    from dreamp2p.devtools.bench.soak import bench_soak

    return bench_soak(minutes=args.minutes, peers=args.peers or 4, mbytes=args.mbytes or 4.0)


def _bench_strategies(args: argparse.Namespace) -> dict[str, Any]:
    from dreamp2p.devtools.bench.strategies import bench_strategies

    return bench_strategies(
        strategies=args.strategies,
        steps=args.steps,
        period=args.period,
        width=args.width,
        depth=args.depth,
        batch=args.batch,
        rate=args.link_rate,
        rtt=args.rtt,
        max_delay=args.max_delay,
        codec=args.codecs[0] if args.codecs else "fp32",
        device=args.device,
        lr=args.lr,
    )


def _bench_lm(args: argparse.Namespace) -> dict[str, Any]:
    from dreamp2p.config import parse_duration
    from dreamp2p.devtools.bench.lm import bench_lm

    extra = {"max_delay": args.max_delay} if args.max_delay is not None else {}
    return bench_lm(
        strategies=args.strategies,
        regions=args.regions,
        rate=args.rate,
        rtt_ms=parse_duration(args.rtt) * 1e3,
        steps=args.steps,
        period=args.period,
        width=args.width,
        layers=args.depth,
        device=args.device,
        extra_sync=extra,
        bracket=args.bracket,
        rounds=args.rounds,
    )


def _bench_regions(args: argparse.Namespace) -> dict[str, Any]:
    from dreamp2p.config import parse_duration
    from dreamp2p.devtools.bench.regions import bench_regions

    strategy = args.strategies[0] if args.strategies else "ssgd"
    extra: dict[str, Any] = {"period": args.period} if strategy != "ssgd" else {}
    if args.max_delay is not None:
        extra["max_delay"] = args.max_delay
    return bench_regions(
        regions=args.regions,
        ranks=args.ranks,
        rate=args.rate,
        strategy=strategy,
        steps=args.steps,
        width=args.width,
        layers=args.depth,
        rtt_ms=parse_duration(args.rtt) * 1e3,
        extra_sync=extra,
    )


def _bench_plancheck(args: argparse.Namespace) -> dict[str, Any]:
    from dreamp2p.devtools.bench.plancheck import bench_plancheck

    result = bench_plancheck(
        sizes=args.sizes,
        rates=args.rates,
        rtts=args.rtts,
        regions=args.region_counts,
        steps=args.steps,
        period=args.period,
        out=args.out,
        reports=args.reports or (),
        target_cu=args.target_cu,
    )
    if not args.json and "table" in result:
        print(result["table"])
    return result


def _bench_digits(args: argparse.Namespace) -> dict[str, Any]:
    from dreamp2p.devtools.bench.digits import bench_digits

    knobs = {"max_delay": args.max_delay} if args.max_delay is not None else {}
    return bench_digits(
        strategies=args.strategies or ("ssgd", "dreamddp", "diloco"),
        peers=args.peers or 3,
        **knobs,
    )


def _bench_chaos(args: argparse.Namespace) -> dict[str, Any]:
    from dreamp2p.devtools.bench.chaos import ChaosRun, bench_chaos
    from dreamp2p.devtools.bench.chaosplan import ChaosTiming
    from dreamp2p.devtools.localrun import NAMES

    timing = ChaosTiming(
        kill_every_s=args.kill_every,
        down_min_s=args.down[0],
        down_max_s=args.down[1],
        max_down=args.max_down,
        protected=frozenset({NAMES[0]}),
    )
    return bench_chaos(
        ChaosRun(
            minutes=args.minutes,
            nodes=args.peers or 5,
            timing=timing,
            flaps=not args.no_flaps,
            flap_every_s=args.flap_every,
            flap_down_s=args.flap_down,
            rate=args.rate,
            rtt=args.rtt,
            period=args.period,
            max_delay=args.max_delay,
            dim=args.width,
            layers=args.depth,
            seed=args.seed,
            run_dir=args.run_dir,
        )
    )


_BENCHES: dict[str, Callable[[argparse.Namespace], dict[str, Any]]] = {
    "codec": _bench_codec,
    "transport": _bench_transport,
    "allreduce": _bench_allreduce,
    "soak": _bench_soak,
    "strategies": _bench_strategies,
    "lm": _bench_lm,
    "plancheck": _bench_plancheck,
    "digits": _bench_digits,
    "chaos": _bench_chaos,
    "regions": _bench_regions,
}


def _bench(args: argparse.Namespace) -> int:
    result = _BENCHES[args.what](args)  # argparse restricts the choices to these names
    emit(result, args.json)
    return 0


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


def add_bench_parser(sub: Any) -> None:
    b = sub.add_parser("bench", help="benchmarks; the last line printed is a JSON object")
    b.add_argument(
        "what",
        choices=list(_BENCHES),
    )
    b.add_argument("--json", action="store_true", help="print only the JSON result line")
    b.add_argument("--mbytes", type=float, default=None, help="buffer size in MB (default 64)")
    b.add_argument("--repeats", type=int, default=3, help="measured repetitions (median)")
    b.add_argument(
        "--codecs",
        nargs="+",
        type=str.lower,
        choices=CODEC_NAMES,
        default=None,
        help="codecs to measure (default: all)",
    )
    b.add_argument(
        "--peers", type=int, default=None, help="peer processes (allreduce, soak: 4; digits: 3; chaos: 5 daemons)"
    )
    b.add_argument("--seconds", type=float, default=6.0, help="transport: measuring time")
    b.add_argument("--streams", type=int, default=2, help="parallel streams (TCP connections) per link")
    b.add_argument("--netns", action="store_true", help="transport, allreduce: run across tbf-shaped namespaces (root)")
    b.add_argument(
        "--rate",
        type=link_rate,
        default=None,
        help="link rate, e.g. 20mbit (transport, allreduce --netns: 100mbit; lm: 20mbit)",
    )
    b.add_argument("--regions", type=int_at_least(1), default=2, help="lm: regions (one process each); regions: 2")
    b.add_argument("--ranks", type=int_at_least(2), default=2, help="regions: local ranks per region (2)")
    b.add_argument(
        "--minutes", type=float, default=10.0, help="soak: how long to run; chaos: each of its two timed phases"
    )
    b.add_argument(
        "--strategies",
        nargs="+",
        default=None,
        help="which to run (default: all); lm also takes variants, e.g. dreamddp:error_feedback=true",
    )
    b.add_argument(
        "--steps", type=int_at_least(1), default=None, help="training steps per run (strategies 150, lm 200)"
    )
    b.add_argument("--period", type=int_at_least(1), default=None, help="period H (strategies 10, lm 20)")
    b.add_argument("--width", type=int_at_least(1), default=None, help="model width (strategies: MLP 512, lm: 256)")
    b.add_argument("--depth", type=int_at_least(1), default=None, help="hidden layers / transformer blocks (4)")
    b.add_argument("--batch", type=int, default=4096, help="strategies: batch size per peer (4096: ~0.16 s CPU steps)")
    b.add_argument(
        "--link-rate", type=link_rate, default=None, help="strategies: link rate (default: full sync = H/2 steps)"
    )
    b.add_argument(
        "--rtt",
        type=duration,
        default=None,
        help="emulated round-trip time per hop (strategies 20ms, lm 0ms; transport --netns: packet emulator, 0ms)",
    )
    b.add_argument(
        "--jitter", type=duration, default=None, help="transport --netns: sd of each packet's one-way delay (0ms)"
    )
    b.add_argument(
        "--loss", type=loss_fraction, default=0.0, help="transport --netns: packet loss per direction, e.g. 0.1%%"
    )
    b.add_argument(
        "--max-delay", type=int_at_least(0), default=None, help="strategies: DreamDDP max landing delay d (H-1)"
    )
    b.add_argument("--lr", type=float, default=0.05, help="strategies: SGD learning rate (wide models want less)")
    b.add_argument(
        "--device", default="cpu", choices=["cpu", "cuda"], help="strategies: where the trainers run (both peers)"
    )
    b.add_argument(
        "--bracket",
        action="store_true",
        help="lm: the ceiling again after every strategy; utilization against the two around it",
    )
    b.add_argument(
        "--rounds",
        type=int_at_least(1),
        default=1,
        help="lm: every strategy this many times, order rotated each round; means and paired 95%% intervals",
    )
    _add_plancheck_parser(b)
    _add_chaos_parser(b)
    b.set_defaults(func=_bench, check=functools.partial(_bench_check, b))


def _add_plancheck_parser(b: argparse.ArgumentParser) -> None:
    """`bench plancheck`'s own flags: the grid of `bench lm` runs that `dreamp2p plan` is checked against."""
    g = b.add_argument_group("plancheck (dreamp2p plan against bench lm; --steps 100, --period 20)")
    g.add_argument(
        "--sizes", nargs="+", default=["small", "large"], choices=["small", "large", "tiny"], help="d256x4, d384x6"
    )
    g.add_argument(
        "--rates", nargs="+", type=link_rate, default=["10mbit", "20mbit", "100mbit"], help="link rates of the grid"
    )
    g.add_argument("--rtts", nargs="+", type=duration, default=["0ms", "80ms"], help="RTTs of the grid")
    g.add_argument("--region-counts", nargs="+", type=int_at_least(2), default=[2, 3], help="region counts of the grid")
    g.add_argument("--target-cu", type=open_fraction, default=None, help="check plan --target-cu's recommendation")
    g.add_argument("--out", default=None, help="append each finished point to this JSON-lines file")
    g.add_argument("--reports", nargs="+", default=None, help="saved bench lm reports to compare instead of running")


def _add_chaos_parser(b: argparse.ArgumentParser) -> None:
    """`bench chaos`'s own flags: how often members die, for how long, and the link flaps."""
    g = b.add_argument_group("chaos (node daemons killed, restarted with --join, link flaps as root)")
    g.add_argument("--kill-every", type=positive_float, default=20.0, help="mean seconds between kills (20)")
    g.add_argument(
        "--down",
        nargs=2,
        type=float,
        default=[2.0, 20.0],
        metavar=("MIN", "MAX"),
        help="a killed daemon restarts after a random MIN..MAX seconds (2 20)",
    )
    g.add_argument("--max-down", type=int_at_least(1), default=2, help="never more members down at once (2)")
    g.add_argument("--flap-every", type=positive_float, default=180.0, help="seconds between link flaps (180)")
    g.add_argument("--flap-down", type=positive_float, default=10.0, help="seconds each flap keeps the link down")
    g.add_argument("--no-flaps", action="store_true", help="no link flaps even as root")
    g.add_argument("--seed", type=int, default=0, help="seed of the kill schedule")
    g.add_argument("--run-dir", default=None, help="keep the daemons' folder here (default: a temporary one)")


def add_demo_parser(sub: Any) -> None:
    d = sub.add_parser("demo", help="train across N local node daemons over emulated WAN links, then report")
    d.add_argument("--nodes", type=int, default=3)
    d.add_argument("--link", type=link_rate, default="20mbit", help="emulated link rate per hop")
    d.add_argument("--rtt", type=duration, default="80ms", help="emulated round-trip time per hop")
    d.add_argument("--minutes", type=float, default=3.0, help="training time before a clean stop")
    # the demo's codec averages parameters, which a sparse codec (topk) would zero: [sync] refuses it
    d.add_argument("--codec", type=str.lower, choices=DENSE_CODECS, default="int8")
    d.add_argument("--strategy", choices=STRATEGIES, default="dreamddp")
    d.add_argument("--out", default=None, help="run folder (default runs/demo-TIMESTAMP)")
    d.add_argument(
        "--device", default="auto", choices=["auto", "cpu", "cuda"], help="where the daemons train (auto: CUDA if any)"
    )
    d.set_defaults(func=_demo)
