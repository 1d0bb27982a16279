"""What `dreamp2p bench NAME` runs: one handler per bench turning its parsed options into the benchmark's call,
and the printing of the result (the last line is always the JSON object). The parser is `benchargs`.

Importing this module is cheap: each handler imports its benchmark only when it runs.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dreamp2p.devtools.bench.chaos.plan import ChaosTiming


def emit(result: dict[str, Any], as_json: bool) -> None:
    """Each key on a line of its own unless ``as_json``, then the JSON object."""
    if not as_json:
        for key, value in result.items():
            print(f"{key}: {json.dumps(value)}")
    # the last line is always the JSON object, so scripts can `tail -1`
    print(json.dumps(result))


def _bench_codec(args: argparse.Namespace) -> dict[str, Any]:
    from dreamp2p.devtools.bench.codec import bench_codecs

    return bench_codecs(mbytes=args.mbytes, repeats=args.repeats, names=args.codecs)


def _bench_transport(args: argparse.Namespace) -> dict[str, Any]:
    from dreamp2p.devtools.bench.transport import bench_transport

    return bench_transport(
        mbytes=args.mbytes,
        seconds=args.seconds,
        streams=args.streams,
        netns=args.netns,
        rate=args.rate,
        rtt=args.rtt,
        jitter=args.jitter,
        loss=args.loss,
    )


def _bench_probe(args: argparse.Namespace) -> dict[str, Any]:
    from dreamp2p.devtools.bench.probe import bench_probe

    return bench_probe(tuple(args.rates), tuple(args.rtts), tuple(args.losses), args.bursts, args.syncs, args.sync_kb)


def _bench_allreduce(args: argparse.Namespace) -> dict[str, Any]:
    from dreamp2p.devtools.bench.allreduce import bench_allreduce

    return bench_allreduce(
        peers=args.peers,
        mbytes=args.mbytes,
        codecs=args.codecs,
        rounds=args.repeats,
        streams=args.streams,
        netns=args.netns,
        rate=args.rate,
    )


def _bench_soak(args: argparse.Namespace) -> dict[str, Any]:
    from dreamp2p.devtools.bench.soak import bench_soak

    return bench_soak(minutes=args.minutes, peers=args.peers, mbytes=args.mbytes)


def _bench_strategies(args: argparse.Namespace) -> dict[str, Any]:
    from dreamp2p.devtools.bench.strategies import bench_strategies

    return bench_strategies(
        strategies=args.strategies,
        steps=args.steps,
        period=args.period,
        width=args.width,
        depth=args.depth,
        batch=args.batch,
        rate=args.rate,
        rtt=args.rtt,
        max_delay=args.max_delay,
        codec=args.codec,
        device=args.device,
        lr=args.lr,
    )


def _bench_lm(args: argparse.Namespace) -> dict[str, Any]:
    from dreamp2p.config import parse_duration
    from dreamp2p.devtools.bench.lm.run import bench_lm

    extra = {"max_delay": args.max_delay} if args.max_delay is not None else {}
    return bench_lm(
        strategies=args.strategies,
        regions=args.regions,
        rate=args.rate,
        rtt_ms=parse_duration(args.rtt) * 1e3,
        loss=args.loss,
        jitter_ms=parse_duration(args.jitter) * 1e3,
        steps=args.steps,
        period=args.period,
        width=args.width,
        layers=args.depth,
        device=args.device,
        extra_sync=extra,
        bracket=args.bracket,
        rounds=args.rounds,
        slow=args.slow,
    )


def _bench_regions(args: argparse.Namespace) -> dict[str, Any]:
    from dreamp2p.config import parse_duration
    from dreamp2p.devtools.bench.regions.run import bench_regions

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
        fsdp=args.fsdp,
        hosts=args.hosts,
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
        peers=args.peers,
        **knobs,
    )


def _bench_memory(args: argparse.Namespace) -> dict[str, Any]:
    from dreamp2p.devtools.bench.memory.run import bench_memory

    result = bench_memory(strategies=args.strategies, params=args.params, period=args.period, device=args.device)
    regions = [n for n in args.ranks if n > 1]
    if regions:
        from dreamp2p.devtools.bench.memory.fsdp import bench_regions

        result["fsdp_regions"] = bench_regions(list(result["strategies"]), args.params, args.period, regions)
    return result


def chaos_timing(args: argparse.Namespace) -> ChaosTiming:
    """bench chaos's fault schedule from its options (ChaosTiming's ValueError for bad values)."""
    from dreamp2p.devtools.bench.chaos.plan import FAULT_KINDS, ChaosTiming
    from dreamp2p.devtools.localrun import NAMES

    return ChaosTiming(
        kill_every_s=args.kill_every,
        down_min_s=args.down[0],
        down_max_s=args.down[1],
        max_down=args.max_down,
        protected=frozenset({NAMES[0]}),
        kinds=FAULT_KINDS if args.kinds is None else args.kinds,
        stop_min_s=args.stop_min,
        stop_max_s=args.stop_max,
        long_stop_p=args.long_stop_p,
        long_stop_max_s=args.long_stop_max,
        partition_min_s=args.partition_min,
        partition_max_s=args.partition_max,
        oneway_p=args.oneway_p,
    )


def _bench_chaos(args: argparse.Namespace) -> dict[str, Any]:
    from dreamp2p.devtools.bench.chaos.run import ChaosRun, bench_chaos

    timing = chaos_timing(args)
    return bench_chaos(
        ChaosRun(
            minutes=args.minutes,
            nodes=args.peers,
            timing=timing,
            flaps=not args.no_flaps,
            flap_every_s=args.flap_every,
            flap_down_s=args.flap_down,
            rate=args.rate,
            rtt=args.rtt,
            loss=args.loss,
            jitter=args.jitter,
            period=args.period,
            max_delay=args.max_delay,
            dim=args.width,
            layers=args.depth,
            seed=args.seed,
            min_step_s=args.min_step,
            run_dir=args.run_dir,
        )
    )


HANDLERS: dict[str, Callable[[argparse.Namespace], dict[str, Any]]] = {
    "codec": _bench_codec,
    "transport": _bench_transport,
    "probe": _bench_probe,
    "allreduce": _bench_allreduce,
    "soak": _bench_soak,
    "strategies": _bench_strategies,
    "lm": _bench_lm,
    "plancheck": _bench_plancheck,
    "digits": _bench_digits,
    "memory": _bench_memory,
    "chaos": _bench_chaos,
    "regions": _bench_regions,
}


def run_bench(args: argparse.Namespace) -> int:
    """Run the bench the command line names and print its result; 0 when it ran."""
    result = HANDLERS[args.what](args)  # the sub-parsers are these names
    emit(result, args.json)
    return 0
