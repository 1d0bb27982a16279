"""`dreamp2p bench`'s parser: one sub-parser per benchmark, holding only the options that benchmark reads.

The options every bench takes (``--json``, ``-v``) come from a parent parser. A concept has one name in
every bench that takes it: ``--rate`` is the emulated link's rate, ``--rtt`` its round trip, ``--strategies``
what to train, ``--codecs`` the codecs to measure, ``--peers`` how many processes. An option of another
bench is refused by name (`bench lm --mbytes 3`: "--mbytes is not an option of bench lm; bench codec,
transport, allreduce, soak take it"). Each bench's defaults are its sub-parser's own, so ``--help`` shows
them. What runs behind each name is in `benchrun`.
"""

from __future__ import annotations

import argparse
import functools
import re
from collections.abc import Callable, Sequence
from typing import Any

from dreamp2p.cli.args import (
    check_delay,
    duration,
    int_at_least,
    link_rate,
    nonneg_float,
    open_fraction,
    positive_float,
)
from dreamp2p.config.codecs import CODEC_NAMES
from dreamp2p.config.parse import parse_duration
from dreamp2p.config.sync import STRATEGIES
from dreamp2p.devtools.benchrun import run_bench

Parser = argparse.ArgumentParser


def loss_fraction(text: str) -> float:
    """An argparse type: a packet loss fraction, ``0.1%`` or ``0.001``, in [0, 1)."""
    from dreamp2p.devtools.wanmodel import parse_loss

    try:
        return parse_loss(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


class NotThisBench(argparse.Action):
    """An option that only other benches take: giving it is a usage error naming the benches that do."""

    def __init__(self, option_strings: Sequence[str], dest: str, owners: Sequence[str] = (), **_: Any) -> None:
        super().__init__(option_strings, dest, nargs="*", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
        self.owners = tuple(owners)

    def __call__(
        self, parser: Parser, namespace: argparse.Namespace, values: Any, option_string: str | None = None
    ) -> None:
        bench = parser.prog.rsplit(" ", 1)[-1]
        parser.error(
            f"argument {option_string}: not an option of bench {bench}; "
            f"bench {', '.join(self.owners)} take{'s' if len(self.owners) == 1 else ''} it "
            f"(`dreamp2p bench {bench} --help` lists the options it takes)"
        )


# --- options that several benches share, one name each ------------------------------------------------------


def _rate(p: Parser, default: str | None, what: str = "") -> None:
    shown = default or "none"
    p.add_argument("--rate", type=link_rate, default=default, help=f"emulated link rate, e.g. 20mbit{what} ({shown})")


def _rtt(p: Parser, default: str, what: str = "") -> None:
    p.add_argument("--rtt", type=duration, default=default, help=f"emulated round-trip time per hop{what} ({default})")


def _loss_jitter(p: Parser, where: str) -> None:
    """--loss and --jitter of a bench whose links can go through the packet emulator (``where``: when they do)."""
    p.add_argument("--jitter", type=duration, default="0ms", help=f"{where}: sd of a packet's one-way delay (0ms)")
    p.add_argument("--loss", type=loss_fraction, default=0.0, help=f"{where}: packet loss per direction, e.g. 0.1%%")


def _mbytes(p: Parser, default: float) -> None:
    p.add_argument("--mbytes", type=positive_float, default=default, help=f"buffer size in MB ({default:g})")


def _peers(p: Parser, default: int, what: str = "peer processes") -> None:
    p.add_argument("--peers", type=int_at_least(2), default=default, help=f"{what} ({default})")


def _codecs(p: Parser) -> None:
    p.add_argument(
        "--codecs", nargs="+", type=str.lower, choices=CODEC_NAMES, default=None, help="codecs to measure (all)"
    )


def _repeats(p: Parser, what: str) -> None:
    p.add_argument("--repeats", type=int_at_least(1), default=3, help=f"{what} (3)")


def _streams_or_auto(text: str) -> int | str:
    """--streams of `bench transport`: a count >= 1, or ``auto`` (chosen from the rate, RTT, loss and TCP window)."""
    return "auto" if text.strip().lower() == "auto" else int_at_least(1)(text)


def _streams_netns(p: Parser, netns: str, auto: bool = False) -> None:
    if auto:
        p.add_argument(
            "--streams",
            type=_streams_or_auto,
            default=2,
            help="parallel streams (TCP connections) per link, or auto: from --rate/--rtt/--loss and the kernel's "
            "TCP window, with --netns (2)",
        )
    else:
        p.add_argument(
            "--streams", type=int_at_least(1), default=2, help="parallel streams (TCP connections) per link (2)"
        )
    p.add_argument("--netns", action="store_true", help=netns)


def _strategies(p: Parser, what: str) -> None:
    p.add_argument("--strategies", nargs="+", default=None, help=what)


def _training(p: Parser, steps: int | None, period: int, width: int | None, depth: int | None) -> None:
    """--steps, --period, --width, --depth with this bench's defaults (None: the bench has no such option)."""
    if steps is not None:
        p.add_argument("--steps", type=int_at_least(1), default=steps, help=f"training steps per run ({steps})")
    p.add_argument("--period", type=int_at_least(1), default=period, help=f"period H ({period})")
    if width is not None:
        p.add_argument("--width", type=int_at_least(1), default=width, help=f"model width ({width})")
    if depth is not None:
        p.add_argument("--depth", type=int_at_least(1), default=depth, help=f"layers or transformer blocks ({depth})")


def _max_delay(p: Parser, below: str = ", < --period") -> None:
    p.add_argument(
        "--max-delay", type=int_at_least(0), default=None, help=f"DreamDDP's max landing delay d{below} (H-1)"
    )


def _device(p: Parser, what: str) -> None:
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help=f"where {what} train (cpu)")


def _minutes(p: Parser, what: str) -> None:
    p.add_argument("--minutes", type=positive_float, default=10.0, help=f"{what} (10)")


# --- one function per bench: its options and, where needed, its checks across them --------------------------


def _codec(p: Parser) -> None:
    _mbytes(p, 64.0)
    _repeats(p, "measured repetitions (median)")
    _codecs(p)


def _transport(p: Parser) -> None:
    _mbytes(p, 64.0)
    p.add_argument("--seconds", type=positive_float, default=6.0, help="measuring time (6)")
    _streams_netns(p, "across two network namespaces, shaped to --rate (root)", auto=True)
    _rate(p, "100mbit", ", with --netns")
    _rtt(p, "0ms", ", with --netns: through the packet emulator")
    p.add_argument("--jitter", type=duration, default="0ms", help="with --netns: sd of a packet's one-way delay (0ms)")
    p.add_argument(
        "--loss", type=loss_fraction, default=0.0, help="with --netns: packet loss per direction, e.g. 0.1%%"
    )


def _transport_check(parser: Parser, args: argparse.Namespace) -> None:
    if not args.netns and (args.loss or parse_duration(args.jitter) or parse_duration(args.rtt)):
        parser.error("arguments --rtt/--jitter/--loss: transport emulates them only with --netns (the packet emulator)")


def _probe(p: Parser) -> None:
    p.add_argument(
        "--rates",
        nargs="+",
        type=link_rate,
        default=["5mbit", "20mbit", "100mbit", "200mbit"],
        help="link rates of the grid",
    )
    p.add_argument("--rtts", nargs="+", type=duration, default=["0ms", "50ms", "150ms"], help="RTTs of the grid")
    p.add_argument(
        "--losses", nargs="+", type=loss_fraction, default=[0.0, 0.001, 0.01], help="packet losses of the grid"
    )
    p.add_argument("--bursts", type=int_at_least(1), default=3, help="idle-link probes per point (3)")
    p.add_argument(
        "--syncs", type=int_at_least(0), default=8, help="sync-sized streams per point, after the probes (8)"
    )
    p.add_argument("--sync-kb", type=int_at_least(1), default=1024, help="KiB per sync stream (1024)")


def _allreduce(p: Parser) -> None:
    _peers(p, 4)
    _mbytes(p, 64.0)
    _codecs(p)
    _repeats(p, "measured rounds per codec (median)")
    _streams_netns(p, "across tbf-shaped network namespaces at --rate (root)")
    _rate(p, "100mbit", ", with --netns")


def _soak(p: Parser) -> None:
    _minutes(p, "how long to run")
    _peers(p, 4)
    _mbytes(p, 4.0)


def _strategies_bench(p: Parser) -> None:
    _strategies(p, "which to run (all)")
    _training(p, steps=150, period=10, width=512, depth=4)
    p.add_argument("--batch", type=int_at_least(1), default=4096, help="batch size per peer (4096: ~0.16 s CPU steps)")
    _rate(p, None, "; none: a full sync takes H/2 steps")
    p.add_argument("--link-rate", dest="rate", type=link_rate, help=argparse.SUPPRESS)  # its name before issue 35
    _rtt(p, "20ms")
    _max_delay(p)
    p.add_argument("--codec", type=str.lower, choices=CODEC_NAMES, default="fp32", help="codec of the syncs (fp32)")
    p.add_argument("--lr", type=float, default=0.05, help="SGD learning rate; wide models want less (0.05)")
    _device(p, "the trainers (both peers)")


def _lm(p: Parser) -> None:
    _strategies(p, "which to run (all); variants too, e.g. dreamddp:error_feedback=true")
    p.add_argument("--regions", type=int_at_least(1), default=2, help="regions, one process each (2)")
    _rate(p, "20mbit")
    _rtt(p, "0ms", "; as root through the packet emulator, else the transport's in-process delay")
    _loss_jitter(p, "as root, through the packet emulator; refused without root")
    _training(p, steps=200, period=20, width=256, depth=4)
    _max_delay(p)
    _device(p, "the regions")
    p.add_argument(
        "--bracket", action="store_true", help="the ceiling again after every strategy; utilization against the two"
    )
    p.add_argument(
        "--rounds",
        type=int_at_least(1),
        default=1,
        help="every strategy this many times, order rotated each round; means and paired 95%% intervals (1)",
    )
    p.add_argument(
        "--slow",
        nargs="+",
        default=[],
        metavar="REGION=FACTOR",
        help="regions (from 0) whose trainers run at FACTOR of their pace, e.g. 1=0.5 (none)",
    )


def _plancheck(p: Parser) -> None:
    _training(p, steps=100, period=20, width=None, depth=None)
    p.add_argument(
        "--sizes", nargs="+", default=["small", "large"], choices=["small", "large", "tiny"], help="d256x4, d384x6"
    )
    p.add_argument(
        "--rates", nargs="+", type=link_rate, default=["10mbit", "20mbit", "100mbit"], help="link rates of the grid"
    )
    p.add_argument("--rtts", nargs="+", type=duration, default=["0ms", "80ms"], help="RTTs of the grid")
    p.add_argument("--region-counts", nargs="+", type=int_at_least(2), default=[2, 3], help="region counts of the grid")
    p.add_argument("--target-cu", type=open_fraction, default=None, help="check plan --target-cu's recommendation")
    p.add_argument("--out", default=None, help="append each finished point to this JSON-lines file")
    p.add_argument("--reports", nargs="+", default=None, help="saved bench lm reports to compare instead of running")


def _digits(p: Parser) -> None:
    _strategies(p, "which to run (ssgd dreamddp diloco)")
    _peers(p, 3)
    _max_delay(p, below=", < its period, 10")


def _chaos(p: Parser) -> None:
    _minutes(p, "each of the two timed phases")
    _peers(p, 5, "node daemons, more than --max-down and at most 8")
    p.add_argument("--kill-every", type=positive_float, default=20.0, help="mean seconds between kills (20)")
    p.add_argument(
        "--down",
        nargs=2,
        type=float,
        default=[2.0, 20.0],
        metavar=("MIN", "MAX"),
        help="a killed daemon restarts after a random MIN..MAX seconds (2 20)",
    )
    p.add_argument("--max-down", type=int_at_least(1), default=2, help="never more members down at once (2)")
    _chaos_faults(p)
    p.add_argument("--flap-every", type=positive_float, default=180.0, help="seconds between link flaps (180)")
    p.add_argument("--flap-down", type=positive_float, default=10.0, help="seconds each flap keeps the link down (10)")
    p.add_argument("--no-flaps", action="store_true", help="no link flaps even as root")
    _rate(p, "50mbit")
    _rtt(p, "4ms", "; with --loss or --jitter, the packet emulator's")
    _loss_jitter(p, "as root, every path through the packet emulator (with --rate and --rtt)")
    _training(p, steps=None, period=5, width=64, depth=2)
    _max_delay(p)
    p.add_argument("--seed", type=int, default=0, help="seed of the kill schedule (0)")
    p.add_argument(
        "--min-step",
        type=nonneg_float,
        default=0.0,
        help="each daemon's step takes at least this many seconds ([train] min_step_s; 0: as fast as it can)",
    )
    p.add_argument("--run-dir", default=None, help="keep the daemons' folder here (default: a temporary one)")


def fault_kinds(text: str) -> tuple[str, ...]:
    """An argparse type: a comma list of fault kinds (``kill,stop``); which ones are allowed, ChaosTiming checks."""
    kinds = tuple(k.strip().lower() for k in text.split(",") if k.strip())
    if not kinds:
        raise argparse.ArgumentTypeError("name at least one fault kind: kill, stop, partition")
    return kinds


def _chaos_faults(p: Parser) -> None:
    """bench chaos's fault kinds and how long freezes and partitions last (seconds, like --down)."""
    p.add_argument(
        "--kinds",
        type=fault_kinds,
        default=None,
        help="faults to draw, a comma list of kill, stop (SIGSTOP/SIGCONT), partition "
        "(kill,stop,partition; partition only as root)",
    )
    seconds: list[tuple[str, float, str]] = [
        ("--stop-min", 2.0, "shortest freeze, seconds"),
        ("--stop-max", 20.0, "longest freeze that is not a long one, seconds"),
        ("--long-stop-p", 0.1, "chance that a freeze is a long one, in [0, 1]"),
        ("--long-stop-max", 180.0, "longest long freeze (they last --stop-max..this), seconds"),
        ("--partition-min", 5.0, "shortest partition, seconds"),
        ("--partition-max", 30.0, "longest partition, seconds"),
        ("--oneway-p", 0.5, "chance that a partition is one-way (the group's packets to the rest dropped), in [0, 1]"),
    ]
    for flag, default, what in seconds:
        p.add_argument(flag, type=nonneg_float, default=default, help=f"{what} ({default:g})")


# ChaosTiming's field names in its errors -> the options that set them
_TIMING_OPTIONS = {
    "kill_every_s": "--kill-every",
    "down_min_s": "--down MIN",
    "down_max_s": "--down MAX",
    "max_down": "--max-down",
    "kinds": "--kinds",
    "long_stop_max_s": "--long-stop-max",
    "long_stop_p": "--long-stop-p",
    "stop_min_s": "--stop-min",
    "stop_max_s": "--stop-max",
    "partition_min_s": "--partition-min",
    "partition_max_s": "--partition-max",
    "oneway_p": "--oneway-p",
}


def _chaos_check(parser: Parser, args: argparse.Namespace) -> None:
    from dreamp2p.devtools.benchrun import chaos_timing

    check_delay(parser, args)
    if not 0 <= args.down[0] <= args.down[1]:
        parser.error(f"argument --down: need 0 <= MIN <= MAX, got {args.down[0]:g} {args.down[1]:g}")
    if not args.max_down < args.peers <= 8:
        parser.error(f"argument --peers: chaos needs more than --max-down ({args.max_down}) and at most 8")
    try:
        chaos_timing(args)
    except ValueError as exc:
        names = "|".join(sorted(_TIMING_OPTIONS, key=len, reverse=True))
        parser.error(re.sub(rf"\b({names})\b", lambda m: _TIMING_OPTIONS[m[1]], str(exc)))


def _regions(p: Parser) -> None:
    p.add_argument("--regions", type=int_at_least(1), default=2, help="regions (2)")
    p.add_argument("--ranks", type=int_at_least(2), default=2, help="local ranks per region (2)")
    _rate(p, "20mbit")
    _rtt(p, "0ms")
    _strategies(p, "the one strategy to run (ssgd)")
    _training(p, steps=12, period=10, width=256, depth=4)
    _max_delay(p)
    p.add_argument("--fsdp", action="store_true", help="shard each region's model with FSDP2 instead of DDP")
    p.add_argument("--hosts", action="store_true", help="every rank a host of its own, with its own torchrun agent")


def _regions_check(parser: Parser, args: argparse.Namespace) -> None:
    check_delay(parser, args)
    if args.strategies is not None and len(args.strategies) != 1:
        parser.error("argument --strategies: regions runs one strategy (default ssgd)")


def param_count(text: str) -> int:
    """An argparse type: a parameter count of at least 1000, ``32000000`` or ``32e6``."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a count such as 32e6, got {text!r}") from None
    if not value >= 1000 or value != value // 1 or value > 1e12:
        raise argparse.ArgumentTypeError(f"must be a whole number from 1000 to 1e12, got {text}")
    return int(value)


def _memory(p: Parser) -> None:
    _strategies(p, "which to measure besides none, the compute-only reference (all)")
    p.add_argument(
        "--params", type=param_count, default=32_000_000, help="model size, e.g. 32e6 (32000000: RSS noise small)"
    )
    _training(p, steps=None, period=4, width=None, depth=None)
    _device(p, "the strategies")
    p.add_argument(
        "--ranks",
        type=_rank_counts,
        default=[1],
        help="region sizes: 1 is a one-rank member, N > 1 a rank of an FSDP2 region of N ranks (e.g. 1,2,4)",
    )


def _rank_counts(text: str) -> list[int]:
    try:
        counts = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected region sizes such as 1,2,4, got {text!r}") from None
    if not counts or any(not 1 <= c <= 64 for c in counts) or len(set(counts)) != len(counts):
        raise argparse.ArgumentTypeError(f"expected distinct region sizes from 1 to 64, got {text!r}")
    return counts


def _memory_check(parser: Parser, args: argparse.Namespace) -> None:
    unknown = [name for name in args.strategies or () if name not in STRATEGIES]
    if unknown:
        parser.error(f"argument --strategies: unknown {', '.join(unknown)}; choose from {', '.join(STRATEGIES)}")
    if args.device != "cpu" and any(n > 1 for n in args.ranks):
        parser.error("argument --ranks: FSDP2 regions are measured on the CPU (gloo) only")


Check = Callable[[Parser, argparse.Namespace], None]
# name -> (what it measures, its options, its checks across options); `bench --help` lists them in this order
BENCHES: dict[str, tuple[str, Callable[[Parser], None], Check | None]] = {
    "codec": ("encode/decode speed and error of every codec", _codec, None),
    "transport": ("goodput of the transport between two processes", _transport, _transport_check),
    "probe": ("the link probe's estimate against the shaped rate over a rate x RTT x loss grid (root)", _probe, None),
    "allreduce": ("ring all-reduce time, bandwidth and CPU per round, per codec", _allreduce, None),
    "soak": ("peers averaging back to back for minutes: resource growth, failures", _soak, None),
    "strategies": ("every strategy on one MLP over an emulated link, 2 peers", _strategies_bench, check_delay),
    "lm": ("the strategies on a byte-level GPT across emulated WAN regions", _lm, check_delay),
    "plancheck": ("`dreamp2p plan`'s predictions against bench lm over a grid", _plancheck, None),
    "memory": ("host and device bytes per parameter each strategy adds to a one-rank member", _memory, _memory_check),
    "digits": ("a BatchNorm CNN on the digits data set, trained through the library", _digits, None),
    "chaos": ("node daemons trained through kills, freezes, partitions and link flaps", _chaos, _chaos_check),
    "regions": ("regions of many ranks against regions of one, over tbf links (root)", _regions, _regions_check),
}


def _common() -> Parser:
    """The options of every bench: a parent parser."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--json", action="store_true", help="print only the JSON result line")
    # SUPPRESS: absent after the bench's name, the count given before it stands
    common.add_argument(
        "-v", "--verbose", action="count", default=argparse.SUPPRESS, help="more logging (-v info, -vv debug)"
    )
    return common


def add_bench_parser(sub: Any) -> None:
    """`dreamp2p bench NAME [options]`: a sub-parser per bench, then the other benches' options refused by name."""
    b = sub.add_parser(
        "bench",
        help="benchmarks; the last line printed is a JSON object",
        description="Run one benchmark; `dreamp2p bench BENCH --help` lists the options that BENCH takes. "
        "The last line printed is a JSON object.",
    )
    names = b.add_subparsers(dest="what", required=True, metavar="BENCH", title="benchmarks")
    common = _common()
    parsers: dict[str, Parser] = {}
    for name, (about, add_options, check) in BENCHES.items():
        p = names.add_parser(name, parents=[common], help=about, description=f"bench {name}: {about}")
        add_options(p)
        p.set_defaults(func=run_bench, check=None if check is None else functools.partial(check, p))
        parsers[name] = p
    refuse_foreign_options(parsers)


def own_options(parser: Parser) -> set[str]:
    """The option strings a parser takes (``--help`` too)."""
    return {flag for action in parser._actions for flag in action.option_strings}


def refuse_foreign_options(parsers: dict[str, Parser]) -> None:
    """Give each parser every other parser's options as hidden ones that fail with the names of their owners."""
    own = {name: own_options(p) for name, p in parsers.items()}
    every = set().union(*own.values())
    for name, p in parsers.items():
        for flag in sorted(every - own[name]):
            p.add_argument(flag, action=NotThisBench, owners=[n for n in parsers if flag in own[n]])
