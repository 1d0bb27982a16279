"""Which members this node must take the training state from because it missed the plan they train with.

After a partition heals, each side may have decided its own plans while apart (DreamDDP re-plans when the
ring changes): plans are numbered, and the numbers say nothing about content, so both sides can hold a
"v3" made from different inputs. Members with different plans use different round groups and layer
groupings, so no round between them can ever complete: without help the side that waits for the other
stands still until its round deadline. A plan is therefore named by its version, the step it took effect
at and its digest (`schedule.plan.Plan.digest`); of two members whose plans differ, the one with the
lesser name yields: it takes the state (model, optimizer, plan) from the members ahead, as a joining node
does, and trains on with them.

A difference is only a divergence once this node is past the step the other's plan took effect at: all
members adopt a plan at the same step, so a member a few steps behind legitimately still trains with the
previous one. But a member far behind may never get there: a side that trained slower while apart runs
rounds (of its own plan's groups, or of steps the others have closed) that no member ahead takes part
in, while the members ahead wait for it in theirs. So a member more than ``lag_steps`` behind one whose
plan is not lesser than its own yields too, whatever the plans: in one ring no member trails another
that far (the trainer names the bound: DreamDDP waits for every round within a period and its delay).
Pure logic: the peer feeds it heartbeat answers (`transport.client.Link.progress`).
"""

from __future__ import annotations

from collections.abc import Mapping

from dreamp2p.messages import MemberProgress


def diverged_from(
    mine: MemberProgress | None, others: Mapping[str, MemberProgress | None], lag_steps: int = 0
) -> tuple[str, ...]:
    """Members, sorted, whose state ``mine`` should take (see the module docstring).

    Empty when this node has no trainer yet or no member is ahead. A member counts when its plan's name
    (version, effective step, digest) is greater than ours and our step is past the step its plan took
    effect at, or (``lag_steps`` > 0) when its plan's name is not lesser than ours and its step is more
    than ``lag_steps`` beyond ours; of several such, those holding the greatest name.
    """
    if mine is None:
        return ()
    ahead = {
        node: theirs.plan
        for node, theirs in others.items()
        if theirs is not None
        and (
            (theirs.plan > mine.plan and mine.step > theirs.plan_effective_step)
            or (lag_steps > 0 and theirs.plan >= mine.plan and theirs.step - mine.step > lag_steps)
        )
    }
    if not ahead:
        return ()
    # members ahead may differ among themselves (three sides): take the newest, the others yield to it too
    newest = max(ahead.values())
    return tuple(sorted(node for node, plan in ahead.items() if plan == newest))
