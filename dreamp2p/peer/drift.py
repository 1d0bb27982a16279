"""Which members this node must take the training state from because it missed the plan they train with.

After a partition heals, each side may have decided its own plans while apart (DreamDDP re-plans when the
ring changes): plans are numbered, and the numbers say nothing about content, so both sides can hold a
"v3" made from different inputs. Members with different plans use different round groups and layer
groupings, so no round between them can ever complete: without help the side that waits for the other
stands still until its round deadline. A plan is therefore named by its version, the step it took effect
at and its digest (`schedule.plan.Plan.digest`); of two members whose plans differ, the one with the
lesser name yields: it takes the state (model, optimizer, plan) from the members ahead, as a joining node
does, and trains on with them. The sides may also keep one plan and part in the rest of what every member
must hold alike (DreamDDP's control schedule, which the sides' own control rounds moved apart): then each
side runs control rounds at steps the other skips, and every member waits for the other side's until the
round deadline. That memory is named beside the plan (`MemberProgress.plan`) and yields the same way.

A difference is only a divergence once this node is past the step the other's plan took effect at: all
members adopt a plan at the same step, so a member a few steps behind legitimately still trains with the
previous one. But a member far behind may never get there: a side that trained slower while apart runs
rounds (of its own plan's groups, or of steps the others have closed) that no member ahead takes part
in, while the members ahead wait for it in theirs. So a member more than ``lag_steps`` behind one whose
plan is not lesser than its own yields too, whatever the plans: in one ring no member trails another
that far (the trainer names the bound: DreamDDP waits for every round within a period and its delay).
Only a lead that lasts counts (`LagHold`): while one member stands aside to take a state, the rounds of
the others fail at once and nothing paces them, so for a moment one of them can run that far ahead of
another and the gap closes again once rounds pace them; yielding to such a lead only starts another
transfer. The rules are pure logic; `DriftWatch` applies them for the peer, which feeds it the trainer's
progress, the members' heartbeat answers (`transport.client.Link.progress`) and the time, and stands aside
from the members it names.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping

from dreamp2p.messages import MemberProgress, TrainingInfo

log = logging.getLogger(__name__)

# Heartbeat intervals a member must stay far ahead before we yield to it (a lead after another member's
# state transfer closes within about one; a side left behind by a partition stays behind for many).
LAG_HOLD_HEARTBEATS = 4


def far_ahead(
    mine: MemberProgress | None, others: Mapping[str, MemberProgress | None], lag_steps: int
) -> frozenset[str]:
    """Members whose plan's name is not lesser than ours and whose step is more than ``lag_steps`` beyond
    ours (none when ``lag_steps`` is 0 or this node has no trainer yet)."""
    if mine is None or lag_steps <= 0:
        return frozenset()
    return frozenset(
        node
        for node, theirs in others.items()
        if theirs is not None and theirs.plan >= mine.plan and theirs.step - mine.step > lag_steps
    )


class LagHold:
    """Which members have stayed far ahead (`far_ahead`) for at least ``hold_s`` without a break."""

    def __init__(self, hold_s: float) -> None:
        if hold_s < 0:
            raise ValueError(f"hold_s must be >= 0, got {hold_s}")
        self.hold_s = hold_s
        self._since: dict[str, float] = {}  # replaced whole: the trainer's and the loop's threads both call

    def held(self, far: frozenset[str], now: float) -> frozenset[str]:
        """Record that ``far`` are far ahead at ``now``; those that have been since ``hold_s`` ago or longer."""
        since = {node: self._since.get(node, now) for node in far}
        self._since = since
        return frozenset(node for node, t in since.items() if now - t >= self.hold_s)


def diverged_from(
    mine: MemberProgress | None,
    others: Mapping[str, MemberProgress | None],
    lag_steps: int = 0,
    far: frozenset[str] | None = None,
) -> tuple[str, ...]:
    """Members, sorted, whose state ``mine`` should take (see the module docstring).

    Empty when this node has no trainer yet or no member is ahead. A member counts when its plan's name
    (`MemberProgress.plan`) is greater than ours and our step is past the step its name took effect at
    (`MemberProgress.since`), or when it is far ahead: in ``far`` if given (the caller held the lead, see `LagHold`),
    else in `far_ahead` (``lag_steps``); of several such, those holding the greatest name.
    """
    if mine is None:
        return ()
    far = far_ahead(mine, others, lag_steps) if far is None else far
    ahead = {
        node: theirs.plan
        for node, theirs in others.items()
        if theirs is not None and ((theirs.plan > mine.plan and mine.step > theirs.since) or node in far)
    }
    if not ahead:
        return ()
    # members ahead may differ among themselves (three sides): take the newest, the others yield to it too
    newest = max(ahead.values())
    return tuple(sorted(node for node, plan in ahead.items() if plan == newest))


class LeadingStep:
    """The highest step a live member is known to be at: the cluster's step clock for time-paced periods
    (`dreamp2p.sync.strategies.pacing`). Two sources: the members' heartbeat answers, and sooner, a frame
    waiting here for a round we have not launched yet, of a group we ran before (strategies number a round
    launched at step s as s + 1, so its sender is past s; `RoundRegistry.on_early`). ``step`` is an int
    replaced whole, read by the trainer's thread."""

    def __init__(self) -> None:
        self.step = 0
        self._launched = 0  # the highest step a waiting frame showed a member past
        self.on_change: Callable[[int], None] | None = None  # told the new step when it changes

    def launched(self, step: int) -> None:
        """A member launched a round at ``step`` before we did."""
        if step > self.step:
            self._launched = step
            self._set(step)

    def heard(self, others: Mapping[str, MemberProgress | None]) -> None:
        """The live members' last heartbeat answers (and what their frames showed)."""
        self._set(max(max((p.step for p in others.values() if p is not None), default=0), self._launched))

    def _set(self, step: int) -> None:
        if step != self.step:
            self.step = step
            if self.on_change is not None:
                self.on_change(step)


class DriftWatch:
    """Applies the rules above to this node's trainer and the live members' last heartbeat answers."""

    def __init__(self, heartbeat_s: float) -> None:
        # a member far ahead is only yielded to once its lead outlasted a few heartbeats (see `LagHold`)
        self._lag_hold = LagHold(max(1.0, LAG_HOLD_HEARTBEATS * heartbeat_s))

    def ahead(self, info: TrainingInfo | None, others: Mapping[str, MemberProgress | None]) -> tuple[str, ...]:
        """The members, sorted, whose state this node must take (`diverged_from`, with the lead held), logged
        with what they and we train with; empty when none."""
        mine = None if info is None else info.progress()
        lag = 0 if info is None else info.lag_steps
        far = self._lag_hold.held(far_ahead(mine, others, lag), time.monotonic())
        ahead = diverged_from(mine, others, lag, far)
        if not ahead or mine is None:  # (mine is never None when some member is ahead)
            return ()
        theirs = others[ahead[0]]
        log.warning(
            "%s trains at step %d with plan v%d (from step %d), which this node (at step %d, plan v%d from step "
            "%d) missed or is too far behind to catch up with, e.g. after a partition: standing aside to take "
            "their state",
            ", ".join(ahead),
            theirs.step if theirs is not None else 0,
            theirs.plan_version if theirs is not None else 0,
            theirs.plan_effective_step if theirs is not None else 0,
            mine.step,
            mine.plan_version,
            mine.plan_effective_step,
        )
        return ahead
