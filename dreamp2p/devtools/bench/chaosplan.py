"""`bench chaos`'s pure parts: when to kill whom and when to restart, and the report's arithmetic.

No processes, clocks or files here: the orchestration (`dreamp2p.devtools.bench.chaos`) passes in the
time, the members now training and the records it read, and a seeded :class:`random.Random`.

A member counts as down from its kill until its restarted daemon logs a training step again (a daemon
still joining trains nobody's steps), so "never more than ``max_down`` down" holds across restarts.
"""

from __future__ import annotations

import math
import random
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ChaosTiming:
    """How often members are killed, how long they stay dead, and how many may be down at once."""

    kill_every_s: float = 20.0  # mean time between kills; each gap is drawn in [0.75, 1.25] of it
    down_min_s: float = 2.0  # a killed member is restarted after a delay drawn in [down_min_s, down_max_s]
    down_max_s: float = 20.0
    max_down: int = 2
    protected: frozenset[str] = field(default_factory=frozenset)  # never killed: their RSS is tracked

    def __post_init__(self) -> None:
        if not self.kill_every_s > 0:
            raise ValueError(f"kill_every_s must be > 0, got {self.kill_every_s}")
        if not 0 <= self.down_min_s <= self.down_max_s:
            raise ValueError(f"need 0 <= down_min_s <= down_max_s, got {self.down_min_s}, {self.down_max_s}")
        if self.max_down < 1:
            raise ValueError(f"max_down must be >= 1, got {self.max_down}")


@dataclass(frozen=True)
class Action:
    kind: str  # "kill" or "restart"
    member: str


class KillSchedule:
    """Decides, at each poll, which member to kill and which killed member to restart now.

    A kill falls due ``kill_every_s`` (+-25%) after the previous one; a due kill waits while
    ``max_down`` members are down, then takes a member drawn among those training, never a protected one.
    """

    def __init__(self, timing: ChaosTiming, members: Sequence[str], rng: random.Random, start: float) -> None:
        self.timing = timing
        self.members = list(members)
        self.rng = rng
        self.restart_at: dict[str, float] = {}  # killed members not restarted yet -> when to restart
        self.next_kill = start + self._gap()
        self.kills = 0

    def _gap(self) -> float:
        return self.timing.kill_every_s * self.rng.uniform(0.75, 1.25)

    def due(self, now: float, training: Collection[str], killing: bool = True) -> list[Action]:
        """What to do at ``now``, given the members whose daemons are up and training.

        Restarts come first; with ``killing`` False (the chaos is over) only restarts are given.
        """
        actions = [Action("restart", m) for m, at in sorted(self.restart_at.items()) if now >= at]
        for a in actions:
            del self.restart_at[a.member]
        if not killing or now < self.next_kill:
            return actions
        down = [m for m in self.members if m not in training]
        candidates = [
            m for m in self.members if m in training and m not in self.timing.protected and m not in self.restart_at
        ]
        if len(down) + 1 > self.timing.max_down or not candidates:
            return actions  # the kill stays due: it happens once a member is back
        victim = self.rng.choice(candidates)
        self.restart_at[victim] = now + self.rng.uniform(self.timing.down_min_s, self.timing.down_max_s)
        self.next_kill = now + self._gap()
        self.kills += 1
        return [*actions, Action("kill", victim)]


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
