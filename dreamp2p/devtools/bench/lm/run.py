"""`bench lm`: compare the sync strategies on a byte-level GPT trained across emulated WAN regions.

The workload: a nanoGPT-style byte transformer (`dreamp2p.service.tasks.ByteTransformer`; d_model ``width``,
``layers`` blocks, ``heads`` heads, context ``context``, vocabulary 256; the defaults give 3.3M parameters)
learns the Python standard library's source (`dreamp2p.service.tasks.stdlib_files`, concatenated in path order;
the last 5% of the bytes are held out). Region r samples ``batch`` windows per step from shard r (a
contiguous slice) of the training part, as a pure function of (rank, step). Inner optimizer: AdamW
(lr ``lr``, weight decay 0.1 on every parameter, betas (0.9, 0.95)). One process per region, each with
``torch.set_num_threads(1)``; the library is used only as a user would: ``node.attach(model, opt,
strategy=name, period=period, **extra_sync)`` then ``sync.step()`` / ``sync.zero_grad()`` in the loop.
The held-out loss is that of each region's own model after the last step, averaged over regions;
``identical_replicas`` (equal parameter digests then) is information only. After the timed loop each region
calls ``sync.flush()``, as a user ends a run: ``heldout_loss_flushed`` is the loss of the flushed model
(``identical_after_flush``: every region's state digest equal; ``flush_errors``: each flush that raised,
e.g. FlushIncomplete when a member dropped out of the view meanwhile), ``flush_s`` the slowest region's flush,
and with tbf ``attach_mb`` / ``flush_mb`` what one region put on the wire during attach and flush.

Regions and links (``shaping`` in the report). As root (and unless ``netns=False``) every region runs in
its own network namespace. With a round trip, jitter or loss (``rtt_ms``, ``jitter_ms``, ``loss``) and two
regions or more, the packet emulator joins them ("wanemu", `dreamp2p.devtools.wanemu`): every directed
pair of regions is a path of its own at ``rate`` with one-way delay rtt/2, the jitter and the loss, so TCP
itself sees the path (no in-process delay); the report adds the emulator's counters and CPU
(``emulator``, per strategy and for the whole run). Without any of them each direction of a region's link
is shaped by ``tc tbf`` to ``rate`` ("tbf"): two regions are joined by one veth pair
(deploy/netns-wan.sh), three or more each by a veth to a bridge in a namespace of their own (a star: every
region has an access link of ``rate`` each way). Not root (or ``netns=False``): the transport's in-process
token bucket (``transport.rate_limit``) emulates the rate and its delay line (``transport.delay_s = rtt /
2``) the round trip ("in-process"); it cannot lose or jitter packets, so ``loss`` and ``jitter_ms`` are
refused there.

The ceiling: ``regions`` plain processes started together (same model, data, AdamW loop; no dreamp2p,
no network) give the steps/s the hardware allows; ``compute_utilization`` = steps_per_s / that. On a shared
host the pace drifts by more than the margins judged (about 10% within one run was measured on the 2-core
test host); ``bracket=True`` runs the ceiling again after every strategy, and each strategy's
``compute_utilization`` is then against the mean of the ceilings just before and after it
(``ceiling_steps_per_s`` in its row; every ceiling run in ``ceiling.steps_per_s_runs``).

Measured per strategy (per region, then combined over regions):

- ``steps_per_s``: steps / wall time of the training loop (attach and the final landing excluded), mean
  over regions;
- ``hidden_fraction`` = 1 - sum(exposed_s) / sum(comm_s) and the mean ``exposed_s`` / ``comm_s`` per
  region, from the strategy's ``totals``;
- ``heldout_loss``: mean over regions of the cross-entropy (nats/byte) on ``eval_batches`` fixed batches
  of the held-out part (the same windows for every strategy and the ceiling);
- ``mb_sent``: MB (1e6 bytes) one region sent during the training loop, mean over regions. With tbf it is
  what the region's tbf put on the wire (its qdisc's byte counter, every segment's headers included, read
  inside its namespace at loop start and end: every frame, heartbeats and link probes included); in process
  it is the strategy's ``totals.bytes_sent`` (round payload). With the packet emulator the counter is the
  region's TUN device's (the IP bytes it handed the emulator, before drops and losses). In namespaces,
  ``mb_sent_run`` adds the whole run as the parent saw the same counters before and after it: connect,
  attach's broadcast of rank 0's model, final landing;
- ``comm_cpu_s``: CPU time of everything but the training thread during the loop (comm thread, gRPC's
  threads): ``time.process_time()`` minus the training thread's ``time.thread_time()``, plus the comm
  process's CPU time with ``comm=process`` (a variant key routed to ``[node] comm``); and
  ``comm_cpu_s_per_mb`` = total comm CPU / total ``mb_sent`` (null below 0.1 MB); ``comm``: "thread" or
  "process", where the peer ran;
- ``train_cpu_s``: CPU time of the training thread during the loop, mean over regions (the ceiling's too):
  against the ceiling's, what the trainer itself does more per run (hooks, launching and landing syncs, and
  compute made slower by caches and memory bandwidth shared with the comm path); wall time beyond it is
  time the trainer waited for a core or the GIL, or for an exposed sync;
- ``time_to_target_s``: the first loop time (slowest region's clock) at which the region-mean held-out loss,
  evaluated every ``eval_every`` = ceil(steps / 10) steps, is <= ``target_loss`` (default: the final
  held-out loss of ``none``, or of the ceiling if ``none`` is not run, times 1.02). To keep evaluation out
  of the timing, the loop only copies the parameters at those steps (its clock paused meanwhile) and the
  copies are evaluated after the loop: evaluating in the loop would also give in-flight rounds free time;
- ``winner_steps_per_s``: the fastest strategy that synchronizes (``none`` only if it is the only one);
- ``paired``: the winner's ``compute_utilization`` minus each other syncing strategy's, round by round
  (`dreamp2p.devtools.bench.lm.rounds.paired`): mean, standard error, Student's t 95% interval and a verdict
  ("ahead", "tie", "behind"; "one round" without ``rounds`` > 1, where no spread can be estimated).

Rounds (``rounds`` > 1): every strategy runs once per round, the order rotated by one each round, so a
host that drifts does not favour whichever runs first; each row's figures are then means over its rounds
(each round's under ``runs``), its curve the rounds' mean curve, and ``time_to_target_s`` is read off that.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import time
import tomllib
from collections.abc import Sequence
from typing import Any

from dreamp2p.config import PeerConfig, parse_rate
from dreamp2p.config.sync import STRATEGIES, SyncConfig
from dreamp2p.devtools.bench.lm.rounds import AVERAGED, combine_rows, mean_curve, paired, round_order
from dreamp2p.devtools.bench.lm.work import JOB, VOCAB, count_params, eval_every, run_ceiling
from dreamp2p.devtools.launch import run_local
from dreamp2p.devtools.netns import Namespaces
from dreamp2p.devtools.wanemu import summary as emulator_summary

log = logging.getLogger(__name__)

TARGET_MARGIN = 1.02  # default target: reference final held-out loss times this


# ---------------------------------------------------------------------------------------------- report


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs)


def _r(x: float | None, nd: int = 4) -> float | None:
    return None if x is None or not math.isfinite(x) else round(x, nd)


def _region_curve(res: list[dict[str, Any]]) -> list[list[float]]:
    """[[step, slowest region's loop time, region-mean held-out loss], ...]."""
    return [
        [pts[0][0], max(p[1] for p in pts), _mean([p[2] for p in pts])]
        for pts in zip(*(r["curve"] for r in res), strict=True)
    ]


def _time_to(curve: list[list[float]], target: float) -> float | None:
    return next((t for _, t, loss in curve if loss <= target), None)


def _summarize(res: list[dict[str, Any]], steps: int, wire_run: list[int] | None) -> dict[str, Any]:
    sps = [steps / r["wall_s"] for r in res]
    comm, exposed = sum(r["comm_s"] for r in res), sum(r["exposed_s"] for r in res)
    wire = [r["wire_bytes"] if r["wire_bytes"] is not None else r["bytes_sent"] for r in res]
    mb = sum(wire) / 1e6
    cpu = sum(r["comm_cpu_s"] for r in res)
    row: dict[str, Any] = {
        "steps_per_s": _r(_mean(sps)),
        "steps_per_s_regions": [_r(x) for x in sps],
        "hidden_fraction": _r(max(0.0, 1.0 - exposed / comm) if comm > 0 else 1.0, 3),
        "exposed_s": _r(exposed / len(res), 3),
        "comm_s": _r(comm / len(res), 3),
        "heldout_loss": _r(_mean([r["heldout_loss"] for r in res])),
        "heldout_loss_regions": [_r(r["heldout_loss"]) for r in res],
        "train_loss_last10": _r(_mean([r["train_loss_last10"] for r in res])),
        "mb_sent": _r(mb / len(res), 3),
        "payload_mb_sent": _r(sum(r["bytes_sent"] for r in res) / 1e6 / len(res), 3),
        "comm_cpu_s": _r(cpu / len(res), 3),
        "train_cpu_s": _r(_mean([r["train_cpu_s"] for r in res]), 3),
        "comm_cpu_s_per_mb": _r(cpu / mb, 4) if mb >= 0.1 else None,
        "comm": res[0]["comm"],  # where the peer ran: "thread" or "process" ([node] comm)
        "identical_replicas": len({r["digest"] for r in res}) == 1,
        "rounds_skipped": [r["rounds_skipped"] for r in res],
        "exposed_by_plan": {v: [n, _r(e, 3), _r(c, 3)] for v, (n, e, c) in res[0]["exposed_by_plan"].items()},
        "curve": [[s, _r(t, 3), _r(loss)] for s, t, loss in _region_curve(res)],
    }
    if wire_run is not None:
        row["mb_sent_run"] = _r(sum(wire_run) / 1e6 / len(res), 3)
    if "heldout_loss_flushed" in res[0]:
        row["heldout_loss_flushed"] = _r(_mean([r["heldout_loss_flushed"] for r in res]))
        row["identical_after_flush"] = len({r["flushed_digest"] for r in res}) == 1
        row["flush_s"] = _r(max(r["flush_s"] for r in res), 3)
        row["flush_errors"] = [r["flush_error"] for r in res if r.get("flush_error")]
        for key in ("attach", "flush"):
            counted = [r[f"{key}_wire_bytes"] for r in res if r.get(f"{key}_wire_bytes") is not None]
            row[f"{key}_mb"] = _r(sum(counted) / 1e6 / len(counted), 3) if counted else None
    if "plan_history" in res[0]:
        row["plan_history"] = res[0]["plan_history"]
        row["plan"] = res[0]["plan_summary"]
        row["plan_report"] = res[0]["plan_report"]
        # per control round: [landing step, the planner's MB/s, the slowest link's transport goodput MB/s]
        row["controls"] = res[0]["controls"]
    return row


# ---------------------------------------------------------------------------------------------- entry point


def parse_variant(entry: str) -> tuple[str, dict[str, Any]]:
    """``"dreamddp:error_feedback=true,delta_codec=e3m0"`` -> the strategy and its own SyncConfig overrides.

    Values are read as TOML (true, 3, 0.5, "int8"); a bare word that is not TOML is taken as a string.
    A plain strategy name has no overrides. Lets one run compare settings of a strategy side by side.
    Keys of :data:`NODE_KEYS` (``dreamddp:comm=process``) are node settings: see :func:`split_node_keys`.
    """
    strategy, _, spec = entry.partition(":")
    own: dict[str, Any] = {}
    for item in filter(None, spec.split(",")):
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise ValueError(f"strategy variant {entry!r}: expected key=value, got {item!r}")
        try:
            own[key.strip()] = tomllib.loads(f"v = {value.strip()}")["v"]
        except tomllib.TOMLDecodeError:
            own[key.strip()] = value.strip()
    return strategy, own


# variant keys that configure the node ([node] in a daemon's file), not the strategy's SyncConfig
NODE_KEYS = frozenset({"comm"})


def split_node_keys(own: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """A variant's overrides as (SyncConfig overrides, node config overrides)."""
    return {k: v for k, v in own.items() if k not in NODE_KEYS}, {k: v for k, v in own.items() if k in NODE_KEYS}


def _check_lm(
    names: list[str],
    variants: dict[str, tuple[str, dict[str, Any]]],
    extra: dict[str, Any],
    period: int,
    regions: int,
    workload: dict[str, Any],
    rtt_ms: float,
) -> None:
    """bench_lm's settings, each variant built once: a ValueError before anything starts."""
    steps, batch, eval_batches = workload["steps"], workload["batch"], workload["eval_batches"]
    context, width, heads = workload["context"], workload["width"], workload["heads"]
    if regions < 1 or steps < 1 or batch < 1 or eval_batches < 1 or context < 1:
        raise ValueError("regions, steps, batch, eval_batches and context must be >= 1")
    if width % heads:
        raise ValueError(f"width ({width}) must be a multiple of heads ({heads})")
    if rtt_ms < 0:
        raise ValueError(f"rtt_ms must be >= 0, got {rtt_ms}")
    if {"strategy", "period"} & set(extra):
        raise ValueError("give strategy and period as arguments, not in extra_sync")
    if not names:
        raise ValueError("no strategies to run")
    for strategy, own in variants.values():  # fail early on a bad name or knob
        if {"strategy", "period"} & set(own):
            raise ValueError("a variant may not set strategy or period")
        sync_own, node_own = split_node_keys(own)
        SyncConfig.from_dict({"strategy": strategy, "period": period, **extra, **sync_own})
        PeerConfig(node_id="check", **node_own)


def _run_strategy(
    name: str,
    variant: tuple[str, dict[str, Any]],
    period: int,
    extra: dict[str, Any],
    workload: dict[str, Any],
    regions: int,
    ns_ctx: Namespaces | None,
    transport: dict[str, Any],
    timeout: float,
    ceiling_sps: float,
) -> tuple[dict[str, Any], list[list[float]]]:
    """One strategy (or variant) on every region: its summary row and its held-out loss curve."""
    strategy, own = variant
    own, node_own = split_node_keys(own)
    args = {
        "strategy": strategy,
        "period": period,
        "extra_sync": {**extra, **own},
        "workload": workload,
        "wire_devs": [dev for _, dev in ns_ctx.devs] if ns_ctx is not None else [None] * regions,
        "wire_counter": "dev" if ns_ctx is not None and ns_ctx.emulator is not None else "tbf",
    }
    before = ns_ctx.tx_bytes() if ns_ctx is not None else None
    emu_before = ns_ctx.emulator_stats() if ns_ctx is not None and ns_ctx.emulator is not None else None
    t0 = time.perf_counter()
    res = run_local(
        regions,
        JOB,
        args,
        {"transport": transport, **node_own},
        timeout=timeout,
        node_job=True,
        hosts=ns_ctx.hosts if ns_ctx is not None else None,
    )
    total = time.perf_counter() - t0
    wire_run = None
    if ns_ctx is not None and before is not None:
        wire_run = [a - b for a, b in zip(ns_ctx.tx_bytes(), before, strict=True)]
    row = _summarize(res, workload["steps"], wire_run)
    if ns_ctx is not None and emu_before is not None:
        row["emulator"] = emulator_summary(stats_delta(ns_ctx.emulator_stats(), emu_before))
    row["compute_utilization"] = _r(row["steps_per_s"] / ceiling_sps, 3)
    row["run_s"] = _r(total, 1)
    log.info(
        "%s: %.3f steps/s (%.0f%% of ceiling), hidden %.2f, held-out loss %.4f, %.1f MB/region",
        name,
        row["steps_per_s"],
        100 * row["compute_utilization"],
        row["hidden_fraction"],
        row["heldout_loss"],
        row["mb_sent"],
    )
    return row, _region_curve(res)


def _ceiling_summary(
    ceiling_res: list[dict[str, Any]],
    ceiling_curve: list[list[float]],
    ceiling_sps: float,
    steps: int,
    target: float,
    rows: dict[str, dict[str, Any]],
) -> dict[str, Any]:
    """The report's ``ceiling`` entry, with the no-sync run's speed beside it when ``none`` ran."""
    ceiling = {
        "steps_per_s": _r(ceiling_sps),
        "steps_per_s_regions": [_r(steps / r["wall_s"]) for r in ceiling_res],
        "heldout_loss": _r(ceiling_curve[-1][2]),
        "heldout_loss_regions": [_r(r["heldout_loss"]) for r in ceiling_res],
        "train_loss_last10": _r(_mean([r["train_loss_last10"] for r in ceiling_res])),
        "train_cpu_s": _r(_mean([r["train_cpu_s"] for r in ceiling_res]), 3),
        "time_to_target_s": _r(_time_to(ceiling_curve, target), 3),
        "curve": [[s, _r(t, 3), _r(loss)] for s, t, loss in ceiling_curve],
    }
    if "none" in rows:
        ceiling["none_steps_per_s"] = rows["none"]["steps_per_s"]
        ceiling["none_utilization"] = rows["none"]["compute_utilization"]
    return ceiling


def _run_ceiling(regions: int, workload: dict[str, Any]) -> tuple[list[dict[str, Any]], list[list[float]], float]:
    """The plain processes without dreamp2p: their results, held-out loss curve and steps/s."""
    steps = workload["steps"]
    ceiling_res = run_ceiling(regions, workload, timeout=600.0 + 10.0 * steps)
    ceiling_curve = _region_curve(ceiling_res)
    ceiling_sps = _mean([steps / r["wall_s"] for r in ceiling_res])
    log.info("ceiling: %.3f steps/s, held-out loss %.4f", ceiling_sps, ceiling_curve[-1][2])
    return ceiling_res, ceiling_curve, ceiling_sps


def stats_delta(after: dict[str, Any], before: dict[str, Any]) -> dict[str, Any]:
    """The packet emulator's counters (`WanEmulator.stats`) between two readings, in the same form."""
    earlier = {(p["src"], p["dst"]): p for p in before["paths"]}
    paths = []
    for p in after["paths"]:
        b = earlier.get((p["src"], p["dst"]), {})
        paths.append({**p, **{k: v - b.get(k, 0) for k, v in p.items() if k not in ("src", "dst")}})
    scalars = ("cpu_s", "user_s", "sys_s", "wakeups")
    return {**after, "paths": paths, **{k: after[k] - before[k] for k in scalars}}


def _shaping(
    rate: str, netns: bool | None, rtt_ms: float, loss: float = 0.0, jitter_ms: float = 0.0, regions: int = 2
) -> tuple[float, str, dict[str, Any]]:
    """The link rate in bytes/s, how the links are emulated ("wanemu", "tbf" or "in-process": see the module
    docstring), and the [transport] table of the regions."""
    rate_Bps = parse_rate(rate)
    if not 0.0 <= loss < 1.0:
        raise ValueError(f"loss must be a fraction in [0, 1), got {loss}")
    if jitter_ms < 0:
        raise ValueError(f"jitter_ms must be >= 0, got {jitter_ms}")
    root = os.geteuid() == 0
    if netns and not root:
        raise ValueError("netns=True needs root (network namespaces, tc)")
    use_netns = root if netns is None else netns
    if not use_netns and (loss or jitter_ms):
        why = "netns=False" if root else "not root"
        raise ValueError(
            f"loss and jitter need the packet emulator (network namespaces, root); {why}: the links are "
            "emulated in process, which delays and paces but cannot lose or jitter packets"
        )
    if use_netns and regions >= 2 and (rtt_ms or loss or jitter_ms):
        return rate_Bps, "wanemu", {}  # the path delays the packets: no in-process delay
    transport: dict[str, Any] = {"delay_s": rtt_ms / 2000.0}
    if not use_netns:
        transport["rate_limit"] = rate_Bps
    return rate_Bps, "tbf" if use_netns else "in-process", transport


def _namespaces(
    shaping: str, regions: int, rate: str, rtt_ms: float, loss: float, jitter_ms: float
) -> Namespaces | None:
    """The regions' namespaces for ``shaping`` (not entered yet), or None in process."""
    if shaping == "in-process":
        return None
    if shaping == "tbf":
        return Namespaces(regions, rate)
    return Namespaces(regions, rate, rtt=rtt_ms / 1e3, jitter=jitter_ms / 1e3, loss=loss)


def _run_strategies(
    names: list[str],
    variants: dict[str, tuple[str, dict[str, Any]]],
    period: int,
    extra: dict[str, Any],
    workload: dict[str, Any],
    regions: int,
    net: Namespaces | None,
    transport: dict[str, Any],
    timeout: float,
    ceiling_sps: float,
    bracket: bool,
    rounds: int = 1,
) -> tuple[dict[str, dict[str, Any]], dict[str, list[list[float]]], list[float], dict[str, Any] | None]:
    """Every strategy in turn (in the namespaces ``net`` when given, entered here): rows and loss curves.

    ``ceiling_sps``: the ceiling measured before the first strategy; with ``bracket`` the ceiling runs again
    after each strategy and the strategy's utilization is against its two neighbours. With ``rounds`` > 1
    every strategy runs once per round, the order rotated each round (`rounds.round_order`), and its row
    and curve combine its rounds (`rounds.combine_rows`, `rounds.mean_curve`). Also returns every ceiling
    measured, in order, and the packet emulator's totals for the whole run (None without it).
    """
    ceilings = [ceiling_sps]
    runs: dict[str, list[tuple[dict[str, Any], list[list[float]]]]] = {name: [] for name in names}
    with contextlib.ExitStack() as stack:
        ns_ctx = stack.enter_context(net) if net is not None else None
        for k in range(rounds):
            for name in round_order(names, k):
                row, curve = _run_strategy(
                    name, variants[name], period, extra, workload, regions, ns_ctx, transport, timeout, ceilings[-1]
                )
                if bracket:
                    before = ceilings[-1]
                    ceilings.append(_run_ceiling(regions, workload)[2])
                    row.update(bracketed(row["steps_per_s"], before, ceilings[-1]))
                runs[name].append((row, curve))
    rows: dict[str, dict[str, Any]] = {}
    curves: dict[str, list[list[float]]] = {}
    for name, done in runs.items():
        rows[name], curves[name] = done[0] if rounds == 1 else _combined(done)
    emulator = emulator_summary(net.emulator_stats()) if net is not None and net.emulator is not None else None
    return rows, curves, ceilings, emulator


def _combined(done: list[tuple[dict[str, Any], list[list[float]]]]) -> tuple[dict[str, Any], list[list[float]]]:
    """One strategy's rounds as one row (means, each round under ``runs``) and their mean loss curve."""
    curve = mean_curve([c for _, c in done])
    row = combine_rows([r for r, _ in done])
    for key in AVERAGED:
        if row.get(key) is not None:
            row[key] = _r(row[key], 3 if key in ("compute_utilization", "hidden_fraction") else 4)
    row["curve"] = [[s, _r(t, 3), _r(loss)] for s, t, loss in curve]
    return row, curve


def _paired_report(rows: dict[str, dict[str, Any]], winner: str) -> dict[str, Any]:
    """The winner's compute utilization against every other syncing strategy's, round by round."""
    others = {}
    mine = [r["compute_utilization"] for r in rows[winner].get("runs", [rows[winner]])]
    for name, row in rows.items():
        if name in ("none", winner):
            continue
        theirs = [r["compute_utilization"] for r in row.get("runs", [row])]
        d = paired(mine, theirs)
        others[name] = {
            **d,
            "mean": _r(d["mean"], 4),
            "diffs": [_r(x, 4) for x in d["diffs"]],
            "stderr": _r(d["stderr"], 4) if d["stderr"] is not None else None,
            "ci95": [_r(x, 4) for x in d["ci95"]] if d["ci95"] is not None else None,
        }
    return {"figure": "compute_utilization", "winner": winner, "against": others}


def bracketed(steps_per_s: float, before: float, after: float) -> dict[str, Any]:
    """A strategy's utilization against the mean of the ceilings measured just before and after it."""
    if not (before > 0 and after > 0):
        raise ValueError(f"ceilings must be > 0 steps/s, got {before} and {after}")
    return {
        "ceiling_steps_per_s": [_r(before), _r(after)],
        "compute_utilization": _r(2.0 * steps_per_s / (before + after), 3),
    }


def _target(
    target_loss: float | None, curves: dict[str, list[list[float]]], ceiling_curve: list[list[float]]
) -> tuple[float, str]:
    """The held-out loss that time_to_target_s measures to, and where it came from."""
    if target_loss is None:
        reference = curves["none"][-1][2] if "none" in curves else ceiling_curve[-1][2]
        target = reference * TARGET_MARGIN
        target_from = "none" if "none" in curves else "ceiling"
    else:
        target, target_from = target_loss, "given"
    return target, target_from


def bench_lm(
    strategies: Sequence[str] | None = None,
    regions: int = 2,
    rate: str = "20mbit",
    rtt_ms: float = 0.0,
    loss: float = 0.0,
    jitter_ms: float = 0.0,
    steps: int = 200,
    period: int = 20,
    width: int = 256,
    layers: int = 4,
    heads: int = 4,
    context: int = 128,
    batch: int = 8,
    lr: float = 3e-4,
    eval_batches: int = 8,
    device: str = "cpu",
    netns: bool | None = None,
    extra_sync: dict[str, Any] | None = None,
    target_loss: float | None = None,
    bracket: bool = False,
    rounds: int = 1,
) -> dict[str, Any]:
    """Run the ceiling, then every strategy, on ``regions`` region processes; a JSON-serialisable report.

    ``netns``: None = namespaces when root (the packet emulator with ``rtt_ms``, ``loss`` or ``jitter_ms``,
    else tbf), else in-process shaping; True = namespaces (needs root); False = in-process shaping, which
    refuses ``loss`` and ``jitter_ms``. ``loss``: the fraction of packets lost per direction.
    ``extra_sync``: SyncConfig overrides for every strategy (not ``strategy`` or ``period``). ``bracket``:
    the ceiling again after every strategy (see the module docstring). ``rounds``: every strategy that many
    times, the order rotated each round; rows are means over the rounds and ``paired`` compares the winner
    with each other syncing strategy round by round. Invalid settings raise ValueError before anything starts.
    """
    names = list(strategies) if strategies is not None else list(STRATEGIES)
    variants = {name: parse_variant(name) for name in names}
    extra = dict(extra_sync or {})
    workload = {
        "steps": steps,
        "width": width,
        "layers": layers,
        "heads": heads,
        "context": context,
        "batch": batch,
        "lr": lr,
        "eval_batches": eval_batches,
        "device": device,
    }
    _check_lm(names, variants, extra, period, regions, workload, rtt_ms)
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    rate_Bps, shaping, transport = _shaping(rate, netns, rtt_ms, loss, jitter_ms, regions)
    params = count_params(width, layers, heads, context)
    # the slowest strategy (ssgd) moves about twice the model per step over the link
    timeout = 600.0 + steps * (2.0 * 4 * params / rate_Bps + 2.0 * rtt_ms / 1000.0 + 5.0)
    t_start = time.perf_counter()
    ceiling_res, ceiling_curve, ceiling_sps = _run_ceiling(regions, workload)
    net = _namespaces(shaping, regions, rate, rtt_ms, loss, jitter_ms)
    rows, curves, ceilings, emulator = _run_strategies(
        names, variants, period, extra, workload, regions, net, transport, timeout, ceiling_sps, bracket, rounds
    )
    target, target_from = _target(target_loss, curves, ceiling_curve)
    for name, curve in curves.items():
        rows[name]["time_to_target_s"] = _r(_time_to(curve, target), 3)
    syncing = [n for n in rows if n != "none"] or list(rows)
    winner = max(syncing, key=lambda n: rows[n]["steps_per_s"])
    ceiling = _ceiling_summary(ceiling_res, ceiling_curve, ceiling_sps, steps, target, rows)
    ceiling["steps_per_s_runs"] = [_r(c) for c in ceilings]
    return {
        "bench": "lm",
        "regions": regions,
        "rate": rate,
        "rtt_ms": float(rtt_ms),
        "loss": float(loss),
        "jitter_ms": float(jitter_ms),
        "steps": steps,
        "period": period,
        "params": params,
        "shaping": shaping,
        "emulator": emulator,
        "model": {"width": width, "layers": layers, "heads": heads, "context": context, "vocab": VOCAB},
        "batch": batch,
        "lr": lr,
        "device": device,
        "extra_sync": extra,
        "bracket": bracket,
        "rounds": rounds,
        "eval_every": eval_every(steps),
        "eval_tokens": eval_batches * batch * context,
        "target_loss": _r(target),
        "target_from": target_from,
        "ceiling": ceiling,
        "strategies": rows,
        "winner_steps_per_s": winner,
        "paired": _paired_report(rows, winner),
        "total_s": _r(time.perf_counter() - t_start, 1),
    }
