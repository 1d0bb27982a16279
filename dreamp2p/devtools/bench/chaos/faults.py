"""`bench chaos`'s hands on the live cluster: each scheduled fault done and undone, and when.

The schedule (`dreamp2p.devtools.bench.chaos.plan.FaultSchedule`) says what to do; :class:`Injector` does it:
SIGKILL and restart (`Cluster.kill`, `Cluster.start`), SIGSTOP and SIGCONT (`Cluster.freeze`, `Cluster.thaw`),
and partitions as blackhole rules in the members' network namespaces (`Namespaces.block`, one namespace per
member). It keeps every fault's span for the report and undoes whatever is still open on any exit path.
:class:`Flapper` takes the network down between the cluster's two halves now and then (link flaps).
"""

from __future__ import annotations

import logging
import subprocess
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

from dreamp2p.devtools.bench.chaos.plan import Action, Fault, Kill
from dreamp2p.devtools.bench.chaos.proc import Cluster

log = logging.getLogger(__name__)


@dataclass
class Span:
    """One fault we injected: what, on whom, from when to when (``end`` None while it lasts)."""

    kind: str  # "kill", "stop" or "partition"
    members: tuple[str, ...]
    start: float  # wall time
    end: float | None = None  # wall time of the restart, SIGCONT or heal
    oneway: bool = False  # partitions: only the group's packets to the rest were dropped


class Injector:
    """Does the schedule's actions on ``cluster`` and ``ns`` (namespaces with one member per region, in the
    order of ``members``; None without them) and records them: ``kills`` (for `kill_outcomes`), ``faults``
    (the stops and partitions that ended, for `fault_recoveries`) and ``spans`` (every fault, for the log)."""

    def __init__(self, cluster: Cluster, ns: Any, members: Sequence[str]) -> None:
        self.cluster = cluster
        self.ns = ns
        self.index = {m: i for i, m in enumerate(members)}
        self.kills: list[Kill] = []
        self.restarts = 0
        self.faults: list[Fault] = []
        self.spans: list[Span] = []
        self._open: dict[tuple[str, tuple[str, ...]], Span] = {}  # (kind, members) -> the span under way
        self._blocked: list[tuple[list[int], list[int]]] = []  # (src, dst) of each block in place

    def do(self, action: Action, training: Collection[str], faulted: Collection[str]) -> None:
        """One action. ``training``: the members training at this poll (frozen ones count); ``faulted``: those
        under a fault once the poll's actions are made (what the schedule says now)."""
        kind, member = action.kind, action.member
        if kind == "restart":
            self.cluster.start(member, join=True)
            self.restarts += 1
            self._close("kill", (member,), self.cluster.started_at[member], training, faulted)
        elif kind == "kill":
            t = self.cluster.kill(member)
            survivors = set(training) - set(faulted) - {member}
            self.kills.append(Kill(t, member, tuple(sorted(survivors))))
            self._begin(Span("kill", (member,), t))
        elif kind == "stop":
            self._begin(Span("stop", (member,), self.cluster.freeze(member)))
        elif kind == "cont":
            self._close("stop", (member,), self.cluster.thaw(member), training, faulted)
        elif kind == "partition":
            self._begin(Span("partition", action.group, self._cut(action.group, action.oneway), oneway=action.oneway))
        elif kind == "heal":
            self._close("partition", action.group, self._mend(), training, faulted)
        else:
            raise ValueError(f"unknown action {kind!r}")

    def _begin(self, span: Span) -> None:
        self.spans.append(span)
        self._open[(span.kind, span.members)] = span

    def _close(
        self, kind: str, members: tuple[str, ...], t: float, training: Collection[str], faulted: Collection[str]
    ) -> None:
        span = self._open.pop((kind, members), None)
        if span is None:
            return  # a restart after a crash: no fault of ours
        span.end = t
        if kind != "kill":
            others = tuple(sorted(set(training) - set(faulted) - set(members)))
            self.faults.append(Fault(kind, span.start, t, members, others, span.oneway))

    def _cut(self, group: tuple[str, ...], oneway: bool) -> float:
        """Drop what ``group`` sends the rest and, unless ``oneway``, what the rest sends it; the time."""
        if self.ns is None:
            raise RuntimeError("a partition needs network namespaces (root)")
        inside = [self.index[m] for m in group]
        rest = [i for i in self.index.values() if i not in inside]
        pairs = [(inside, rest)] if oneway else [(inside, rest), (rest, inside)]
        t = time.time()
        for src, dst in pairs:
            self._blocked.append((src, dst))  # before the call: a rule half made is undone too
            self.ns.block(src, dst)
        log.info("partition: %s cut off%s", ", ".join(group), " one way (its packets dropped)" if oneway else "")
        return t

    def _mend(self) -> float:
        t = time.time()
        failed = self._unblock_all()
        if failed:
            log.warning("healing the partition: %d rule(s) would not go: %s", len(failed), "; ".join(failed))
        log.info("partition healed")
        return t

    def _unblock_all(self) -> list[str]:
        """Remove every blocking rule in place, rule by rule (one never made, in a block that failed half-way,
        must not keep the others); what failed."""
        failed = []
        while self._blocked:
            src, dst = self._blocked.pop()
            for j in dst:
                for i in src:
                    try:
                        self.ns.unblock([i], [j])
                    except (subprocess.SubprocessError, OSError) as exc:
                        failed.append(f"{i} -> {j}: {exc}")
        return failed

    def undo_all(self) -> None:
        """Thaw every frozen member and heal the partition under way; never raises (an exit path's last step)."""
        try:
            self.cluster.thaw_all()
        except Exception as exc:
            log.warning("thawing the frozen members: %s", exc)
        try:
            failed = self._unblock_all()
        except Exception as exc:
            failed = [str(exc)]
        if failed:
            log.debug("undoing the partition: %s", "; ".join(failed))


FLAP_LAYER = 1  # `Namespaces.block` layer of the link flaps through the packet emulator (partitions: 0)


class Flapper:
    """Cuts the cluster in two halves for ``down_s`` at each of ``times`` (seconds from the chaos's start).

    With one namespace per member (a star through a hub) the first half's hub ports move to a bridge of their
    own (`Namespaces.split`); with two namespaces, their veth link goes down; through the packet emulator
    (no links of ours to cut), each half drops what the other sends (`Namespaces.block`, both ways). No
    namespaces: no flaps.
    """

    def __init__(self, ns: Any, times: list[float], down_s: float, half: list[int]) -> None:
        self.ns = ns
        self.times = list(times) if ns is not None else []
        self.down_s = down_s
        self.half = half
        self.up_at: float | None = None
        self.done: list[float] = []  # wall times the halves were cut apart

    def _set(self, down: bool) -> None:
        if self.ns.emulator is not None:
            rest = [i for i in range(self.ns.n) if i not in self.half]
            for src, dst in ((self.half, rest), (rest, self.half)):
                # rules of a layer of their own: a partition under way keeps its rules through the flap
                (self.ns.block if down else self.ns.unblock)(src, dst, layer=FLAP_LAYER)
        elif self.ns.n == 2:
            name, dev = self.ns.devs[0]
            state = "down" if down else "up"
            subprocess.run(["ip", "-n", name, "link", "set", "dev", dev, state], check=True, timeout=30)
        elif down:
            self.ns.split(self.half)
        else:
            self.ns.join()

    def poll(self, since_start: float) -> None:
        if self.up_at is not None and since_start >= self.up_at:
            self._set(False)
            self.up_at = None
        elif self.up_at is None and self.times and since_start >= self.times[0]:
            self.times.pop(0)
            self._set(True)
            self.done.append(time.time())
            self.up_at = since_start + self.down_s
            log.info("link flap: the cluster in two halves for %.0f s", self.down_s)

    def end(self) -> None:
        """The halves are joined again (a flap under way ends now); no more flaps. Never raises."""
        self.times = []
        if self.up_at is not None:
            self.up_at = None
            try:
                self._set(False)
            except (subprocess.SubprocessError, OSError) as exc:
                log.warning("ending a link flap: %s", exc)
