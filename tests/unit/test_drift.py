"""Noticing a plan missed across a partition (pure logic): who yields, when, and the plan names it compares."""

from __future__ import annotations

import dataclasses
import random

import pytest

from dreamp2p.messages import MemberProgress, TrainingInfo
from dreamp2p.peer.drift import LagHold, LeadingStep, diverged_from, far_ahead
from dreamp2p.schedule.cost import LayerCost
from dreamp2p.schedule.dreamddp import even_plan
from dreamp2p.transport import serde

P = MemberProgress


@pytest.mark.parametrize(
    ("mine", "others", "expected"),
    [
        # no trainer here yet, or nobody reports one: nothing to compare
        (None, {"b": P(100, 3, 40, 7)}, ()),
        (P(100, 2, 20, 5), {"b": None}, ()),
        # strategies without plans (all zeros) never diverge, whatever the step gap
        (P(10, 0, 0, 0), {"b": P(5000, 0, 0, 0)}, ()),
        # the same plan: nothing, even far apart in steps (that drift heals by itself)
        (P(100, 3, 40, 7), {"b": P(900, 3, 40, 7)}, ()),
        # a newer plan that took effect at a step we passed: we missed it
        (P(100, 2, 20, 5), {"b": P(98, 3, 60, 9)}, ("b",)),
        # ... but not before we reach its step: every member adopts a plan at the same step
        (P(60, 2, 20, 5), {"b": P(70, 3, 60, 9)}, ()),
        (P(61, 2, 20, 5), {"b": P(70, 3, 60, 9)}, ("b",)),
        # we hold the newer plan: the other member yields, not us
        (P(100, 3, 60, 9), {"b": P(100, 2, 20, 5)}, ()),
        # the same version decided apart at different steps: the later step wins
        (P(100, 3, 50, 1), {"b": P(100, 3, 60, 1)}, ("b",)),
        (P(100, 3, 60, 1), {"b": P(100, 3, 50, 1)}, ()),
        # same version and step, different schedules: the digest orders them, exactly one side yields
        (P(100, 3, 60, 1), {"b": P(100, 3, 60, 2)}, ("b",)),
        (P(100, 3, 60, 2), {"b": P(100, 3, 60, 1)}, ()),
        # several ahead: only those with the newest plan serve the state (the others yield to it too)
        (P(100, 2, 20, 5), {"b": P(100, 3, 60, 9), "c": P(100, 4, 80, 1), "d": P(100, 4, 80, 1)}, ("c", "d")),
        # members on our side of the partition hold our plan and are left out
        (P(100, 2, 20, 5), {"b": P(100, 2, 20, 5), "c": P(100, 3, 60, 9)}, ("c",)),
        # one plan, control schedules parted while apart: the schedule changed later wins once we passed it
        (P(100, 3, 40, 7, 80, 1), {"b": P(100, 3, 40, 7, 90, 2)}, ("b",)),
        (P(100, 3, 40, 7, 90, 2), {"b": P(100, 3, 40, 7, 80, 1)}, ()),
        # ... the same step: its digest orders them
        (P(100, 3, 40, 7, 90, 1), {"b": P(100, 3, 40, 7, 90, 2)}, ("b",)),
        (P(100, 3, 40, 7, 90, 2), {"b": P(100, 3, 40, 7, 90, 1)}, ()),
        # a member one control round ahead of us (it landed the round at 95, we are at 94): not divergence
        (P(94, 3, 40, 7, 85, 1), {"b": P(96, 3, 40, 7, 95, 2)}, ()),
        # nor the other way round: we are ahead, the member behind has not landed it yet
        (P(96, 3, 40, 7, 95, 2), {"b": P(94, 3, 40, 7, 85, 1)}, ()),
        # a newer plan still beats a newer schedule
        (P(100, 3, 40, 7, 95, 2), {"b": P(100, 4, 60, 9, 60, 1)}, ("b",)),
        # a plan that took effect at the step a control round landed (both 10), and a member a step behind,
        # whose schedule (landed at 5) is one round older than ours: not divergence, whatever the digests say
        # (a false resync seen under load before the name ordered each part's step before its digest)
        (P(11, 1, 10, 7, 10, 1), {"b": P(10, 1, 10, 7, 5, 2)}, ()),
        (P(10, 1, 10, 7, 5, 2), {"b": P(11, 1, 10, 7, 10, 1)}, ()),
    ],
)
def test_who_this_node_takes_the_state_from(
    mine: MemberProgress | None, others: dict[str, MemberProgress | None], expected: tuple[str, ...]
) -> None:
    assert diverged_from(mine, others) == expected


@pytest.mark.parametrize(
    ("mine", "others", "expected"),
    [
        # within the lag: nothing, whether the plan is the same or newer and not yet in force for us
        (P(100, 3, 40, 7), {"b": P(118, 3, 40, 7)}, ()),
        (P(100, 2, 20, 5), {"b": P(118, 3, 110, 9)}, ()),
        # further behind than a member of one ring can be: we yield, to the same plan too
        (P(100, 3, 40, 7), {"b": P(119, 3, 40, 7)}, ("b",)),
        # a newer plan that took effect beyond our step: we would never get there
        (P(100, 2, 20, 5), {"b": P(160, 3, 150, 9)}, ("b",)),
        # far ahead but with a lesser plan: that member yields (to our plan), not us
        (P(100, 3, 60, 9), {"b": P(500, 2, 20, 5)}, ()),
        # we are the ones ahead: nothing
        (P(500, 3, 40, 7), {"b": P(100, 3, 40, 7)}, ()),
        # several ahead: those with the greatest plan
        (P(100, 3, 40, 7), {"b": P(200, 3, 40, 7), "c": P(150, 4, 120, 1)}, ("c",)),
    ],
)
def test_a_member_too_far_behind_takes_the_state_of_those_ahead(
    mine: MemberProgress, others: dict[str, MemberProgress | None], expected: tuple[str, ...]
) -> None:
    assert diverged_from(mine, others, lag_steps=18) == expected


@pytest.mark.parametrize(
    "pair",
    [
        (P(100, 2, 20, 5), P(100, 3, 60, 9)),
        (P(100, 3, 60, 1), P(100, 3, 60, 2)),
        (P(100, 3, 60, 1), P(300, 3, 60, 1)),  # far apart with one plan
        (P(800, 2, 20, 5), P(100, 3, 60, 9)),  # the lesser plan far ahead
        (P(100, 2, 20, 5), P(800, 3, 60, 9)),  # the greater plan far ahead
        (P(100, 3, 40, 7, 90, 1), P(100, 3, 40, 7, 80, 2)),  # one plan, schedules parted
        (P(100, 3, 40, 7, 90, 1), P(100, 3, 40, 7, 90, 2)),
    ],
)
@pytest.mark.parametrize("lag_steps", [0, 18])
def test_of_two_diverged_members_at_most_one_yields(
    pair: tuple[MemberProgress, MemberProgress], lag_steps: int
) -> None:
    a, b = pair
    yields = (bool(diverged_from(a, {"b": b}, lag_steps)), bool(diverged_from(b, {"a": a}, lag_steps)))
    assert yields != (True, True)
    if a.plan != b.plan:  # different plans can never meet in a round: exactly one must yield
        assert yields in ((True, False), (False, True))


def _in_step_reports(seed: int, steps: int = 120) -> list[MemberProgress]:
    """What one member of a healthy ring reports after each step: plans adopted at their effective steps
    (at the end of the step before), control rounds launched and landed every few steps, each changing the
    schedule's digest (labelled with the step it changed during, seen from the next report on)."""
    rng = random.Random(seed)
    changed, digest = 0, rng.getrandbits(64)
    live = pending = (0, 0, 0)  # (version, effective step, digest) of the plan in force, and of the next one
    reports = []
    for t in range(steps):
        if rng.random() < 0.3:  # a control round launched or landed during step t
            changed, digest = t, rng.getrandbits(64)
        if rng.random() < 0.1:  # a plan decided now takes effect at the next step, or a later one
            pending = (pending[0] + 1, t + 1 + rng.randrange(3), rng.getrandbits(64))
        if pending[1] <= t + 1:
            live = pending
        reports.append(P(t + 1, *live, changed, digest))
    return reports


@pytest.mark.parametrize("seed", range(8))
def test_members_of_one_ring_never_yield_to_each_other_whatever_their_step_gap(seed: int) -> None:
    reports = _in_step_reports(seed)
    for i, behind in enumerate(reports):
        for ahead in reports[i + 1 : i + 12]:
            assert diverged_from(ahead, {"b": behind}) == (), (ahead, behind)
            assert diverged_from(behind, {"b": ahead}) == (), (behind, ahead)


def _costs(n: int = 4) -> list[LayerCost]:
    return [LayerCost(f"l{i}", 0.01, 0.02, 10**6) for i in range(n)]


def test_a_plan_digest_names_its_rounds_not_its_predictions() -> None:
    plan = even_plan(_costs(), 4, version=3, effective_step=60)
    same_rounds = dataclasses.replace(plan, compute_s=plan.compute_s * 2, exposed_s=(1.0,) * plan.period)
    assert plan.digest() == same_rounds.digest()
    for other in (
        even_plan(_costs(), 4, version=4, effective_step=60),
        even_plan(_costs(), 4, version=3, effective_step=61),
        even_plan(_costs(), 2, version=3, effective_step=60),
        even_plan(_costs(), 4, version=3, effective_step=60, delay=1),
    ):
        assert other.digest() != plan.digest()
    assert 0 <= plan.digest() < 2**64


def test_heartbeat_answers_carry_progress_both_ways() -> None:
    info = TrainingInfo(
        "dreamddp", 123, 4, 100, "summary", plan_digest=2**64 - 1, schedule_step=110, schedule_digest=2**63 + 5
    )
    resp = serde.probe_response(7, 0, 0, info.progress())
    back = type(resp).FromString(resp.SerializeToString())
    assert serde.progress_from_probe(back) == MemberProgress(123, 4, 100, 2**64 - 1, 110, 2**63 + 5)
    # a member without a trainer (or built before the field existed) reports none
    assert serde.progress_from_probe(serde.probe_response(7, 0, 0)) is None


@pytest.mark.parametrize(
    ("hold_s", "seen", "expected"),
    [
        # far ahead at once and still: held only once the lead lasted hold_s
        (2.0, [(0.0, {"b"}), (1.0, {"b"}), (1.9, {"b"})], frozenset()),
        (2.0, [(0.0, {"b"}), (1.0, {"b"}), (2.0, {"b"})], frozenset({"b"})),
        # a break restarts the clock: a lead that closed in between is a new lead
        (2.0, [(0.0, {"b"}), (1.0, set()), (2.5, {"b"}), (3.0, {"b"})], frozenset()),
        (2.0, [(0.0, {"b"}), (1.0, set()), (2.5, {"b"}), (4.5, {"b"})], frozenset({"b"})),
        # each member on its own clock
        (2.0, [(0.0, {"b"}), (1.5, {"b", "c"}), (2.0, {"b", "c"})], frozenset({"b"})),
        # no hold: far ahead is enough (as diverged_from without a holder)
        (0.0, [(5.0, {"b", "c"})], frozenset({"b", "c"})),
    ],
)
def test_a_lead_counts_once_it_lasted(
    hold_s: float, seen: list[tuple[float, set[str]]], expected: frozenset[str]
) -> None:
    hold = LagHold(hold_s)
    got: frozenset[str] = frozenset()
    for now, far in seen:
        got = hold.held(frozenset(far), now)
    assert got == expected


def test_a_lead_not_held_yet_yields_only_to_a_missed_plan() -> None:
    mine = P(100, 2, 20, 5)
    others = {"b": P(200, 2, 20, 5), "c": P(101, 3, 60, 9)}
    assert far_ahead(mine, others, 14) == frozenset({"b"})
    # the far member is not held: only the plan rule speaks
    assert diverged_from(mine, others, 14, far=frozenset()) == ("c",)
    # held: it counts too, and of the two the greater plan's holder serves the state
    assert diverged_from(mine, others, 14, far=frozenset({"b"})) == ("c",)
    assert diverged_from(mine, {"b": others["b"]}, 14, far=frozenset({"b"})) == ("b",)
    with pytest.raises(ValueError, match="hold_s must be >= 0"):
        LagHold(-1.0)


def test_the_leading_step_is_the_highest_heard_or_shown_by_a_frame() -> None:
    lead = LeadingStep()
    told: list[int] = []
    lead.on_change = told.append
    lead.heard({"a": MemberProgress(7), "b": None, "c": MemberProgress(3)})
    assert lead.step == 7
    lead.launched(12)  # a frame showed a member past step 12, before its heartbeat says so
    lead.launched(9)  # older news changes nothing
    assert lead.step == 12
    lead.heard({"a": MemberProgress(10)})  # a heartbeat older than the frame keeps the frame's step
    assert lead.step == 12
    lead.heard({"a": MemberProgress(15)})
    assert (lead.step, told) == (15, [7, 12, 15])
