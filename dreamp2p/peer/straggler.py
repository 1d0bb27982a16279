"""Stragglers: which live member holds rounds past a deadline from its own measured link, and when it returns.

Pure policy, no I/O and no clock of its own (the caller passes ``now``). Its input is what every member
of a completed round measured of its own part and sent on its commit vote (`messages.RoundEvidence`):
the bytes it sent, its measured outbound link rate and how long its part took. A round completes only
where every member's commit arrived, so every member of the round judges the same evidence and reaches
the same verdict at the same round boundary; the view then leaves the straggler out everywhere (a member
that lags a moment behind fails one round with VIEW_MISMATCH and retries, as for any view change).

The deadline of a member in a round is ``max(floor_s, margin x its bytes / the members' median link
rate)``: what the round would take at a typical member's rate, with room for compute and latency. A
member is late when the round ran past that deadline and its own link explains it (its bytes at its own
measured rate also exceed it); a member whose link is fine but who arrives late is not blamed. A round
within the floor that the member's own link would also carry within the floor tells nothing (small rounds
between large ones) and leaves its strikes as they are. After ``strikes`` late rounds in a row (not
counting such rounds) it is excluded for a probation period, doubled on every relapse (up to
``max_backoff`` times) and forgiven after ``settle_rounds`` rounds on time: hysteresis, so a member
near the line does not flap in and out. When its probation ends it takes part again (the probe): if it
keeps up it stays, else it goes out again for longer. At most a minority of the members is excluded,
and never so many that fewer than two remain.
"""

from __future__ import annotations

import logging
import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from dreamp2p.config import TransportConfig
from dreamp2p.messages import RoundEvidence

log = logging.getLogger(__name__)

# Fewest members with a known link rate in a round before anyone in it is judged (a median of 2 is no
# majority: with one fast and one slow member nobody can tell which one is typical).
MIN_JUDGED = 3


def expected_s(nbytes: int, rate_Bps: float, compute_s: float = 0.0) -> float:
    """Seconds to send ``nbytes`` at ``rate_Bps`` plus ``compute_s`` (inf for an unknown or zero rate)."""
    if nbytes <= 0:
        return compute_s
    if not _known(rate_Bps):
        return math.inf
    return nbytes / rate_Bps + compute_s


def deadline_s(expected: float, margin: float, floor_s: float) -> float:
    """The deadline for a part expected to take ``expected`` seconds: ``margin`` times it, at least ``floor_s``."""
    return max(floor_s, margin * expected)


def late_members(evidence: Mapping[str, RoundEvidence], margin: float, floor_s: float) -> tuple[str, ...]:
    """The members of one completed round that held it past their deadline, in sorted order.

    Judged only with at least `MIN_JUDGED` known link rates; a member without a known rate is not judged.
    """
    rates = [e.link_Bps for e in evidence.values() if _known(e.link_Bps)]
    if len(rates) < MIN_JUDGED:
        return ()
    reference = statistics.median(rates)
    held = max(e.part_s for e in evidence.values())
    late = []
    for member, e in sorted(evidence.items()):
        if not _known(e.link_Bps) or e.sent_bytes <= 0:
            continue
        limit = deadline_s(expected_s(e.sent_bytes, reference), margin, floor_s)
        if held > limit and expected_s(e.sent_bytes, e.link_Bps) > limit:
            late.append(member)
    return tuple(late)


@dataclass(frozen=True)
class StragglerRule:
    """The policy's knobs (see the module docstring); ``margin`` 0 turns exclusion off."""

    margin: float = 3.0
    floor_s: float = 5.0
    strikes: int = 2
    probation_s: float = 30.0
    max_backoff: int = 8
    settle_rounds: int = 10

    @property
    def enabled(self) -> bool:
        return self.margin > 0


def rule_of(t: TransportConfig) -> StragglerRule:
    """The rule a peer's ``[node.transport]`` straggler knobs set."""
    return StragglerRule(t.straggler_margin, t.straggler_floor_s, t.straggler_strikes, t.straggler_probation_s)


def shared_settings(rule: StragglerRule) -> dict[str, str]:
    """The rule as a training setting every member must share (`dreamp2p.settings`): members that judged
    by other rules would exclude at different rounds, and their views would differ. None while it is off."""
    if not rule.enabled:
        return {}
    return {
        "transport.stragglers": f"margin {rule.margin:g}, floor {rule.floor_s:g} s, "
        f"strikes {rule.strikes}, probation {rule.probation_s:g} s"
    }


@dataclass
class _Record:
    strikes: int = 0  # late rounds in a row
    on_time: int = 0  # rounds on time in a row
    relapses: int = 0  # exclusions since it last settled: each doubles the probation
    until: float | None = None  # excluded until then (monotonic seconds)


class StragglerPolicy:
    """Strikes, exclusions and probations of the members of one ring, and how many came and went."""

    def __init__(self, rule: StragglerRule, members: Sequence[str]) -> None:
        self.rule = rule
        self.members = tuple(members)
        self.evictions = 0
        self.returns = 0
        self._records = {m: _Record() for m in members}

    @property
    def excluded(self) -> frozenset[str]:
        return frozenset(m for m, r in self._records.items() if r.until is not None)

    def observe(self, evidence: Mapping[str, RoundEvidence], now: float) -> tuple[str, ...]:
        """Judge one completed round; returns the members excluded by it (at most one per round)."""
        if not self.rule.enabled:
            return ()
        late = set(late_members(evidence, self.rule.margin, self.rule.floor_s))
        held = max((e.part_s for e in evidence.values()), default=0.0)
        due = []
        for member, e in sorted(evidence.items()):
            rec = self._records.get(member)
            if rec is None or rec.until is not None:
                continue
            if member in late:
                rec.strikes, rec.on_time = rec.strikes + 1, 0
                if rec.strikes >= self.rule.strikes:
                    due.append(member)
                continue
            # a round within the floor that its link would also carry within the floor says nothing
            # about keeping up (small rounds between large late ones): it keeps the strikes as they are
            if held > self.rule.floor_s or expected_s(e.sent_bytes, e.link_Bps) > self.rule.floor_s:
                rec.strikes = 0
            rec.on_time += 1
            if rec.on_time >= self.rule.settle_rounds:
                rec.relapses = 0
        if not due or not self._may_exclude(len(evidence)):
            return ()
        # the slowest of those due goes first; the others stay due and may follow (rules permitting)
        member = min(due, key=lambda m: (evidence[m].link_Bps, m))
        self._exclude(member, evidence[member], now)
        return (member,)

    def expire(self, now: float) -> tuple[str, ...]:
        """Members whose probation ended by ``now``: they take part in rounds again (the probe)."""
        back = []
        for member, rec in sorted(self._records.items()):
            if rec.until is not None and rec.until <= now:
                rec.until, rec.strikes, rec.on_time = None, 0, 0
                back.append(member)
        for member in back:
            self.returns += 1
            log.info("straggler %s returns to the rounds after its probation", member)
        return tuple(back)

    def probation_for(self, relapses: int) -> float:
        """The probation of an exclusion that is the ``relapses``-th since the member last settled."""
        return self.rule.probation_s * min(2 ** max(0, relapses - 1), self.rule.max_backoff)

    def _may_exclude(self, in_round: int) -> bool:
        excluded = len(self.excluded)
        return in_round - 1 >= 2 and 2 * (excluded + 1) < len(self.members)

    def _exclude(self, member: str, e: RoundEvidence, now: float) -> None:
        rec = self._records[member]
        rec.relapses += 1
        rec.strikes = 0
        probation = self.probation_for(rec.relapses)
        rec.until = now + probation
        self.evictions += 1
        log.info(
            "straggler %s held %d rounds past their deadline (its link %.3g B/s): excluded for %.0f s",
            member,
            self.rule.strikes,
            e.link_Bps,
            probation,
        )


def _known(rate: float) -> bool:
    return math.isfinite(rate) and rate > 0
