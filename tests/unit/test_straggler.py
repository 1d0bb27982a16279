"""The straggler policy (`dreamp2p.peer.straggler`): the deadline model, who is late, strikes, probation."""

from __future__ import annotations

import math
import re

import pytest

from dreamp2p.config import TransportConfig
from dreamp2p.messages import RoundEvidence
from dreamp2p.peer.straggler import (
    StragglerPolicy,
    StragglerRule,
    deadline_s,
    expected_s,
    late_members,
    rule_of,
    shared_settings,
)

MB = 1_000_000
FAST = 100e6  # bytes/s
SLOW = 0.2e6


def ev(rate: float, part_s: float, sent: int = MB) -> RoundEvidence:
    return RoundEvidence(sent_bytes=sent, link_Bps=rate, part_s=part_s)


@pytest.mark.parametrize(
    ("nbytes", "rate", "compute", "expect"),
    [
        (MB, 1e6, 0.0, 1.0),
        (MB, 2e6, 0.5, 1.0),
        (0, 1e6, 0.25, 0.25),
        (MB, 0.0, 0.0, math.inf),
        (MB, math.nan, 0.0, math.inf),
        (MB, -1.0, 0.0, math.inf),
    ],
)
def test_expected_seconds(nbytes: int, rate: float, compute: float, expect: float) -> None:
    assert expected_s(nbytes, rate, compute) == pytest.approx(expect)


@pytest.mark.parametrize(
    ("expected", "margin", "floor", "deadline"),
    [(1.0, 3.0, 5.0, 5.0), (2.0, 3.0, 5.0, 6.0), (0.0, 3.0, 2.0, 2.0), (10.0, 1.5, 0.5, 15.0)],
)
def test_deadline_is_margin_times_expected_with_a_floor(
    expected: float, margin: float, floor: float, deadline: float
) -> None:
    assert deadline_s(expected, margin, floor) == pytest.approx(deadline)


@pytest.mark.parametrize(
    ("evidence", "late"),
    [
        # one slow link holds the round 5 s (1 MB at 0.2 MB/s) against a deadline of max(1, 3 x 0.01 s)
        ({"a": ev(FAST, 5.0), "b": ev(FAST, 5.0), "c": ev(SLOW, 5.0)}, ("c",)),
        # the same slow link, but the round finished within the floor: nobody is late
        ({"a": ev(FAST, 0.9), "b": ev(FAST, 0.9), "c": ev(SLOW, 0.9)}, ()),
        # a slow round that no member's link explains (a late arrival, compute): nobody is blamed
        ({"a": ev(FAST, 9.0), "b": ev(FAST, 9.0), "c": ev(FAST, 1.0)}, ()),
        # every link equally slow: the median is slow too, so the deadline is long enough
        ({"a": ev(SLOW, 5.0), "b": ev(SLOW, 5.0), "c": ev(SLOW, 5.0)}, ()),
        # two known rates are no majority: nobody is judged
        ({"a": ev(FAST, 5.0), "b": ev(0.0, 5.0), "c": ev(SLOW, 5.0)}, ()),
        # a member that sent nothing is not judged
        ({"a": ev(FAST, 5.0), "b": ev(FAST, 5.0), "c": ev(SLOW, 5.0, sent=0)}, ()),
        # two slow of five: both late against the median of the five
        (
            {"a": ev(FAST, 5.0), "b": ev(FAST, 5.0), "c": ev(SLOW, 5.0), "d": ev(FAST, 5.0), "e": ev(SLOW, 5.0)},
            ("c", "e"),
        ),
    ],
)
def test_late_members(evidence: dict[str, RoundEvidence], late: tuple[str, ...]) -> None:
    assert late_members(evidence, margin=3.0, floor_s=1.0) == late


RULE = StragglerRule(margin=3.0, floor_s=1.0, strikes=2, probation_s=10.0, max_backoff=4, settle_rounds=3)
SLOW_ROUND = {"a": ev(FAST, 5.0), "b": ev(FAST, 5.0), "c": ev(SLOW, 5.0)}
# a large round every link carries in time (100 MB at 100 MB/s: 1 s, deadline 3 s)
GOOD_ROUND = {m: ev(FAST, 1.2, sent=100 * MB) for m in "abc"}
# a small round: within the floor, and the slow link would carry its bytes within the floor too
SMALL_ROUND = {"a": ev(FAST, 0.1, sent=10_000), "b": ev(FAST, 0.1, sent=10_000), "c": ev(SLOW, 0.1, sent=10_000)}
ROUNDS = {"S": SLOW_ROUND, "G": GOOD_ROUND, "s": SMALL_ROUND}


@pytest.mark.parametrize(
    ("rounds", "evicted_at"),
    [
        ("SS", [1]),  # two late rounds in a row: out after the second
        ("S", []),
        ("SGSG", []),  # never two in a row: no strike count builds up
        ("SGSS", [3]),
        ("SSSS", [1]),  # once out it is not judged (it takes no part)
        ("SsS", [2]),  # a small round between late ones tells nothing: the strikes stand
        ("SsssS", [4]),
        ("SGsS", []),
    ],
)
def test_strikes_in_a_row_exclude(rounds: str, evicted_at: list[int]) -> None:
    policy = StragglerPolicy(RULE, ["a", "b", "c"])
    got = [i for i, r in enumerate(rounds) if policy.observe(ROUNDS[r], now=float(i))]
    assert got == evicted_at
    assert policy.evictions == len(evicted_at)
    assert policy.excluded == (frozenset({"c"}) if evicted_at else frozenset())


def test_probation_ends_and_relapses_double_it_until_the_member_settles() -> None:
    policy = StragglerPolicy(RULE, ["a", "b", "c"])
    now = 0.0
    probations = []
    for _ in range(4):  # excluded, returns, still slow: excluded again for longer (capped at 4x)
        policy.observe(SLOW_ROUND, now)
        assert policy.observe(SLOW_ROUND, now) == ("c",)
        assert policy.expire(now + 0.5) == ()
        until = now
        while not policy.expire(until):
            until += 1.0
        probations.append(until - now)
        now = until
    assert probations == [10.0, 20.0, 40.0, 40.0]
    assert policy.returns == 4 and policy.excluded == frozenset()
    for _ in range(RULE.settle_rounds):  # it keeps up for a while: its relapses are forgiven
        assert policy.observe(GOOD_ROUND, now) == ()
    policy.observe(SLOW_ROUND, now)
    assert policy.observe(SLOW_ROUND, now) == ("c",)
    assert policy.expire(now + 9.0) == () and policy.expire(now + 10.0) == ("c",)


@pytest.mark.parametrize(
    ("members", "in_round", "evicted"),
    [
        (["a", "b", "c"], ["a", "b", "c"], ("c",)),
        (["a", "b"], ["a", "b"], ()),  # two members: excluding one leaves no ring
        (["a", "b", "c", "d"], ["a", "b", "c"], ("c",)),
    ],
)
def test_exclusion_keeps_a_ring(members: list[str], in_round: list[str], evicted: tuple[str, ...]) -> None:
    policy = StragglerPolicy(RULE, members)
    evidence = {m: SLOW_ROUND.get(m, ev(FAST, 5.0)) for m in in_round}
    if len(in_round) < 3:
        evidence = {m: ev(SLOW if m == "b" else FAST, 5.0) for m in in_round}
    policy.observe(evidence, 0.0)
    assert policy.observe(evidence, 0.0) == evicted


def test_at_most_a_minority_is_excluded() -> None:
    policy = StragglerPolicy(RULE, ["a", "b", "c", "d", "e"])
    both = {"a": ev(FAST, 5.0), "b": ev(FAST, 5.0), "c": ev(SLOW, 5.0), "d": ev(FAST, 5.0), "e": ev(SLOW / 2, 5.0)}
    policy.observe(both, 0.0)
    assert policy.observe(both, 0.0) == ("e",)  # the slowest first, one per round
    rest = {m: e for m, e in both.items() if m != "e"}
    assert policy.observe(rest, 0.0) == ("c",)  # 2 of 5 out is still a minority
    policy.observe({"a": ev(FAST, 5.0), "b": ev(FAST, 5.0), "d": ev(SLOW, 5.0)}, 0.0)
    assert policy.observe({"a": ev(FAST, 5.0), "b": ev(FAST, 5.0), "d": ev(SLOW, 5.0)}, 0.0) == ()
    assert policy.excluded == frozenset({"c", "e"})


def test_margin_zero_turns_exclusion_off() -> None:
    policy = StragglerPolicy(StragglerRule(margin=0.0), ["a", "b", "c"])
    for _ in range(5):
        assert policy.observe(SLOW_ROUND, 0.0) == ()
    assert policy.evictions == 0


@pytest.mark.parametrize(
    ("knobs", "error"),
    [
        ({"straggler_margin": 0.0}, None),
        ({"straggler_margin": 3.0, "straggler_floor_s": 0.5}, None),
        ({"straggler_margin": 0.5}, "straggler_margin must be 0 (off) or >= 1"),
        ({"straggler_floor_s": 0.0}, "straggler_floor_s must be > 0"),
        ({"straggler_strikes": 0}, "straggler_strikes must be > 0"),
        ({"straggler_probation_s": -1.0}, "straggler_probation_s must be > 0"),
    ],
)
def test_straggler_knobs_are_checked(knobs: dict[str, float], error: str | None) -> None:
    if error is None:
        TransportConfig(**knobs)  # type: ignore[arg-type]
    else:
        with pytest.raises(ValueError, match=re.escape(error)):
            TransportConfig(**knobs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("knobs", "settings"),
    [
        ({}, {}),  # off: nothing to agree on
        (
            {"straggler_margin": 3.0},
            {"transport.stragglers": "margin 3, floor 5 s, strikes 2, probation 30 s"},
        ),
        (
            {"straggler_margin": 2.5, "straggler_floor_s": 1.5, "straggler_strikes": 3, "straggler_probation_s": 60},
            {"transport.stragglers": "margin 2.5, floor 1.5 s, strikes 3, probation 60 s"},
        ),
    ],
)
def test_the_rule_is_a_shared_setting(knobs: dict[str, float], settings: dict[str, str]) -> None:
    assert shared_settings(rule_of(TransportConfig(**knobs))) == settings  # type: ignore[arg-type]
