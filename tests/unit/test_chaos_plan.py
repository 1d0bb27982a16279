"""`bench chaos`'s pure parts: the kill schedule's limits and the report's arithmetic."""

from __future__ import annotations

import itertools
import random
from typing import Any

import pytest

from dreamp2p.devtools.bench.chaosplan import (
    ChaosTiming,
    Kill,
    KillSchedule,
    counter_in_window,
    digests_agree,
    flap_times,
    frontier,
    goodput,
    kill_outcomes,
    longest_gap_s,
    p50_max,
    percentile,
    recovery_s,
    rss_growth,
    split_lives,
    steps_per_s,
)

MEMBERS = ["a", "b", "c", "d", "e"]


def simulate(
    timing: ChaosTiming, seed: int, join_s: float, seconds: float = 600.0, dt: float = 0.25
) -> tuple[list[tuple[float, str, float]], int]:
    """Drive a schedule against a simulated cluster where a restarted member trains ``join_s`` later.

    Returns (kill time, victim, restart time) per kill and the most members ever not training at once.
    """
    schedule = KillSchedule(timing, MEMBERS, random.Random(seed), start=0.0)
    training = set(MEMBERS)
    back_at: dict[str, float] = {}
    kills: dict[str, float] = {}
    log: list[tuple[float, str, float]] = []
    worst = 0
    t = 0.0
    while t < seconds:
        for m, at in list(back_at.items()):
            if t >= at:
                training.add(m)
                del back_at[m]
        for action in schedule.due(t, set(training)):
            if action.kind == "kill":
                assert action.member in training
                training.discard(action.member)
                kills[action.member] = t
            else:
                log.append((kills.pop(action.member), action.member, t))
                back_at[action.member] = t + join_s
        worst = max(worst, len(MEMBERS) - len(training))
        t += dt
    return log, worst


@pytest.mark.parametrize(
    ("max_down", "every", "down", "join_s", "seed"),
    [
        (2, 20.0, (2.0, 20.0), 5.0, 0),
        (2, 20.0, (2.0, 20.0), 30.0, 1),  # slow joins: kills must wait for them
        (2, 5.0, (2.0, 20.0), 3.0, 2),  # kills due far more often than members come back
        (1, 10.0, (5.0, 5.0), 0.0, 3),
        (3, 4.0, (1.0, 3.0), 1.0, 4),
    ],
)
def test_never_more_than_max_down_and_restart_delays_in_range(
    max_down: int, every: float, down: tuple[float, float], join_s: float, seed: int
) -> None:
    timing = ChaosTiming(every, down[0], down[1], max_down, frozenset({"a"}))
    log, worst = simulate(timing, seed, join_s)
    assert worst <= max_down
    assert log, "nobody was killed in 600 simulated seconds"
    assert all(victim != "a" for _, victim, _ in log)  # the protected member
    for killed, _, restarted in log:
        # restarts are looked at every 0.25 simulated seconds
        assert down[0] <= restarted - killed <= down[1] + 0.25


@pytest.mark.parametrize(("every", "expect_at_least"), [(20.0, 20), (60.0, 7)])
def test_kills_come_about_every_period_when_members_return_fast(every: float, expect_at_least: int) -> None:
    log, _ = simulate(ChaosTiming(every, 0.5, 1.0, 2), seed=5, join_s=0.0)
    # gaps are drawn in [0.75, 1.25] x every: 600 s hold at least 600 / (1.25 every) kills
    assert len(log) >= expect_at_least
    kill_times = sorted(k for k, _, _ in log)  # the log is in restart order
    gaps = [b - a for a, b in itertools.pairwise(kill_times)]
    assert min(gaps) >= 0.75 * every


def test_a_due_kill_waits_while_max_down_are_down() -> None:
    schedule = KillSchedule(ChaosTiming(1.0, 100.0, 100.0, 1), MEMBERS, random.Random(0), start=0.0)
    first = schedule.due(2.0, set(MEMBERS))
    assert [a.kind for a in first] == ["kill"]
    down = first[0].member
    training = set(MEMBERS) - {down}
    assert schedule.due(10.0, training) == []  # one down already: no second kill
    assert schedule.due(50.0, training) == []
    back = schedule.due(200.0, training)  # the restart comes due; the member still joins
    assert [(a.kind, a.member) for a in back] == [("restart", down)]
    assert schedule.due(201.0, training) == []  # joining counts as down
    assert [a.kind for a in schedule.due(202.0, set(MEMBERS))] == ["kill"]


def test_no_kills_once_the_chaos_is_over_but_restarts_still_come() -> None:
    schedule = KillSchedule(ChaosTiming(1.0, 2.0, 2.0, 2), MEMBERS, random.Random(0), start=0.0)
    (kill,) = schedule.due(2.0, set(MEMBERS))
    training = set(MEMBERS) - {kill.member}
    assert schedule.due(3.0, training, killing=False) == []
    assert [a.kind for a in schedule.due(10.0, training, killing=False)] == ["restart"]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"kill_every_s": 0.0}, "kill_every_s"),
        ({"down_min_s": 5.0, "down_max_s": 2.0}, "down_min_s"),
        ({"down_min_s": -1.0}, "down_min_s"),
        ({"max_down": 0}, "max_down"),
    ],
)
def test_timing_refuses_bad_values(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ChaosTiming(**kwargs)


@pytest.mark.parametrize(
    ("duration", "every", "down", "expected"),
    [
        (600.0, 180.0, 10.0, [90.0, 270.0, 450.0]),
        (120.0, 180.0, 10.0, [90.0]),
        (95.0, 180.0, 10.0, []),  # the only flap would not be over before the end
        (30.0, 12.0, 3.0, [6.0, 18.0]),
        (600.0, 0.0, 10.0, []),
    ],
)
def test_flap_times(duration: float, every: float, down: float, expected: list[float]) -> None:
    assert flap_times(duration, every, down) == expected


@pytest.mark.parametrize(
    ("values", "q", "expected"),
    [
        ([], 50, None),
        ([3.0], 50, 3.0),
        ([1.0, 2.0, 3.0], 50, 2.0),
        ([4.0, 1.0, 3.0, 2.0], 50, 2.5),
        ([1.0, 2.0, 3.0, 4.0, 5.0], 0, 1.0),
        ([1.0, 2.0, 3.0, 4.0, 5.0], 100, 5.0),
        ([0.0, 10.0], 90, 9.0),
    ],
)
def test_percentile(values: list[float], q: float, expected: float | None) -> None:
    assert percentile(values, q) == expected


def test_p50_max() -> None:
    assert p50_max([0.5, 2.0, 1.0, 7.25]) == {"p50": 1.5, "max": 7.25, "n": 4}
    assert p50_max([]) == {"p50": None, "max": None, "n": 0}


@pytest.mark.parametrize(
    ("survivors", "expected"),
    [
        ({"b": [9.0, 10.5, 11.0], "c": [10.2]}, 0.5),  # the slower survivor decides
        ({"b": [10.1]}, 0.1),
        ({"b": [10.1], "c": [9.0]}, None),  # c never stepped again
        ({}, 0.0),
    ],
)
def test_recovery_is_the_slowest_survivors_next_step(survivors: dict[str, list[float]], expected: float | None) -> None:
    got = recovery_s(10.0, survivors)
    assert got == pytest.approx(expected) if expected is not None else got is None


@pytest.mark.parametrize(
    ("survivors", "end", "expected"),
    [
        ({"b": [10.5, 11.0, 14.0, 14.5]}, 15.0, 3.0),
        ({"b": [11.0], "c": [10.2, 10.4]}, 12.0, 1.6),  # c has stepped nothing since 10.4
        ({"b": [9.0]}, 13.0, 3.0),  # stuck for the whole window
    ],
)
def test_longest_gap(survivors: dict[str, list[float]], end: float, expected: float) -> None:
    assert longest_gap_s(10.0, end, survivors) == pytest.approx(expected)


def test_kill_outcomes_leave_out_a_survivor_killed_before_it_could_step() -> None:
    kills = [Kill(10.0, "a", ("b", "c")), Kill(10.3, "c", ("b",))]
    steps = {"b": [9.0, 10.8, 11.0], "c": [9.5, 30.0]}  # c's 30.0 is its next life
    first, second = kill_outcomes(kills, steps, end=100.0, window_s=20.0)
    assert first.recovery_s == pytest.approx(0.8)  # b alone: c died at 10.3 without a step since 10.0
    assert first.longest_gap_s == pytest.approx(0.3)  # the window ends at the next kill
    assert second.recovery_s == pytest.approx(0.5)
    assert second.longest_gap_s == pytest.approx(30.3 - 11.0)  # b's last step to the window's end


def test_kill_outcomes_say_when_a_survivor_never_stepped_again() -> None:
    (out,) = kill_outcomes([Kill(10.0, "a", ("b", "c"))], {"b": [11.0], "c": [5.0]}, end=40.0, window_s=20.0)
    assert out.recovery_s is None
    assert out.longest_gap_s == pytest.approx(20.0)


STEPS = [(0.0, 0), (1.0, 10), (2.0, 20), (2.5, 19), (3.0, 30), (4.0, 36)]


@pytest.mark.parametrize(("at", "expected"), [(-1.0, -1), (0.0, 0), (2.7, 20), (9.0, 36)])
def test_frontier_is_the_furthest_step_any_member_completed(at: float, expected: int) -> None:
    assert frontier(STEPS, at) == expected


@pytest.mark.parametrize(("t0", "t1", "expected"), [(0.0, 3.0, 10.0), (1.0, 4.0, 26 / 3), (3.0, 4.0, 6.0)])
def test_steps_per_s(t0: float, t1: float, expected: float) -> None:
    assert steps_per_s(STEPS, t0, t1) == pytest.approx(expected)


def test_steps_per_s_refuses_an_empty_window() -> None:
    with pytest.raises(ValueError, match="empty window"):
        steps_per_s(STEPS, 3.0, 3.0)


@pytest.mark.parametrize(("chaos", "base", "expected"), [(8.0, 10.0, 0.8), (10.0, 10.0, 1.0), (5.0, 0.0, None)])
def test_goodput(chaos: float, base: float, expected: float | None) -> None:
    assert goodput(chaos, base) == expected


@pytest.mark.parametrize(
    ("samples", "warm", "expected"),
    [
        ([(0.0, 100), (1.0, 110)], 0.0, 0.10),
        ([(float(t), 100 + t) for t in range(10)], 0.2, (109 - 101) / 101),  # warm-up: the first 2 samples
        ([(1.0, 120), (0.0, 100)], 0.0, 0.20),  # ordered by time
        ([(0.0, 100)], 0.0, None),
        ([(0.0, 200), (1.0, 150)], 0.0, -0.25),
    ],
)
def test_rss_growth(samples: list[tuple[float, int]], warm: float, expected: float | None) -> None:
    got = rss_growth(samples, warm)
    assert got == pytest.approx(expected) if expected is not None else got is None


PEER = [{"t": 1.0, "rounds_failed": 0}, {"t": 5.0, "rounds_failed": 2}, {"t": 9.0, "rounds_failed": 7}]


@pytest.mark.parametrize(("t0", "t1", "expected"), [(0.0, 10.0, 7), (2.0, 6.0, 2), (5.0, 8.0, 0), (0.0, 0.5, 0)])
def test_counter_in_window(t0: float, t1: float, expected: int) -> None:
    assert counter_in_window(PEER, "rounds_failed", t0, t1) == expected


def test_split_lives_one_per_start_record() -> None:
    records = [
        {"kind": "step", "t": 0.5, "step": 0},  # before any start: ignored
        {"kind": "start", "t": 1.0, "join": False},
        {"kind": "step", "t": 2.0, "step": 0},
        {"kind": "peer", "t": 2.1, "rounds_failed": 0},
        {"kind": "start", "t": 10.0, "join": True},
        {"kind": "join", "t": 11.0, "step": 40},
        {"kind": "step", "t": 11.5, "step": 40},
        {"kind": "stop", "t": 20.0, "step": 60, "digest": "ab"},
    ]
    first, second = split_lives("b", records)
    assert (first.start, first.join, first.joined, first.steps, first.stop) == (1.0, False, False, [(2.0, 0)], None)
    assert len(first.peer) == 1
    assert (second.join, second.joined, second.steps) == (True, True, [(11.5, 40)])
    assert second.stop is not None and second.stop["digest"] == "ab"


@pytest.mark.parametrize(
    ("digests", "expected"),
    [
        ({"a": "x", "b": "x", "c": "x"}, True),
        ({"a": "x", "b": "y"}, False),
        ({"a": "x", "b": None}, False),
        ({}, False),
    ],
)
def test_digests_agree(digests: dict[str, str | None], expected: bool) -> None:
    assert digests_agree(digests) is expected
