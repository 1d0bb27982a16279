"""`bench chaos`'s JSON report: the daemons' records and the injected faults, summed up (fields: docs/BENCHMARKS.md)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dreamp2p.devtools.bench.chaos.faults import Flapper, Injector, Span
from dreamp2p.devtools.bench.chaos.plan import (
    ChaosTiming,
    KillOutcome,
    counter_in_window,
    digests_agree,
    fault_recoveries,
    fault_summary,
    goodput,
    kill_outcomes,
    p50_max,
    p50_p99_max,
    rss_growth,
    split_lives,
    steps_per_s,
    view_rejoins,
)
from dreamp2p.devtools.bench.chaos.proc import Cluster, RecordTail

if TYPE_CHECKING:
    from dreamp2p.devtools.bench.chaos.run import ChaosRun, Phases

RSS_EVERY_S = 2.0


@dataclass(frozen=True)
class Off:
    """Why link flaps and partitions are off (None: on)."""

    flaps: str | None
    partitions: str | None


def _paths(run: ChaosRun) -> dict[str, Any]:
    """What carried the paths: the packet emulator (TCP sees the rtt, jitter and loss), else the rate per hop in
    tbf (namespaces) or in process (loopback) with the transport's in-process delay."""
    shaping = "wanemu" if run.emulated else "tbf or in-process"
    return {"shaping": shaping, "rate": run.rate, "rtt": run.rtt, "loss": run.loss, "jitter": run.jitter}


def chaos_report(
    run: ChaosRun,
    timing: ChaosTiming,
    cluster: Cluster,
    tail: RecordTail,
    ph: Phases,
    inj: Injector,
    flapper: Flapper,
    off: Off,
) -> dict[str, Any]:
    """The report of a finished run (``timing``: the one the chaos ran with, kinds the run could not make left out)."""
    lives = {m: split_lives(m, recs) for m, recs in tail.records.items()}
    every = [life for ls in lives.values() for life in ls]
    steps = [s for life in every for s in life.steps]
    base = steps_per_s(steps, *ph.baseline)
    pace = steps_per_s(steps, *ph.chaos)
    times = {m: [t for life in ls for t, _ in life.steps] for m, ls in lives.items()}
    outcomes = kill_outcomes(inj.kills, times, ph.chaos[1], timing.kill_every_s)
    kill_recs = [o.recovery_s for o in outcomes]
    recovered = [r for r in kill_recs if r is not None]
    fault_recs = fault_recoveries(inj.faults, times, inj.kills)
    views = {
        m: [(float(r["t"]), frozenset(r.get("live", ()))) for life in ls for r in life.peer] for m, ls in lives.items()
    }
    rejoins = view_rejoins(inj.faults, views, inj.kills)
    stops = {m: (ls[-1].stop if ls else None) for m, ls in lives.items()}
    digests = {m: (s or {}).get("digest") for m, s in stops.items()}
    stop_steps = sorted({s["step"] for s in stops.values() if s is not None})
    return {
        "minutes": run.minutes,
        "nodes": run.nodes,
        "min_step_s": run.min_step_s,
        "paths": _paths(run),
        **_timing(timing),
        "kills": len(inj.kills),
        "kills_survived": len(recovered),
        "restarts": inj.restarts,
        "rejoins": sum(1 for life in every if life.join and life.joined and life.steps),
        "crashes": ph.crashes,
        "recovery_s": p50_p99_max(recovered),
        "longest_step_gap_s": p50_max([o.longest_gap_s for o in outcomes]),
        "faults": fault_summary(timing.kinds, kill_recs, inj.faults, fault_recs, rejoins),
        "rounds_failed": sum(counter_in_window(life.peer, "rounds_failed", *ph.chaos) for life in every),
        "rounds_completed": sum(counter_in_window(life.peer, "rounds_completed", *ph.chaos) for life in every),
        "baseline_rounds_failed": sum(counter_in_window(life.peer, "rounds_failed", *ph.baseline) for life in every),
        "steps_per_s": {"fault_free": round(base, 3), "chaos": round(pace, 3)},
        "goodput": None if (g := goodput(pace, base)) is None else round(g, 4),
        "rss": _rss(cluster, ph.chaos),
        "flaps": {
            "on": off.flaps is None,
            "why_off": off.flaps,
            "count": len(flapper.done),
            "every_s": run.flap_every_s,
            "down_s": run.flap_down_s,
        },
        "partitions": {"on": off.partitions is None, "why_off": off.partitions},
        "healed_s": None if ph.healed_s is None else round(ph.healed_s, 1),
        "quiet_steps": run.quiet_steps,
        "final_step": ph.final_step,
        "stop_steps": stop_steps,
        "stop_codes": ph.stop_codes,
        "digests_equal": ph.final_step is not None and len(stop_steps) == 1 and digests_agree(digests),
        "distinct_digests": len({d for d in digests.values() if d is not None}),
        "digests": digests,
        # how each member's end-of-run flush made the replicas identical ("compressed": DreamDDP's own path,
        # taken only where every member's outer weights agreed); None where it did not flush
        "flushes": {m: (s or {}).get("flushed") for m, s in stops.items()},
        "kill_log": [
            {"t": round(k.t - ph.chaos[0], 1), "victim": k.victim, "recovery_s": _r(o.recovery_s)}
            for k, o in zip(inj.kills, outcomes, strict=True)
        ],
        "fault_log": fault_log(
            inj.spans,
            ph.chaos[0],
            outcomes,
            {(f.kind, f.start): r for f, r in zip(inj.faults, fault_recs, strict=True)},
            {(f.kind, f.start): r for f, r in zip(inj.faults, rejoins, strict=True)},
        ),
    }


def _timing(t: ChaosTiming) -> dict[str, Any]:
    return {
        "kinds": list(t.kinds),
        "kill_every_s": t.kill_every_s,
        "down_s": [t.down_min_s, t.down_max_s],
        "max_down": t.max_down,
        "stop_s": [t.stop_min_s, t.stop_max_s],
        "long_stop_p": t.long_stop_p,
        "long_stop_max_s": t.long_stop_max_s,
        "partition_s": [t.partition_min_s, t.partition_max_s],
        "oneway_p": t.oneway_p,
    }


def fault_log(
    spans: Sequence[Span],
    t0: float,
    kill_outcomes: Sequence[KillOutcome],
    recoveries: Mapping[tuple[str, float], float | None],
    rejoins: Mapping[tuple[str, float], float | None] | None = None,
) -> list[dict[str, Any]]:
    """Every injected fault in order: kind, members, start and end (seconds into the chaos; end None if it never
    ended), one-way (partitions), recovery (kills: in the order of ``kill_outcomes``; the others by (kind, start)),
    and for stops and partitions the time until the ring was whole again (``rejoins``, by (kind, start))."""
    kills = iter(kill_outcomes)
    out = []
    for s in spans:
        rec = next(kills).recovery_s if s.kind == "kill" else recoveries.get((s.kind, s.start))
        entry: dict[str, Any] = {
            "kind": s.kind,
            "members": list(s.members),
            "t": round(s.start - t0, 1),
            "end": None if s.end is None else round(s.end - t0, 1),
            "recovery_s": _r(rec),
        }
        if s.kind == "partition":
            entry["oneway"] = s.oneway
        if s.kind != "kill" and rejoins is not None:
            entry["rejoin_s"] = _r(rejoins.get((s.kind, s.start)))
        out.append(entry)
    return out


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 3)


def _rss(cluster: Cluster, window: tuple[float, float]) -> dict[str, Any]:
    """RSS growth over the chaos phase of each daemon that lived through all of it."""
    t0, t1 = window
    per: dict[str, float] = {}
    ends: list[int] = []
    for member, pids in cluster.lives.items():
        for pid in pids:
            samples = [s for s in cluster.rss[pid].samples if t0 - RSS_EVERY_S <= s[0] <= t1 + RSS_EVERY_S]
            if not samples or samples[0][0] > t0 + 2 * RSS_EVERY_S or samples[-1][0] < t1 - 2 * RSS_EVERY_S:
                continue  # started or ended inside the chaos phase
            growth = rss_growth(samples, warm_fraction=0.0)
            if growth is not None:
                per[member] = round(growth, 4)
                ends.append(samples[-1][1])
    return {
        "growth_max": max(per.values(), default=None),
        "per_daemon": per,
        "end_MB_max": round(max(ends) / 1e6, 1) if ends else None,
    }
