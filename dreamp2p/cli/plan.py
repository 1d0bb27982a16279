"""`dreamp2p plan`: predicted step time and utilization per strategy, the paper's bandwidth table
(``--table``) and DreamDDP's recommended settings for a target utilization (``--target-cu``)."""

from __future__ import annotations

import argparse
import functools
import json
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from dreamp2p.cli.args import (
    check_delay,
    duration,
    int_at_least,
    link_rate,
    nonneg_float,
    open_fraction,
    positive_float,
    step_times,
)
from dreamp2p.config.codecs import CODEC_NAMES

if TYPE_CHECKING:  # the heavy modules load only in the subcommand that runs
    from dreamp2p.config.sync import SyncConfig
    from dreamp2p.schedule.cost import LayerCost, LinkModel
    from dreamp2p.schedule.recommend import Recommendation


def _plan_check(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Defaults that depend on the mode: --table has the paper's H and no RTT; a model is needed otherwise.

    In --target-cu mode --period, --codec and --max-delay stay None unless given: given, they pin that
    dimension of the search; left out, it is searched.
    """
    if args.table:
        from dreamp2p.schedule.utilization import PAPER_PERIOD

        args.period = PAPER_PERIOD if args.period is None else args.period
        args.rtt = "0ms" if args.rtt is None else args.rtt
    else:
        flags = (("--params", args.params), ("--layers", args.layers), ("--step-time", args.step_time))
        missing = [flag for flag, value in flags if value is None]
        if missing:
            parser.error(f"the following arguments are required: {', '.join(missing)} (or use --table)")
        args.rtt = "80ms" if args.rtt is None else args.rtt
        # regions of different speeds: every strategy runs in lockstep by default, at the slowest one's pace,
        # and DreamDDP's planner makes its plan for the slowest member's profile (`control.unpack_control`)
        args.region_step_times, args.step_time = args.step_time, max(args.step_time)
        regions = len(args.region_step_times)
        if regions > 1 and args.peers not in (None, regions):
            parser.error(f"--step-time gives {regions} regions' step times but --peers says {args.peers}")
        args.peers = regions if regions > 1 else args.peers
        if args.target_cu is None:  # what a DreamDDP run with defaults uses
            from dreamp2p.config.sync import SyncConfig

            run = SyncConfig()
            args.period = run.period if args.period is None else args.period
            # not given: the run's pseudo-gradient codec, or the fallback its planner takes on this link
            args.codec_chain = run.delta_chain if args.codec is None else ()
            args.codec = (run.delta_codec or (run.plan_codecs or (run.codec,))[0]) if args.codec is None else args.codec
            args.max_delay = args.period - 1 if args.max_delay is None else args.max_delay
    args.peers = 2 if args.peers is None else args.peers
    if args.period is not None:
        check_delay(parser, args)


def _gbit(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.0f}" if value >= 100 else f"{value:.1f}" if value >= 10 else f"{value:.2f}"


def _plan_table(args: argparse.Namespace) -> int:
    from dreamp2p.config import parse_duration
    from dreamp2p.schedule import utilization as u

    net = u.Network(args.peers, parse_duration(args.rtt))
    methods = u.paper_methods(args.period, u.PAPER_OVERLAP, args.max_delay)
    rows = u.bandwidth_table(u.PAPER_WORKLOADS, methods, net, u.PAPER_TARGETS)
    delay = args.period - 1 if args.max_delay is None else args.max_delay
    result = {
        "table": {
            "source": "Streaming DiLoCo (Douillard et al. 2025, arXiv 2501.18512), Table 4: models, layers, step times",
            "period": args.period,
            "overlap_tau": u.PAPER_OVERLAP,
            "fragment_layers": u.PAPER_FRAGMENT_LAYERS,
            "dreamddp_max_delay": delay,
            "peers": net.peers,
            "rtt_s": net.rtt_s,
            "backward_fraction": round(u.PAPER_WORKLOADS[0].backward_fraction, 4),
            "targets": list(u.PAPER_TARGETS),
            "rows": [
                {
                    "model": r.model,
                    "params": r.params,
                    "layers": r.layers,
                    "step_time_s": r.step_time_s,
                    "method": r.method,
                    "kind": r.kind,
                    "fragments": r.fragments,
                    "gbit_s": [None if g is None else round(g, 4) for g in r.gbit_s],
                }
                for r in rows
            ],
        }
    }
    if not args.json:
        print("Gbit/s needed per link to reach a compute utilization (CU), per model and sync method")
        print(
            "models, layers and compute time per step: Streaming DiLoCo (Douillard et al. 2025, arXiv 2501.18512), "
            "Table 4"
        )
        print(
            f"assumed: H={args.period}; Streaming DiLoCo fragments of {u.PAPER_FRAGMENT_LAYERS} layers (P), overlap "
            f"tau={u.PAPER_OVERLAP}; DreamDDP delays <= {delay}; {net.peers} peers, RTT {net.rtt_s * 1e3:g} ms; "
            "backward = 2/3 of a step"
        )
        print(
            "ring all-reduce = 2(N-1)/N * bytes / bandwidth + 2(N-1) * RTT/2; CU = compute / (compute + exposed "
            "communication); wire bits per parameter: fp32 32, bf16 16, 4-bit 4; '-': unreachable at this RTT"
        )
        cols = " ".join(f"{t:>7.0%}" for t in u.PAPER_TARGETS)
        print(f"{'model':<6} {'layers':>6} {'step s':>6}  {'method':<37} {'P':>3} {cols}")
        for r in rows:
            cells = " ".join(f"{_gbit(g):>7}" for g in r.gbit_s)
            print(f"{r.model:<6} {r.layers:>6} {r.step_time_s:>6.1f}  {r.method:<37} {r.fragments:>3} {cells}")
    print(json.dumps(result))
    return 0


def _plan_target(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from dreamp2p.compression import get_codec
    from dreamp2p.config import parse_duration, parse_rate
    from dreamp2p.config.sync import SyncConfig, dreamddp_settings
    from dreamp2p.schedule.cost import LinkModel
    from dreamp2p.schedule.recommend import SEARCH_PERIODS
    from dreamp2p.schedule.whatif import uniform_costs

    run = SyncConfig()  # a recommendation must keep the headroom a dreamddp run demands of its plans
    costs = uniform_costs(args.params, args.layers, args.step_time)
    link = LinkModel(parse_rate(args.link), parse_duration(args.rtt), args.peers, margin=run.link_margin)
    # unpinned: what a run sends by default (4-bit pseudo-gradients, 2-bit or sparse where the link cannot carry
    # 4), the fewest bytes at the same loss (`_recommend`)
    codecs = [get_codec(c).name for c in ((args.codec,) if args.codec else run.delta_chain)]
    periods = (args.period,) if args.period else SEARCH_PERIODS
    rec = _recommend(args, costs, link, codecs, periods, run)
    settings = None
    if rec.best:
        # the delay cap stays the run's default (period - 1) unless pinned: the run's planner takes the smallest
        # delays that hide on the link it measures, and a cap at the predicted delay leaves it no slack when the
        # link delivers less than --link says (a cap of 2 measured 0.84 where 0.96 was predicted)
        cap = None if args.max_delay is None else min(args.max_delay, rec.best.period - 1)
        settings = dreamddp_settings(rec.best.codec, rec.best.period, cap)
    result = {
        "target_cu": rec.target,
        "reached": rec.best is not None,
        "recommendation": asdict(rec.best) if rec.best else None,
        "sync": settings,  # the [sync] table that runs it
        "closest": asdict(rec.closest) if rec.closest else None,
        "needed_gbit_s": None if rec.needed_Bps is None else round(rec.needed_Bps * 8 / 1e9, 6),
        "needed_for": rec.needed_for,
        "message": rec.message,
        "searched": {"codecs": codecs, "periods": sorted(set(periods)), "max_delay": args.max_delay},
        "planner_runs": rec.evaluated,
    }
    if not args.json:
        print(
            f"target compute utilization {rec.target} on a {args.link} link, RTT {args.rtt}, {args.peers} peers; "
            f"{args.params:g} parameters in {args.layers} layers, {args.step_time:g} s compute per step"
        )
        delays = "0, 1, 2, 4, ... and period-1" if args.max_delay is None else f"up to {args.max_delay}"
        grid = ", ".join(map(str, sorted(set(periods))))
        print(
            f"searched DreamDDP settings: codecs {', '.join(codecs)}; periods {grid}; delays {delays} "
            f"({rec.evaluated} planner runs; preferred: the smallest period, then the smallest delay)"
        )
        if rec.best and settings:
            b = rec.best
            what = "pseudo-gradients" if settings["delta_codec"] else "parameters"
            print(
                f"recommended: codec {b.codec} ({what}), period {b.period}, max delay {b.delay}, {b.fragments} "
                "fragments (all-reduce groups per period; the delay is the plan's, a run's cap stays period - 1 "
                "unless --max-delay is given)"
            )
            print(
                f"predicted: utilization {b.utilization:.3f}, step {b.step_time_s:.3f} s, "
                f"{b.bytes_per_step / 1e6:.2f} MB/step per peer"
            )
            print("as a node's settings:\n[sync]")
            for key, value in settings.items():
                print(f"{key} = {json.dumps(value)}")
        else:
            print(rec.message)
    print(json.dumps(result))
    return 0


def _recommend(
    args: argparse.Namespace,
    costs: Sequence[LayerCost],
    link: LinkModel,
    codecs: list[str],
    periods: Sequence[int],
    run: SyncConfig,
) -> Recommendation:
    """`recommend` over the dense codecs of ``codecs``, then, where none reaches the target at any period, the
    sparse ones: on bench lm at 20 Mbit/s the sparse codec cost 1.1% of held-out loss, more than a longer
    period does."""
    from dreamp2p.config.codecs import is_sparse
    from dreamp2p.schedule.linkcodec import round_wire_ratio
    from dreamp2p.schedule.recommend import recommend

    def search(names: list[str]) -> Recommendation:
        return recommend(
            costs,
            link,
            args.target_cu,
            [(c, round_wire_ratio(c, link.world)) for c in names],
            periods,
            args.max_delay,
            round_cost_s=run.round_cost_s if args.round_cost is None else args.round_cost,
            link_budget=run.codec_link_budget,
        )

    dense, sparse = [c for c in codecs if not is_sparse(c)], [c for c in codecs if is_sparse(c)]
    rec = search(dense or sparse)
    if rec.best is None and dense and sparse:
        fallback = search(sparse)
        rec = fallback if fallback.best is not None else rec
    return rec


def _plan(args: argparse.Namespace) -> int:
    if args.table:
        return _plan_table(args)
    if args.target_cu is not None:
        return _plan_target(args)
    from dreamp2p.compression import get_codec
    from dreamp2p.config import parse_duration, parse_rate
    from dreamp2p.config.sync import SyncConfig
    from dreamp2p.schedule.linkcodec import round_wire_ratio
    from dreamp2p.schedule.whatif import run_delta_codec, what_if

    run = SyncConfig()
    model = {
        "params": args.params,
        "layers": args.layers,
        "step_time_s": args.step_time,
        "peers": args.peers,
        "bandwidth_Bps": parse_rate(args.link),
        "rtt_s": parse_duration(args.rtt),
        "period": args.period,
        "max_delay": args.max_delay,
        "margin": run.link_margin,
        "round_cost_s": run.round_cost_s if args.round_cost is None else args.round_cost,
    }
    chain = args.codec_chain  # set by _plan_check in this mode
    ratio = functools.partial(round_wire_ratio, world=args.peers)
    name = run_delta_codec([(c, ratio(c)) for c in chain], **model) if chain else args.codec
    result = {**what_if(codec_ratio=ratio(name), **model), "codec": get_codec(name).name}
    result["lockstep"] = lockstep_report(args.region_step_times)
    if not args.json:
        print(f"{'strategy':<10} {'step s':>9} {'utilization':>11} {'MB/step':>10}")
        for name, p in result["predictions"].items():
            print(
                f"{name:<10} {p['step_time_s']:9.3f} {p['compute_utilization']:11.3f} {p['bytes_per_step'] / 1e6:10.2f}"
            )
        print(f"DreamDDP's layer syncs priced in {result['codec']}")
        if len(args.region_step_times) > 1:
            idle = ", ".join(f"{x:.0%}" for x in result["lockstep"]["idle_fraction"])
            print(
                f"regions of different speeds: in lockstep every region steps at the slowest's "
                f"{args.step_time:g} s (idle per region: {idle}; the plan is made for it); "
                f'[sync] periods = "time" (diloco, streaming, dreamddp) lets each region take the steps it manages'
            )
    print(json.dumps(result))
    return 0


def lockstep_report(step_times: tuple[float, ...]) -> dict[str, Any]:
    """What lockstep costs regions of these compute times per step: each steps at the slowest's pace, so
    region i idles ``1 - t_i / max t`` of the time, and the cluster's ``n / max t`` steps per second are
    that share of the ``sum 1 / t_i`` the regions manage alone (every step the same tokens)."""
    slowest = max(step_times)
    return {
        "region_step_times_s": list(step_times),
        "step_time_s": slowest,
        "idle_fraction": [round(1 - t / slowest, 6) for t in step_times],
        "of_solo_sum": round(sum(1 / slowest for _ in step_times) / sum(1 / t for t in step_times), 6),
    }


def add_plan_parser(sub: Any) -> None:
    pl = sub.add_parser("plan", help="predict step time and utilization per strategy before launch")
    mode = pl.add_mutually_exclusive_group()
    mode.add_argument(
        "--table",
        action="store_true",
        help="Gbit/s each method needs for 50-99%% compute utilization, 1B/10B/100B models (Streaming DiLoCo Table 4)",
    )
    mode.add_argument(
        "--target-cu",
        type=open_fraction,
        default=None,
        help="recommend DreamDDP period, delay, codec reaching this compute utilization (0..1) on --link",
    )
    pl.add_argument(
        "--params", type=positive_float, default=None, help="model parameters, e.g. 7e9 (required unless --table)"
    )
    pl.add_argument(
        "--layers", type=int_at_least(1), default=None, help="layers, all of equal size (required unless --table)"
    )
    pl.add_argument(
        "--step-time",
        type=step_times,
        default=None,
        help="forward+backward seconds per step (required unless --table); regions of different speeds: one per "
        "region, comma-separated (0.3,0.6): lockstep runs at the slowest, and sets --peers to their count",
    )
    pl.add_argument(
        "--peers", type=int_at_least(1), default=None, help="members (2; several --step-time values: their count)"
    )
    pl.add_argument("--link", type=link_rate, default="1gbit", help="slowest link rate (1gbit, 20Mbit/s, 2.5MB/s)")
    pl.add_argument("--rtt", type=duration, default=None, help="largest RTT (80ms; --table: 0ms)")
    pl.add_argument(
        "--period",
        type=int_at_least(1),
        default=None,
        help="H: every layer is averaged once per H steps (10; --table: 100; --target-cu: searched)",
    )
    pl.add_argument(
        "--codec",
        type=str.lower,
        choices=CODEC_NAMES,
        default=None,
        help="codec DreamDDP's layer syncs are priced at: the one a run gives its pseudo-gradients on --link, int4 "
        "or int2 where the link cannot carry int4 (--target-cu searches them, unless given: 4-bit, 2-bit and "
        "sparse codecs carry pseudo-gradients, fp32/fp16/bf16/int8 the parameters themselves)",
    )
    pl.add_argument(
        "--max-delay",
        type=int_at_least(0),
        default=None,
        help="d: DreamDDP's max landing delay in steps, < --period (default: period-1, as a run's)",
    )
    pl.add_argument(
        "--round-cost",
        type=nonneg_float,
        default=None,
        help="trainer seconds per sync round besides link time (default: [sync] round_cost_s, 0.08)",
    )
    pl.add_argument("--json", action="store_true")
    pl.set_defaults(func=_plan, check=functools.partial(_plan_check, pl))
