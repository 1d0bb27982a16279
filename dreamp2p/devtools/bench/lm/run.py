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

Regions and links (``shaping`` in the report): as root each region in a network namespace of its own,
joined by the packet emulator ("wanemu") or by tbf-shaped links ("tbf"), else the transport's in-process
shaping ("in-process"); how each is chosen and set up is in `dreamp2p.devtools.bench.lm.links`.

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
import time
import tomllib
from collections.abc import Sequence
from typing import Any

from dreamp2p.config import PeerConfig
from dreamp2p.config.sync import STRATEGIES, SyncConfig
from dreamp2p.devtools.bench.lm.links import choose_shaping, make_namespaces, stats_delta
from dreamp2p.devtools.bench.lm.report import (
    bracketed,
    combined,
    mean,
    region_curve,
    results,
    rounded,
    summarize,
)
from dreamp2p.devtools.bench.lm.rounds import round_order
from dreamp2p.devtools.bench.lm.speeds import parse_slow
from dreamp2p.devtools.bench.lm.work import JOB, VOCAB, count_params, eval_every, run_ceiling
from dreamp2p.devtools.launch import run_local
from dreamp2p.devtools.netns import Namespaces
from dreamp2p.devtools.wanemu import summary as emulator_summary

log = logging.getLogger(__name__)


def parse_variant(entry: str) -> tuple[str, dict[str, Any]]:
    """``"dreamddp:error_feedback=true,delta_codec=e3m0"`` -> the strategy and its own SyncConfig overrides.

    Values are read as TOML (true, 3, 0.5, "int8", ["int2", "topk"]: commas inside brackets belong to the
    value); a bare word that is not TOML is taken as a string.
    A plain strategy name has no overrides. Lets one run compare settings of a strategy side by side.
    Keys of :data:`NODE_KEYS` (``dreamddp:comm=process``) are node settings: see :func:`split_node_keys`.
    """
    strategy, _, spec = entry.partition(":")
    own: dict[str, Any] = {}
    for item in filter(None, _top_level_items(spec)):
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise ValueError(f"strategy variant {entry!r}: expected key=value, got {item!r}")
        try:
            own[key.strip()] = tomllib.loads(f"v = {value.strip()}")["v"]
        except tomllib.TOMLDecodeError:
            own[key.strip()] = value.strip()
    return strategy, own


def _top_level_items(spec: str) -> list[str]:
    """``spec`` split at the commas outside square brackets."""
    items: list[str] = []
    depth = start = 0
    for i, ch in enumerate(spec):
        depth += (ch == "[") - (ch == "]")
        if ch == "," and depth == 0:
            items.append(spec[start:i])
            start = i + 1
    return [*items, spec[start:]]


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
    if workload["device"] != "cpu" and min(workload["speeds"]) < 1.0:
        raise ValueError("--slow throttles a trainer's CPU time: regions on cpu only")
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
    row = summarize(res, workload["steps"], wire_run)
    if ns_ctx is not None and emu_before is not None:
        row["emulator"] = emulator_summary(stats_delta(ns_ctx.emulator_stats(), emu_before))
    row["compute_utilization"] = rounded(row["steps_per_s"] / ceiling_sps, 3)
    row["run_s"] = rounded(total, 1)
    log.info(
        "%s: %.3f steps/s (%.0f%% of ceiling), hidden %.2f, held-out loss %.4f, %.1f MB/region",
        name,
        row["steps_per_s"],
        100 * row["compute_utilization"],
        row["hidden_fraction"],
        row["heldout_loss"],
        row["mb_sent"],
    )
    return row, region_curve(res)


def _run_ceiling(regions: int, workload: dict[str, Any]) -> tuple[list[dict[str, Any]], list[list[float]], float]:
    """The plain processes without dreamp2p: their results, held-out loss curve and steps/s."""
    steps = workload["steps"]
    ceiling_res = run_ceiling(regions, workload, timeout=600.0 + 10.0 * steps)
    ceiling_curve = region_curve(ceiling_res)
    ceiling_sps = mean([steps / r["wall_s"] for r in ceiling_res])
    log.info("ceiling: %.3f steps/s, held-out loss %.4f", ceiling_sps, ceiling_curve[-1][2])
    return ceiling_res, ceiling_curve, ceiling_sps


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
        rows[name], curves[name] = done[0] if rounds == 1 else combined(done)
    emulator = emulator_summary(net.emulator_stats()) if net is not None and net.emulator is not None else None
    return rows, curves, ceilings, emulator


def _workload(
    steps: int,
    width: int,
    layers: int,
    heads: int,
    context: int,
    batch: int,
    lr: float,
    eval_batches: int,
    device: str,
    speeds: Sequence[float],
) -> dict[str, Any]:
    """What every region process (and the ceiling) trains: the ``workload`` of `lm.work`'s jobs."""
    return {
        "speeds": list(speeds),
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
    slow: Sequence[str] = (),
) -> dict[str, Any]:
    """Run the ceiling, then every strategy, on ``regions`` region processes; a JSON-serialisable report.

    ``netns``: None = namespaces when root (the packet emulator with ``rtt_ms``, ``loss`` or ``jitter_ms``,
    else tbf), else in-process shaping; True = namespaces (needs root); False = in-process shaping, which
    refuses ``loss`` and ``jitter_ms``. ``loss``: the fraction of packets lost per direction.
    ``extra_sync``: SyncConfig overrides for every strategy (not ``strategy`` or ``period``). ``bracket``:
    the ceiling again after every strategy (see the module docstring). ``rounds``: every strategy that many
    times, the order rotated each round; rows are means over the rounds and ``paired`` compares the winner
    with each other syncing strategy round by round. ``slow``: ``REGION=FACTOR`` items, regions whose trainers
    run at that fraction of their pace (`lm.speeds`; the ceiling's too). Invalid settings raise ValueError
    before anything starts.
    """
    names = list(strategies) if strategies is not None else list(STRATEGIES)
    variants = {name: parse_variant(name) for name in names}
    extra = dict(extra_sync or {})
    speeds = parse_slow(slow, regions)
    workload = _workload(steps, width, layers, heads, context, batch, lr, eval_batches, device, speeds)
    _check_lm(names, variants, extra, period, regions, workload, rtt_ms)
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    rate_Bps, shaping, transport = choose_shaping(rate, netns, rtt_ms, loss, jitter_ms, regions)
    params = count_params(width, layers, heads, context)
    # the slowest strategy (ssgd) moves about twice the model per step over the link
    timeout = 600.0 + steps * (2.0 * 4 * params / rate_Bps + 2.0 * rtt_ms / 1000.0 + 5.0)
    t_start = time.perf_counter()
    ceiling_res, ceiling_curve, ceiling_sps = _run_ceiling(regions, workload)
    net = make_namespaces(shaping, regions, rate, rtt_ms, loss, jitter_ms)
    rows, curves, ceilings, emulator = _run_strategies(
        names, variants, period, extra, workload, regions, net, transport, timeout, ceiling_sps, bracket, rounds
    )
    measured = results(rows, curves, ceiling_res, ceiling_curve, ceiling_sps, ceilings, steps, target_loss)
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
        "speeds": list(speeds),
        "extra_sync": extra,
        "bracket": bracket,
        "rounds": rounds,
        "eval_every": eval_every(steps),
        "eval_tokens": eval_batches * batch * context,
        **measured,  # target_loss, target_from, ceiling, strategies, winner_steps_per_s, paired
        "total_s": rounded(time.perf_counter() - t_start, 1),
    }
