"""`bench chaos`'s pure parts: which fault to inject on whom and when to end it, and the report's arithmetic.

No processes, clocks or files here: the orchestration (`dreamp2p.devtools.bench.chaos.run`) passes in the
time, the members now training and the records it read, and a seeded :class:`random.Random`.

A member counts as down from its kill until its restarted daemon logs a training step again (a daemon
still joining trains nobody's steps), so "never more than ``max_down`` down" holds across restarts; a
frozen (SIGSTOP) or partitioned-off member counts as down until its fault ends.
"""

from __future__ import annotations

import math
import random
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

FAULT_KINDS = ("kill", "stop", "partition")


@dataclass(frozen=True)
class ChaosTiming:
    """Which faults are drawn, how often, how long each lasts, and how many members may be down at once.

    ``kinds`` (of :data:`FAULT_KINDS`): "kill" (SIGKILL, restart with ``--join`` after ``down_min_s``..
    ``down_max_s``), "stop" (SIGSTOP, SIGCONT after ``stop_min_s``..``stop_max_s``; with probability
    ``long_stop_p`` a long freeze of ``stop_max_s``..``long_stop_max_s`` instead), "partition" (a minority
    group of members cut off from the rest for ``partition_min_s``..``partition_max_s``; with probability
    ``oneway_p`` in one direction only: the group's packets to the rest are dropped, the rest's still arrive).
    The dataclass's own ``kinds`` is the kill-only schedule of old; `bench chaos` ships :data:`FAULT_KINDS`.
    """

    kill_every_s: float = 20.0  # mean time between faults of any kind; each gap is drawn in [0.75, 1.25] of it
    down_min_s: float = 2.0  # a killed member is restarted after a delay drawn in [down_min_s, down_max_s]
    down_max_s: float = 20.0
    max_down: int = 2  # killed, joining, frozen or partitioned-off members at once
    protected: frozenset[str] = field(default_factory=frozenset)  # never faulted: their RSS is tracked
    kinds: tuple[str, ...] = ("kill",)
    stop_min_s: float = 2.0
    stop_max_s: float = 20.0
    long_stop_p: float = 0.1  # a tenth of the freezes are long ones (up to 3 minutes)
    long_stop_max_s: float = 180.0
    partition_min_s: float = 5.0
    partition_max_s: float = 30.0
    oneway_p: float = 0.5

    def __post_init__(self) -> None:
        if not self.kill_every_s > 0:
            raise ValueError(f"kill_every_s must be > 0, got {self.kill_every_s}")
        for name in ("down", "stop", "partition"):
            lo, hi = getattr(self, f"{name}_min_s"), getattr(self, f"{name}_max_s")
            if not 0 <= lo <= hi:
                raise ValueError(f"need 0 <= {name}_min_s <= {name}_max_s, got {lo}, {hi}")
        if not self.long_stop_max_s >= self.stop_max_s:
            raise ValueError(f"long_stop_max_s must be >= stop_max_s, got {self.long_stop_max_s}, {self.stop_max_s}")
        for name in ("long_stop_p", "oneway_p"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)}")
        if self.max_down < 1:
            raise ValueError(f"max_down must be >= 1, got {self.max_down}")
        unknown = set(self.kinds) - set(FAULT_KINDS)
        if unknown or len(set(self.kinds)) != len(self.kinds):
            raise ValueError(f"kinds must be distinct ones of {', '.join(FAULT_KINDS)}, got {', '.join(self.kinds)}")


@dataclass(frozen=True)
class Action:
    """One thing to do now: kill/restart, stop/cont ``member``; partition/heal ``group`` from the rest."""

    kind: str  # "kill", "restart", "stop", "cont", "partition" or "heal"
    member: str = ""
    group: tuple[str, ...] = ()  # partition/heal: the members cut off from the rest
    oneway: bool = False  # partition/heal: only the group's packets to the rest are dropped
    lasts_s: float = 0.0  # stop/partition: how long it is meant to last


@dataclass(frozen=True)
class Cut:
    group: tuple[str, ...]
    oneway: bool
    heal_at: float


class FaultSchedule:
    """Decides, at each poll, which fault to inject and which fault to end now.

    A fault falls due ``kill_every_s`` (+-25%) after the previous one, its kind drawn then among
    ``kinds`` as from a shuffled deck: every kind once in each round of ``len(kinds)`` faults, in a random
    order, so that even a short run sees each kind and a long one sees them equally often. A due fault
    waits while it cannot be made: a kill or a stop while ``max_down`` members are down (killed, still
    joining, frozen or cut off), a partition while another is under way or no minority group fits under
    ``max_down``. No member is ever under two faults at once and a protected one never
    under any. The same seed and the same answers about who trains give the same faults.
    """

    def __init__(self, timing: ChaosTiming, members: Sequence[str], rng: random.Random, start: float) -> None:
        self.timing = timing
        self.members = list(members)
        self.rng = rng
        self.restart_at: dict[str, float] = {}  # killed members not restarted yet -> when to restart
        self.cont_at: dict[str, float] = {}  # frozen members -> when to SIGCONT them
        self.cut: Cut | None = None  # the partition under way
        self.counts: dict[str, int] = dict.fromkeys(timing.kinds, 0)
        self._deck: list[str] = []  # the kinds still to come in this round, the next one last
        self.next_kill = start + self._gap()
        self.next_kind = self._kind()

    @property
    def kills(self) -> int:
        return self.counts.get("kill", 0)

    def _gap(self) -> float:
        return self.timing.kill_every_s * self.rng.uniform(0.75, 1.25)

    def _kind(self) -> str | None:
        kinds = self.timing.kinds
        if len(kinds) <= 1:  # no draw: a kill-only schedule is the one it always was for a seed
            return kinds[0] if kinds else None
        if not self._deck:
            self._deck = sorted(kinds)
            self.rng.shuffle(self._deck)
        return self._deck.pop()

    def faulted(self) -> set[str]:
        """Members under a fault we injected: killed and not restarted yet, frozen, or cut off."""
        return set(self.restart_at) | set(self.cont_at) | set(self.cut.group if self.cut else ())

    def _ends(self, now: float, everything: bool) -> list[Action]:
        actions = [Action("restart", m) for m, at in sorted(self.restart_at.items()) if now >= at]
        for a in actions:
            del self.restart_at[a.member]
        conts = [Action("cont", m) for m, at in sorted(self.cont_at.items()) if everything or now >= at]
        for a in conts:
            del self.cont_at[a.member]
        actions += conts
        if self.cut is not None and (everything or now >= self.cut.heal_at):
            actions.append(Action("heal", group=self.cut.group, oneway=self.cut.oneway))
            self.cut = None
        return actions

    def end_all(self, now: float) -> list[Action]:
        """The chaos is over: every freeze and partition ends now; restarts still come when due."""
        return self._ends(now, everything=True)

    def due(self, now: float, training: Collection[str], killing: bool = True) -> list[Action]:
        """What to do at ``now``, given the members whose daemons are up and training (frozen ones count).

        Ends first (restarts, SIGCONTs, a heal); with ``killing`` False (the chaos is over) only those.
        """
        actions = self._ends(now, everything=False)
        if not killing or now < self.next_kill or self.next_kind is None:
            return actions
        fault = self._draw(now, training, self.next_kind)
        if fault is None:
            return actions  # the fault stays due: it happens once it can
        self.next_kill = now + self._gap()
        self.counts[fault.kind] += 1
        self.next_kind = self._kind()
        return [*actions, fault]

    def _draw(self, now: float, training: Collection[str], kind: str) -> Action | None:
        t = self.timing
        faulted = self.faulted()
        down = {m for m in self.members if m not in training} | faulted
        room = t.max_down - len(down)
        candidates = [m for m in self.members if m in training and m not in t.protected and m not in faulted]
        if room < 1 or not candidates:
            return None
        if kind == "kill":
            victim = self.rng.choice(candidates)
            self.restart_at[victim] = now + self.rng.uniform(t.down_min_s, t.down_max_s)
            return Action("kill", victim)
        if kind == "stop":
            victim = self.rng.choice(candidates)
            long = self.rng.random() < t.long_stop_p
            lasts = (
                self.rng.uniform(t.stop_max_s, t.long_stop_max_s)
                if long
                else self.rng.uniform(t.stop_min_s, t.stop_max_s)
            )
            self.cont_at[victim] = now + lasts
            return Action("stop", victim, lasts_s=lasts)
        # a partition: a minority group, never two at once
        most = min(room, len(candidates), (len(self.members) - 1) // 2)
        if self.cut is not None or most < 1:
            return None
        group = tuple(sorted(self.rng.sample(candidates, self.rng.randint(1, most))))
        oneway = self.rng.random() < t.oneway_p
        lasts = self.rng.uniform(t.partition_min_s, t.partition_max_s)
        self.cut = Cut(group, oneway, now + lasts)
        return Action("partition", group=group, oneway=oneway, lasts_s=lasts)


KillSchedule = FaultSchedule  # the name it had while it only killed


def flap_times(duration_s: float, every_s: float, down_s: float) -> list[float]:
    """When link flaps start, in seconds from the chaos's start: every ``every_s``, the first half a period in.

    A flap must be over (``down_s`` later) before the chaos ends.
    """
    if every_s <= 0:
        return []
    out = []
    t = every_s / 2
    while t + down_s <= duration_s:
        out.append(t)
        t += every_s
    return out


# ------------------------------------------------------------------------------------------- the report


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0..100) by linear interpolation between ranks; None for no values."""
    if not values:
        return None
    if not 0 <= q <= 100:
        raise ValueError(f"q must be in [0, 100], got {q}")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def p50_max(values: Sequence[float], digits: int = 3) -> dict[str, float | None]:
    p50 = percentile(values, 50)
    return {
        "p50": None if p50 is None else round(p50, digits),
        "max": round(max(values), digits) if values else None,
        "n": len(values),
    }


def p50_p99_max(values: Sequence[float], digits: int = 3) -> dict[str, float | None]:
    """p50, p99 and max (None without values) and how many values."""
    out = p50_max(values, digits)
    p99 = percentile(values, 99)
    return {"p50": out["p50"], "p99": None if p99 is None else round(p99, digits), "max": out["max"], "n": out["n"]}


@dataclass(frozen=True)
class Life:
    """One daemon process's records: from its START record to the next one (or the end of the file)."""

    member: str
    start: float  # wall time of its START record
    join: bool  # started with --join
    steps: list[tuple[float, int]]  # (t, step) of each STEP record
    peer: list[dict[str, Any]]  # its PEER records, in order
    joined: bool  # logged a JOIN record
    stop: dict[str, Any] | None  # its STOP record (a clean exit), if any


def split_lives(member: str, records: Iterable[Mapping[str, Any]]) -> list[Life]:
    """The lives in one member's metrics.jsonl (records before any START record are ignored)."""
    lives: list[Life] = []
    for r in records:
        kind = r.get("kind")
        if kind == "start":
            lives.append(Life(member, float(r["t"]), bool(r.get("join")), [], [], False, None))
        elif not lives:
            continue
        elif kind == "step":
            lives[-1].steps.append((float(r["t"]), int(r["step"])))
        elif kind == "peer":
            lives[-1].peer.append(dict(r))
        elif kind == "join":
            lives[-1] = _replace(lives[-1], joined=True)
        elif kind == "stop":
            lives[-1] = _replace(lives[-1], stop=dict(r))
    return lives


def _replace(life: Life, **changes: Any) -> Life:
    return Life(**{**life.__dict__, **changes})


def recovery_s(t_kill: float, survivors: Mapping[str, Sequence[float]]) -> float | None:
    """From a kill to the moment every survivor had completed a step after it; None if one never did.

    ``survivors``: each survivor's step completion times (any order).
    """
    worst = 0.0
    for times in survivors.values():
        after = [t for t in times if t > t_kill]
        if not after:
            return None
        worst = max(worst, min(after) - t_kill)
    return worst


def longest_gap_s(start: float, end: float, survivors: Mapping[str, Sequence[float]]) -> float:
    """The longest wait between consecutive completed steps on any survivor within [start, end], counting
    from ``start`` to the first step after it (so a survivor stuck for the whole window shows it whole)."""
    worst = 0.0
    for times in survivors.values():
        prev = start
        for t in sorted(x for x in times if start < x <= end):
            worst = max(worst, t - prev)
            prev = t
        worst = max(worst, end - prev)
    return worst


@dataclass(frozen=True)
class Kill:
    t: float  # wall time of the SIGKILL
    victim: str
    survivors: tuple[str, ...]  # members training at that moment, the victim aside


@dataclass(frozen=True)
class KillOutcome:
    recovery_s: float | None  # kill -> every survivor completed a step; None: one never did
    longest_gap_s: float  # the longest wait between two steps on a survivor, until the next kill


def kill_outcomes(
    kills: Sequence[Kill], steps: Mapping[str, Sequence[float]], end: float, window_s: float
) -> list[KillOutcome]:
    """Each kill's recovery and longest step gap, from every member's step completion times.

    A survivor killed in its turn before it completed a step counts for neither (it could not). The gap
    is looked for until the next kill, ``window_s`` after this one, or ``end``, whichever comes first.
    """
    out = []
    for i, k in enumerate(kills):
        surv: dict[str, list[float]] = {}
        for m in k.survivors:
            died = min((x.t for x in kills[i + 1 :] if x.victim == m), default=math.inf)
            times = sorted(t for t in steps.get(m, ()) if t <= died)
            if died < math.inf and not any(t > k.t for t in times):
                continue
            surv[m] = times
        w_end = min(end, k.t + window_s, kills[i + 1].t if i + 1 < len(kills) else math.inf)
        out.append(KillOutcome(recovery_s(k.t, surv), longest_gap_s(k.t, w_end, surv)))
    return out


@dataclass(frozen=True)
class Fault:
    """A freeze or a partition that ended: recovery counts from its ``end``."""

    kind: str  # "stop" or "partition"
    start: float  # wall time of the SIGSTOP / the cut
    end: float  # wall time of the SIGCONT / the heal
    members: tuple[str, ...]  # the frozen member, or the group cut off
    others: tuple[str, ...]  # the members training at its end, under no fault, its own members aside
    oneway: bool = False  # a partition in one direction only


def killed_after(member: str, t: float, kills: Sequence[Kill]) -> float:
    """When ``member`` was next killed after ``t`` (inf if never): its steps and views after that are another
    life's, which the fault before it did not cause."""
    return min((k.t for k in kills if k.victim == member and k.t > t), default=math.inf)


def fault_recoveries(
    faults: Sequence[Fault], steps: Mapping[str, Sequence[float]], kills: Sequence[Kill]
) -> list[float | None]:
    """Per fault: from its end until its own members and every other member training then completed a
    step (the frozen member steps again, the cut-off sides train together again); None if one never did.

    A member killed after the fault's end before it completed a step counts for neither (it could not).
    """
    out = []
    for f in faults:
        surv: dict[str, list[float]] = {}
        for m in (*f.members, *f.others):
            died = killed_after(m, f.end, kills)
            times = sorted(t for t in steps.get(m, ()) if t <= died)
            if died < math.inf and not any(t > f.end for t in times):
                continue
            surv[m] = times
        out.append(recovery_s(f.end, surv))
    return out


def view_rejoins(
    faults: Sequence[Fault], views: Mapping[str, Sequence[tuple[float, frozenset[str]]]], kills: Sequence[Kill]
) -> list[float | None]:
    """Per fault: from its end until its members and every other member training then are one ring again: each
    of them has logged a view (a PEER record's live members) holding all of them; None if one never did.

    Stepping again (`fault_recoveries`) says less for a partition: a strategy that trains on through failed
    rounds steps at once, on its own side. ``views``: each member's (t, live members) from its PEER records.
    A member killed after the fault's end before logging such a view counts for neither (it could not).
    """
    out: list[float | None] = []
    for f in faults:
        ring = frozenset((*f.members, *f.others))
        waits = []
        for m in sorted(ring):
            died = killed_after(m, f.end, kills)
            whole = [t for t, live in views.get(m, ()) if f.end < t <= died and ring <= live]
            if whole:
                waits.append(min(whole) - f.end)
            elif died == math.inf:
                waits.append(math.inf)  # never one ring again
        worst = max(waits, default=0.0)
        out.append(None if worst == math.inf else worst)
    return out


def fault_summary(
    kinds: Sequence[str],
    kill_recoveries: Sequence[float | None],
    faults: Sequence[Fault],
    recoveries: Sequence[float | None],
    rejoins: Sequence[float | None] | None = None,
) -> dict[str, dict[str, Any]]:
    """Per fault kind in ``kinds``: how many, how many recovered, recovery p50/p99/max over those that did.

    ``kill_recoveries``: one per kill (see :func:`kill_outcomes`); ``recoveries``: one per fault in ``faults``
    (see :func:`fault_recoveries`). Stops and partitions also say how long they lasted (p50, max), partitions
    how many were one-way, and with ``rejoins`` (see :func:`view_rejoins`) how long until they were one ring again.
    """
    if len(faults) != len(recoveries):
        raise ValueError(f"{len(faults)} faults but {len(recoveries)} recoveries")
    if rejoins is not None and len(rejoins) != len(faults):
        raise ValueError(f"{len(faults)} faults but {len(rejoins)} rejoins")
    out: dict[str, dict[str, Any]] = {}
    for kind in kinds:
        extra: dict[str, Any] = {}
        if kind == "kill":
            recs = list(kill_recoveries)
        else:
            mine = [(f, r) for f, r in zip(faults, recoveries, strict=True) if f.kind == kind]
            recs = [r for _, r in mine]
            extra["lasted_s"] = p50_max([f.end - f.start for f, _ in mine])
            if rejoins is not None:
                ring = [r for f, r in zip(faults, rejoins, strict=True) if f.kind == kind]
                extra["one_ring_again"] = len([r for r in ring if r is not None])
                extra["rejoin_s"] = p50_p99_max([r for r in ring if r is not None])
            if kind == "partition":
                extra["oneway"] = sum(1 for f, _ in mine if f.oneway)
        done = [r for r in recs if r is not None]
        out[kind] = {"count": len(recs), "recovered": len(done), "recovery_s": p50_p99_max(done), **extra}
    return out


def frontier(steps: Iterable[tuple[float, int]], at: float) -> int:
    """The furthest step any member completed by time ``at`` (-1 before the first)."""
    return max((s for t, s in steps if t <= at), default=-1)


def steps_per_s(steps: Sequence[tuple[float, int]], t0: float, t1: float) -> float:
    """The cluster's pace over [t0, t1]: how far its frontier moved, per second."""
    if t1 <= t0:
        raise ValueError(f"empty window [{t0}, {t1}]")
    return (frontier(steps, t1) - frontier(steps, t0)) / (t1 - t0)


def goodput(chaos: float, baseline: float) -> float | None:
    """Steps per second under chaos as a fraction of the fault-free run's; None without a baseline pace."""
    return chaos / baseline if baseline > 0 else None


def rss_growth(samples: Sequence[tuple[float, int]], warm_fraction: float = 0.2) -> float | None:
    """Relative RSS growth from the end of the warm-up (the first ``warm_fraction`` of the samples, at
    least one) to the last sample; None with fewer than two samples."""
    if len(samples) < 2:
        return None
    ordered = sorted(samples)
    warm = min(len(ordered) - 1, max(1, int(len(ordered) * warm_fraction)))
    base = ordered[warm - 1][1]
    return (ordered[-1][1] - base) / base if base else None


def counter_in_window(peer: Sequence[Mapping[str, Any]], key: str, t0: float, t1: float) -> int:
    """How much one life's counter ``key`` (its PEER records) grew within [t0, t1]."""
    before = [int(r[key]) for r in peer if float(r["t"]) <= t0]
    upto = [int(r[key]) for r in peer if float(r["t"]) <= t1]
    return (upto[-1] if upto else 0) - (before[-1] if before else 0)


def digests_agree(digests: Mapping[str, str | None]) -> bool:
    """Every member reported a digest and all are the same."""
    values = list(digests.values())
    return bool(values) and None not in values and len(set(values)) == 1
