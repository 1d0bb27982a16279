"""`dreamp2p bench chaos`: real node daemons trained through SIGKILLs, rejoins and link flaps; one JSON report.

N `dreamp2p node` daemons (5 by default) train the byte-level LM with DreamDDP. After every member has
started training, the run has four phases, all in one command:

1. fault-free: after a settling tenth of it (30 s at most), ``minutes`` of training with nothing
   injected, the pace the chaos is measured against;
2. chaos: ``minutes`` in which a random member is killed with SIGKILL about every ``kill_every_s``
   (never more than ``max_down`` down at once, the first member never: its RSS is tracked) and restarted
   with ``--join`` after a random ``down_min_s``..``down_max_s``; as root, the members also sit in two
   network namespaces joined by a tbf-shaped veth pair, and that link goes down for ``flap_down_s`` every
   ``flap_every_s`` (the first half a period in), splitting the cluster in two meanwhile;
3. heal: the last killed members come back; every member must see all N alive;
4. quiet stop: every member stops after the same step, the last ``quiet_steps`` at learning rate 0
   (``dreamp2p node --quiet-steps``), and their parameter digests (the STOP records) must all be equal.

Everything is read from the daemons' ``metrics.jsonl`` (STEP, PEER, JOIN, STOP records); the report's
arithmetic is in `dreamp2p.devtools.bench.chaos.plan`, the processes in `dreamp2p.devtools.bench.chaos.proc`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dreamp2p.config import parse_duration, parse_rate
from dreamp2p.devtools.bench.chaos.plan import (
    ChaosTiming,
    Kill,
    KillSchedule,
    counter_in_window,
    digests_agree,
    flap_times,
    goodput,
    kill_outcomes,
    p50_max,
    rss_growth,
    split_lives,
    steps_per_s,
)
from dreamp2p.devtools.bench.chaos.proc import Cluster, RecordTail
from dreamp2p.devtools.localrun import NAMES, wait_started, write_configs

log = logging.getLogger(__name__)

POLL_S = 0.25
RSS_EVERY_S = 2.0


@dataclass(frozen=True)
class ChaosRun:
    """What `bench chaos` runs; the defaults are the acceptance run's (issue 14)."""

    minutes: float = 10.0  # of the fault-free phase, and again of the chaos phase
    nodes: int = 5
    timing: ChaosTiming = field(default_factory=lambda: ChaosTiming(protected=frozenset({NAMES[0]})))
    flaps: bool = True  # link flaps (root only: network namespaces)
    flap_every_s: float = 180.0
    flap_down_s: float = 10.0
    rate: str = "50mbit"  # per hop: paced in process on loopback, tbf on the namespaces' link
    rtt: str = "4ms"
    period: int = 5
    max_delay: int | None = None  # None: period - 1
    dim: int = 64
    layers: int = 2
    seed: int = 0
    run_dir: str | None = None  # None: a temporary folder, removed after a run that passed its checks
    startup_timeout_s: float = 300.0
    heal_timeout_s: float = 300.0
    stop_timeout_s: float = 300.0

    def __post_init__(self) -> None:
        if not 2 <= self.nodes <= len(NAMES):
            raise ValueError(f"nodes must be in 2..{len(NAMES)}, got {self.nodes}")
        if self.timing.max_down >= self.nodes:
            raise ValueError(f"max_down ({self.timing.max_down}) must leave a member up of {self.nodes}")
        if not self.minutes > 0:
            raise ValueError(f"minutes must be > 0, got {self.minutes}")

    @property
    def delay(self) -> int:
        return self.period - 1 if self.max_delay is None else self.max_delay

    @property
    def quiet_steps(self) -> int:
        # every layer syncs once a period and lands up to `delay` later; pseudo-gradient syncs keep each
        # member's outer weights, so the next check (every 4th period) and the anchor it calls for in the
        # period after must fall inside: six periods
        return 6 * self.period + self.delay + 1


def _flaps_off_reason(run: ChaosRun) -> str | None:
    if not run.flaps:
        return "disabled (--no-flaps)"
    if os.geteuid() != 0:
        return "not root: network namespaces need root"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "ip or tc (iproute2) not found"
    return None


class Flapper:
    """Takes the namespaces' veth link down for ``down_s`` at each of ``times`` (seconds from ``t0``)."""

    def __init__(self, ns: Any, times: list[float], down_s: float) -> None:
        self.ns = ns
        self.times = list(times)
        self.down_s = down_s
        self.up_at: float | None = None
        self.done: list[float] = []  # wall times the link went down

    def _set(self, state: str) -> None:
        name, dev = self.ns.devs[0]
        subprocess.run(["ip", "-n", name, "link", "set", "dev", dev, state], check=True, timeout=30)

    def poll(self, since_start: float) -> None:
        if self.ns is None:
            return
        if self.up_at is not None and since_start >= self.up_at:
            self._set("up")
            self.up_at = None
        elif self.up_at is None and self.times and since_start >= self.times[0]:
            self.times.pop(0)
            self._set("down")
            self.done.append(time.time())
            self.up_at = since_start + self.down_s
            log.info("link flap: %s down for %.0f s", self.ns.devs[0][1], self.down_s)

    def end(self) -> None:
        """The link is up again (a flap under way ends now); no more flaps."""
        self.times = []
        if self.ns is not None and self.up_at is not None:
            self._set("up")
            self.up_at = None


@contextlib.contextmanager
def _network(run: ChaosRun, off: str | None) -> Iterator[tuple[Any, list[str | None], list[str] | None]]:
    """(namespaces or None, namespace per member, address per member or None for loopback)."""
    if off is not None:
        yield None, [None] * run.nodes, None
        return
    from dreamp2p.devtools.netns import Namespaces

    with Namespaces(2, run.rate) as ns:
        half = (run.nodes + 1) // 2  # the first half in one namespace, the rest in the other
        sides = [ns.hosts[0 if i < half else 1] for i in range(run.nodes)]
        yield ns, [s[0] for s in sides], [s[1] for s in sides]


def _configs(run: ChaosRun, run_dir: Path, hosts: list[str] | None) -> list[Path]:
    sync = {
        "strategy": "dreamddp",
        "period": run.period,
        "max_delay": run.delay,
        "warmup_steps": 5,
        "control_every": 20,
        "codec": "int8",
    }
    task = {
        "steps": 100_000_000,
        "batch": 8,
        "context": 32,
        "dim": run.dim,
        "layers": run.layers,
        "heads": 2,
        "eval_every": 1000,
        "max_corpus_bytes": 1 << 20,
    }
    paths = write_configs(
        run_dir,
        run.nodes,
        rate_Bps=None if hosts else parse_rate(run.rate),
        delay_s=parse_duration(run.rtt) / 2,
        sync=sync,
        task=task,
        checkpoint_every=1000,
        metrics=False,
        hosts=hosts,
    )
    for path in paths:  # killed members never finish a round: a short grace at the final stop
        path.write_text("stop_grace_s = 5\n" + path.read_text())
    return paths


def bench_chaos(run: ChaosRun) -> dict[str, Any]:
    """Run the phases in the module docstring; the report (see docs/BENCHMARKS.md for each field)."""
    off = _flaps_off_reason(run)
    made = run.run_dir is None
    run_dir = Path(run.run_dir or tempfile.mkdtemp(prefix="dreamp2p-chaos-")).resolve()
    members = NAMES[: run.nodes]
    with _network(run, off) as (ns, netns, hosts):
        configs = dict(zip(members, _configs(run, run_dir, hosts), strict=True))
        cluster = Cluster(
            configs, run_dir, run_dir / "stop_at", run.quiet_steps, dict(zip(members, netns, strict=True))
        )
        tail = RecordTail(run_dir, members)
        flapper = Flapper(ns, flap_times(run.minutes * 60, run.flap_every_s, run.flap_down_s), run.flap_down_s)
        try:
            for m in members:
                cluster.start(m)
            wait_started(cluster.procs, run_dir, run.startup_timeout_s, interval=POLL_S)
            phases = _run_phases(run, cluster, tail, flapper)
        finally:
            flapper.end()
            cluster.stop_all()
    tail.poll()
    report = _report(run, cluster, tail, phases, flapper, off)
    report["run_dir"] = None if made and report["digests_equal"] else str(run_dir)
    if made and report["digests_equal"]:
        shutil.rmtree(run_dir, ignore_errors=True)
    return report


@dataclass
class Phases:
    baseline: tuple[float, float] = (0.0, 0.0)
    chaos: tuple[float, float] = (0.0, 0.0)
    kills: list[Kill] = field(default_factory=list)
    restarts: int = 0
    crashes: list[str] = field(default_factory=list)
    healed_s: float | None = None  # from the chaos's end until every member saw all alive
    final_step: int | None = None
    stop_codes: dict[str, int | None] = field(default_factory=dict)


def _run_phases(run: ChaosRun, cluster: Cluster, tail: RecordTail, flapper: Flapper) -> Phases:
    ph = Phases()
    seconds = run.minutes * 60
    _watch(cluster, tail, time.time() + min(30.0, 0.1 * seconds), ph)  # past warm-up and the first plan
    t0 = time.time()
    log.info("fault-free phase: %.1f min", run.minutes)
    _watch(cluster, tail, t0 + seconds, ph)
    ph.baseline = (t0, time.time())
    if ph.crashes:
        raise RuntimeError(f"daemon(s) {', '.join(ph.crashes)} exited in the fault-free phase; see {cluster.run_dir}")
    schedule = KillSchedule(run.timing, list(cluster.configs), random.Random(run.seed), time.time())
    t1 = time.time()
    log.info("chaos phase: %.1f min", run.minutes)
    _watch(cluster, tail, t1 + seconds, ph, schedule, flapper)
    ph.chaos = (t1, time.time())
    flapper.end()
    log.info("chaos over after %d kills: waiting for every member to be back", len(ph.kills))
    try:
        _heal(run, cluster, tail, schedule, ph)
    except TimeoutError as exc:
        log.warning("%s", exc)
        return ph  # no quiet stop: the digests are not compared
    _quiet_stop(run, cluster, tail, ph)
    return ph


def _act(cluster: Cluster, tail: RecordTail, schedule: KillSchedule, ph: Phases, killing: bool) -> None:
    """One poll: notice crashes (restarted like kills), then do what the schedule says is due."""
    now = time.time()
    for member in cluster.crashed():
        cluster.note_crash(member)
        ph.crashes.append(member)
        schedule.restart_at[member] = now + schedule.timing.down_min_s
    training = cluster.training(tail)
    for action in schedule.due(now, training, killing=killing):
        if action.kind == "restart":
            cluster.start(action.member, join=True)
            ph.restarts += 1
        else:
            t = cluster.kill(action.member)
            ph.kills.append(Kill(t, action.member, tuple(sorted(training - {action.member}))))


def _watch(
    cluster: Cluster,
    tail: RecordTail,
    until: float,
    ph: Phases,
    schedule: KillSchedule | None = None,
    flapper: Flapper | None = None,
) -> None:
    """Poll until ``until``: records, RSS, crashes; with a schedule also kills, restarts and flaps."""
    start = time.time()
    next_rss = start
    while (now := time.time()) < until:
        tail.poll()
        if schedule is not None:
            _act(cluster, tail, schedule, ph, killing=True)
        else:
            for member in cluster.crashed():
                cluster.note_crash(member)
                ph.crashes.append(member)
        if flapper is not None:
            flapper.poll(now - start)
        if now >= next_rss:
            cluster.sample_rss()
            next_rss += RSS_EVERY_S
        time.sleep(POLL_S)


def _heal(run: ChaosRun, cluster: Cluster, tail: RecordTail, schedule: KillSchedule, ph: Phases) -> None:
    """Restart the members still down, then wait until every member sees all of them alive."""
    start = time.time()
    deadline = start + run.heal_timeout_s
    n = len(cluster.configs)
    while True:
        tail.poll()
        _act(cluster, tail, schedule, ph, killing=False)
        training = cluster.training(tail)
        if not schedule.restart_at and len(training) == n and all(v == n for v in tail.live.values()):
            ph.healed_s = time.time() - start
            return
        if time.time() > deadline:
            raise TimeoutError(
                f"not healed {run.heal_timeout_s:g} s after the chaos: training {sorted(training)}, "
                f"members seen alive {tail.live}; see {cluster.run_dir}"
            )
        cluster.sample_rss()
        time.sleep(POLL_S)


def _quiet_stop(run: ChaosRun, cluster: Cluster, tail: RecordTail, ph: Phases) -> None:
    """Every member stops after the same step, the last ``quiet_steps`` at learning rate 0."""
    tail.poll()
    # the daemons read the stop file every 5 steps: 20 steps of margin before the quiet stretch begins
    final = max(tail.last_step.values()) + run.quiet_steps + 20
    cluster.stop_file.write_text(str(final))
    ph.final_step = final
    log.info("healed: every member stops after step %d, the last %d at learning rate 0", final, run.quiet_steps)
    deadline = time.time() + run.stop_timeout_s
    for member, p in cluster.procs.items():
        try:
            ph.stop_codes[member] = p.wait(max(1.0, deadline - time.time()))
        except subprocess.TimeoutExpired:
            ph.stop_codes[member] = None
            log.warning("%s did not stop within %.0f s of step %d", member, run.stop_timeout_s, final)


def _report(
    run: ChaosRun, cluster: Cluster, tail: RecordTail, ph: Phases, flapper: Flapper, off: str | None
) -> dict[str, Any]:
    lives = {m: split_lives(m, recs) for m, recs in tail.records.items()}
    every = [life for ls in lives.values() for life in ls]
    steps = [s for life in every for s in life.steps]
    base = steps_per_s(steps, *ph.baseline)
    pace = steps_per_s(steps, *ph.chaos)
    times = {m: [t for life in ls for t, _ in life.steps] for m, ls in lives.items()}
    outcomes = kill_outcomes(ph.kills, times, ph.chaos[1], run.timing.kill_every_s)
    recovered = [o.recovery_s for o in outcomes if o.recovery_s is not None]
    stops = {m: (ls[-1].stop if ls else None) for m, ls in lives.items()}
    digests = {m: (s or {}).get("digest") for m, s in stops.items()}
    stop_steps = sorted({s["step"] for s in stops.values() if s is not None})
    return {
        "minutes": run.minutes,
        "nodes": run.nodes,
        "kill_every_s": run.timing.kill_every_s,
        "down_s": [run.timing.down_min_s, run.timing.down_max_s],
        "max_down": run.timing.max_down,
        "kills": len(ph.kills),
        "kills_survived": len(recovered),
        "restarts": ph.restarts,
        "rejoins": sum(1 for life in every if life.join and life.joined and life.steps),
        "crashes": ph.crashes,
        "recovery_s": p50_max(recovered),
        "longest_step_gap_s": p50_max([o.longest_gap_s for o in outcomes]),
        "rounds_failed": sum(counter_in_window(life.peer, "rounds_failed", *ph.chaos) for life in every),
        "rounds_completed": sum(counter_in_window(life.peer, "rounds_completed", *ph.chaos) for life in every),
        "baseline_rounds_failed": sum(counter_in_window(life.peer, "rounds_failed", *ph.baseline) for life in every),
        "steps_per_s": {"fault_free": round(base, 3), "chaos": round(pace, 3)},
        "goodput": None if (g := goodput(pace, base)) is None else round(g, 4),
        "rss": _rss(cluster, ph.chaos),
        "flaps": {
            "on": off is None,
            "why_off": off,
            "count": len(flapper.done),
            "every_s": run.flap_every_s,
            "down_s": run.flap_down_s,
        },
        "healed_s": None if ph.healed_s is None else round(ph.healed_s, 1),
        "quiet_steps": run.quiet_steps,
        "final_step": ph.final_step,
        "stop_steps": stop_steps,
        "stop_codes": ph.stop_codes,
        "digests_equal": ph.final_step is not None and len(stop_steps) == 1 and digests_agree(digests),
        "digests": digests,
        "kill_log": [
            {"t": round(k.t - ph.chaos[0], 1), "victim": k.victim, "recovery_s": _r(o.recovery_s)}
            for k, o in zip(ph.kills, outcomes, strict=True)
        ],
    }


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
