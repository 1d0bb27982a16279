"""`dreamp2p bench chaos`: real node daemons trained through faults injected at random; one JSON report.

N `dreamp2p node` daemons (5 by default) train the byte-level LM with DreamDDP. After every member has
started training, the run has four phases, all in one command:

1. fault-free: after a settling tenth of it (30 s at most), ``minutes`` of training with nothing
   injected, the pace the chaos is measured against;
2. chaos: ``minutes`` in which a fault falls due about every ``kill_every_s``, its kind drawn among
   ``timing.kinds`` (`dreamp2p.devtools.bench.chaos.plan.FaultSchedule`): a SIGKILL (restarted with ``--join``
   after a random ``down_min_s``..``down_max_s``), a SIGSTOP freeze (SIGCONT after a while, now and then
   minutes later), or a partition (a minority group cut off from the rest, both ways or one way), never more
   than ``max_down`` members under a fault at once, the first member never (its RSS is tracked). As root each
   member sits in its own network namespace, tbf-shaped links through a hub (`dreamp2p.devtools.netns`), so
   any group can be cut off, and every ``flap_every_s`` (the first half a period in) the cluster is cut in
   two halves for ``flap_down_s`` (a link flap); without root there are neither partitions nor flaps;
3. heal: freezes and the partition end, the last killed members come back; every member must see all N alive;
4. quiet stop: every member stops after the same step, the last ``quiet_steps`` at learning rate 0
   (``dreamp2p node --quiet-steps``), then flushes (``[train] flush_at_end``), and their parameter digests
   (the STOP records) must all be equal.

Everything is read from the daemons' ``metrics.jsonl`` (STEP, PEER, JOIN, STOP records); the schedule and the
report's arithmetic are in `dreamp2p.devtools.bench.chaos.plan`, the processes in
`dreamp2p.devtools.bench.chaos.proc`, the faults' injection in `dreamp2p.devtools.bench.chaos.faults`, the
report in `dreamp2p.devtools.bench.chaos.report`.
"""

from __future__ import annotations

import contextlib
import dataclasses
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
from dreamp2p.config.train import MAX_MIN_STEP_S
from dreamp2p.devtools.bench.chaos.faults import Flapper, Injector
from dreamp2p.devtools.bench.chaos.plan import FAULT_KINDS, ChaosTiming, FaultSchedule, flap_times
from dreamp2p.devtools.bench.chaos.proc import Cluster, RecordTail
from dreamp2p.devtools.bench.chaos.report import RSS_EVERY_S, Off, chaos_report
from dreamp2p.devtools.localrun import NAMES, wait_started, write_configs

log = logging.getLogger(__name__)

POLL_S = 0.25


@dataclass(frozen=True)
class ChaosRun:
    """What `bench chaos` runs; the defaults are the acceptance run's (issue 14)."""

    minutes: float = 10.0  # of the fault-free phase, and again of the chaos phase
    nodes: int = 5
    timing: ChaosTiming = field(
        default_factory=lambda: ChaosTiming(protected=frozenset({NAMES[0]}), kinds=FAULT_KINDS)
    )  # partitions only where flaps can be (root)
    flaps: bool = True  # link flaps (root only: network namespaces)
    flap_every_s: float = 180.0
    flap_down_s: float = 10.0
    rate: str = "50mbit"  # per hop: paced in process on loopback, tbf on each namespace's link
    rtt: str = "4ms"  # the transport's in-process delay line; the packet emulator's path RTT when emulated
    # either above 0: every path goes through the packet emulator (root), which carries rate and rtt too
    loss: float = 0.0
    jitter: str = "0ms"
    period: int = 5
    max_delay: int | None = None  # None: period - 1
    dim: int = 64
    layers: int = 2
    seed: int = 0
    # each daemon's step takes at least this long ([train] min_step_s; 0: as fast as it can). Five daemons
    # of the default model on a 2-core box each want a core: a floor shares the cores out evenly
    min_step_s: float = 0.0
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
        if not 0 <= self.min_step_s < MAX_MIN_STEP_S:
            raise ValueError(f"min_step_s must be in [0, {MAX_MIN_STEP_S:g}) seconds, got {self.min_step_s}")

    @property
    def emulated(self) -> bool:
        """Whether the paths go through the packet emulator (TCP sees the RTT, the jitter and the losses)."""
        return self.loss > 0 or parse_duration(self.jitter) > 0

    @property
    def delay(self) -> int:
        return self.period - 1 if self.max_delay is None else self.max_delay

    @property
    def quiet_steps(self) -> int:
        # every layer syncs once a period and lands up to `delay` later; pseudo-gradient syncs keep each
        # member's outer weights, so the next check (every 4th period) and the anchor it calls for in the
        # period after must fall inside: six periods
        return 6 * self.period + self.delay + 1


def _net_missing() -> str | None:
    """Why network namespaces cannot be made here (None: they can)."""
    if os.geteuid() != 0:
        return "not root: network namespaces need root"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "ip or tc (iproute2) not found"
    return None


def off_reasons(run: ChaosRun, net_missing: str | None) -> Off:
    """Why link flaps and partitions are off in this run (None: on), given why namespaces cannot be made."""
    flaps = "disabled (--no-flaps)" if not run.flaps else net_missing
    if "partition" not in run.timing.kinds:
        partitions: str | None = "not in --kinds"
    elif net_missing is not None:
        partitions = net_missing
    elif run.nodes < 3:
        partitions = "no minority group to cut off: needs 3 members or more"
    else:
        partitions = None
    return Off(flaps, partitions)


def run_timing(timing: ChaosTiming, off: Off) -> ChaosTiming:
    """The timing the chaos runs with: without partitions when they are off."""
    if off.partitions is None or "partition" not in timing.kinds:
        return timing
    return dataclasses.replace(timing, kinds=tuple(k for k in timing.kinds if k != "partition"))


@contextlib.contextmanager
def _network(run: ChaosRun, off: Off) -> Iterator[tuple[Any, list[str | None], list[str] | None]]:
    """(namespaces or None, namespace per member, address per member or None for loopback).

    Namespaces (one per member) when flaps or partitions are on or the paths are emulated, loopback otherwise."""
    if run.emulated and (missing := _net_missing()) is not None:
        raise ValueError(f"--loss/--jitter go through the packet emulator, which cannot run here: {missing}")
    if off.flaps is not None and off.partitions is not None and not run.emulated:
        yield None, [None] * run.nodes, None
        return
    from dreamp2p.devtools.netns import Namespaces

    made = (
        Namespaces(run.nodes, run.rate, rtt=run.rtt, loss=run.loss, jitter=run.jitter)
        if run.emulated
        else Namespaces(run.nodes, run.rate)
    )
    with made as ns:
        yield ns, [h[0] for h in ns.hosts], [h[1] for h in ns.hosts]


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
        delay_s=0.0 if run.emulated else parse_duration(run.rtt) / 2,
        sync=sync,
        task=task,
        checkpoint_every=1000,
        metrics=False,
        hosts=hosts,
        train={"min_step_s": run.min_step_s} if run.min_step_s else None,
    )
    for path in paths:  # killed members never finish a round: a short grace at the final stop
        path.write_text("stop_grace_s = 5\n" + path.read_text())
    return paths


def bench_chaos(run: ChaosRun) -> dict[str, Any]:
    """Run the phases in the module docstring; the report (see docs/BENCHMARKS.md for each field)."""
    off = off_reasons(run, _net_missing())
    timing = run_timing(run.timing, off)
    if timing.kinds != run.timing.kinds:
        log.warning("partitions off: %s; faults: %s", off.partitions, ", ".join(timing.kinds) or "none")
    made = run.run_dir is None
    run_dir = Path(run.run_dir or tempfile.mkdtemp(prefix="dreamp2p-chaos-")).resolve()
    members = NAMES[: run.nodes]
    with _network(run, off) as (ns, netns, hosts):
        configs = dict(zip(members, _configs(run, run_dir, hosts), strict=True))
        cluster = Cluster(
            configs, run_dir, run_dir / "stop_at", run.quiet_steps, dict(zip(members, netns, strict=True))
        )
        tail = RecordTail(run_dir, members)
        inj = Injector(cluster, ns, members)
        flaps = flap_times(run.minutes * 60, run.flap_every_s, run.flap_down_s) if off.flaps is None else []
        flapper = Flapper(ns, flaps, run.flap_down_s, half=list(range((run.nodes + 1) // 2)))
        try:
            for m in members:
                cluster.start(m)
            wait_started(cluster.procs, run_dir, run.startup_timeout_s, interval=POLL_S)
            phases = _run_phases(run, timing, cluster, tail, inj, flapper)
        finally:  # every exit path: no member left frozen, no partition or flap left in place
            inj.undo_all()
            flapper.end()
            cluster.stop_all()
    tail.poll()
    report = chaos_report(run, timing, cluster, tail, phases, inj, flapper, off)
    report["run_dir"] = None if made and report["digests_equal"] else str(run_dir)
    if made and report["digests_equal"]:
        shutil.rmtree(run_dir, ignore_errors=True)
    return report


@dataclass
class Phases:
    baseline: tuple[float, float] = (0.0, 0.0)
    chaos: tuple[float, float] = (0.0, 0.0)
    crashes: list[str] = field(default_factory=list)
    healed_s: float | None = None  # from the chaos's end until every member saw all alive
    final_step: int | None = None
    stop_codes: dict[str, int | None] = field(default_factory=dict)


@dataclass
class Chaos:
    """What acts during the chaos phase: the schedule, its hands, the flaps."""

    schedule: FaultSchedule
    inj: Injector
    flapper: Flapper


def _run_phases(
    run: ChaosRun, timing: ChaosTiming, cluster: Cluster, tail: RecordTail, inj: Injector, flapper: Flapper
) -> Phases:
    ph = Phases()
    seconds = run.minutes * 60
    _watch(cluster, tail, time.time() + min(30.0, 0.1 * seconds), ph)  # past warm-up and the first plan
    t0 = time.time()
    log.info("fault-free phase: %.1f min", run.minutes)
    _watch(cluster, tail, t0 + seconds, ph)
    ph.baseline = (t0, time.time())
    if ph.crashes:
        raise RuntimeError(f"daemon(s) {', '.join(ph.crashes)} exited in the fault-free phase; see {cluster.run_dir}")
    chaos = Chaos(FaultSchedule(timing, list(cluster.configs), random.Random(run.seed), time.time()), inj, flapper)
    t1 = time.time()
    log.info("chaos phase: %.1f min, faults: %s", run.minutes, ", ".join(timing.kinds) or "none")
    _watch(cluster, tail, t1 + seconds, ph, chaos)
    ph.chaos = (t1, time.time())
    flapper.end()
    training = cluster.training(tail)
    for action in chaos.schedule.end_all(time.time()):  # freezes and the partition end with the chaos
        inj.do(action, training, chaos.schedule.faulted())
    log.info("chaos over after %s: waiting for every member to be back", chaos.schedule.counts)
    try:
        _heal(run, cluster, tail, chaos, ph)
    except TimeoutError as exc:
        log.warning("%s", exc)
        return ph  # no quiet stop: the digests are not compared
    _quiet_stop(run, cluster, tail, ph)
    return ph


def _act(cluster: Cluster, tail: RecordTail, chaos: Chaos, ph: Phases, killing: bool) -> None:
    """One poll: notice crashes (restarted like kills), then do what the schedule says is due."""
    now = time.time()
    for member in cluster.crashed():
        cluster.note_crash(member)
        ph.crashes.append(member)
        chaos.schedule.restart_at[member] = now + chaos.schedule.timing.down_min_s
    training = cluster.training(tail)
    actions = chaos.schedule.due(now, training, killing=killing)
    faulted = chaos.schedule.faulted()
    for action in actions:
        chaos.inj.do(action, training, faulted)


def _watch(cluster: Cluster, tail: RecordTail, until: float, ph: Phases, chaos: Chaos | None = None) -> None:
    """Poll until ``until``: records, RSS, crashes; with ``chaos`` also its faults, restarts and flaps."""
    start = time.time()
    next_rss = start
    while (now := time.time()) < until:
        tail.poll()
        if chaos is not None:
            _act(cluster, tail, chaos, ph, killing=True)
            chaos.flapper.poll(now - start)
        else:
            for member in cluster.crashed():
                cluster.note_crash(member)
                ph.crashes.append(member)
        if now >= next_rss:
            cluster.sample_rss()
            next_rss += RSS_EVERY_S
        time.sleep(POLL_S)


def _heal(run: ChaosRun, cluster: Cluster, tail: RecordTail, chaos: Chaos, ph: Phases) -> None:
    """Restart the members still down, then wait until every member sees all of them alive."""
    start = time.time()
    deadline = start + run.heal_timeout_s
    n = len(cluster.configs)
    while True:
        tail.poll()
        _act(cluster, tail, chaos, ph, killing=False)
        training = cluster.training(tail)
        if not chaos.schedule.restart_at and len(training) == n and all(v == n for v in tail.live.values()):
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
