"""`bench chaos`'s pure parts: the fault schedule's limits and the report's arithmetic."""

from __future__ import annotations

import itertools
import random
from typing import Any

import pytest

from dreamp2p.devtools.bench.chaos.plan import (
    Action,
    ChaosTiming,
    Fault,
    FaultSchedule,
    Kill,
    KillSchedule,
    counter_in_window,
    digests_agree,
    fault_recoveries,
    fault_summary,
    flap_times,
    frontier,
    goodput,
    kill_outcomes,
    longest_gap_s,
    p50_max,
    p50_p99_max,
    percentile,
    recovery_s,
    rss_growth,
    split_lives,
    steps_per_s,
    view_rejoins,
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


def simulate_faults(
    timing: ChaosTiming, seed: int, join_s: float = 2.0, seconds: float = 1200.0, dt: float = 0.25
) -> tuple[list[tuple[float, Action]], int, dict[str, int]]:
    """Drive a schedule of every kind against a simulated cluster: every action with its time, the most
    members ever down at once (killed or joining, frozen, or cut off) and the schedule's own counts."""
    schedule = FaultSchedule(timing, MEMBERS, random.Random(seed), start=0.0)
    training = set(MEMBERS)
    back_at: dict[str, float] = {}
    frozen: set[str] = set()
    cut: set[str] = set()
    log: list[tuple[float, Action]] = []
    worst = 0
    t = 0.0
    while t < seconds:
        for m, at in list(back_at.items()):
            if t >= at:
                training.add(m)
                del back_at[m]
        for a in schedule.due(t, set(training)):
            log.append((t, a))
            if a.kind == "kill":
                training.discard(a.member)
            elif a.kind == "restart":
                back_at[a.member] = t + join_s
            elif a.kind == "stop":
                frozen.add(a.member)  # a frozen daemon is alive and has stepped: it counts as training
            elif a.kind == "cont":
                frozen.discard(a.member)
            elif a.kind == "partition":
                cut |= set(a.group)
            elif a.kind == "heal":
                cut -= set(a.group)
        worst = max(worst, len(set(MEMBERS) - training | frozen | cut))
        t += dt
    return log, worst, schedule.counts


MIXES = [("kill", "stop", "partition"), ("stop",), ("partition",), ("kill", "stop"), ("stop", "partition")]


@pytest.mark.parametrize("kinds", MIXES)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_every_asked_kind_is_drawn_within_limits(kinds: tuple[str, ...], seed: int) -> None:
    timing = ChaosTiming(
        10.0, 1.0, 5.0, 2, frozenset({"a"}), kinds, 2.0, 8.0, 0.2, 40.0, 3.0, 12.0, 0.5
    )  # stops 2-8 s, a fifth of them 8-40 s; partitions 3-12 s
    log, worst, counts = simulate_faults(timing, seed)
    made = {k: sum(1 for _, a in log if a.kind == k) for k in ("kill", "stop", "partition")}
    for kind in ("kill", "stop", "partition"):
        assert (made[kind] > 0) is (kind in kinds), made
    assert worst <= timing.max_down
    assert {k: made[k] for k in kinds} == counts
    under: dict[str, tuple[str, float]] = {}  # member -> (the fault it is under, since when)
    partition_open = False
    durations: dict[str, list[float]] = {"stop": [], "partition": []}
    for t, a in log:
        members = a.group or (a.member,)
        assert "a" not in members  # the protected member
        if a.kind in ("kill", "stop", "partition"):
            for m in members:
                assert m not in under, f"{m} under {under[m]} and {a.kind} at {t}"
                under[m] = (a.kind, t)
            if a.kind == "partition":
                assert not partition_open
                partition_open = True
                assert 1 <= len(a.group) <= 2 and a.group == tuple(sorted(a.group))
            if a.kind != "kill":
                durations[a.kind].append(a.lasts_s)
        else:
            started = {under.pop(m)[1] for m in members}
            assert len(started) == 1
            lasted = t - started.pop()
            if a.kind == "heal":
                partition_open = False
                assert 3.0 <= lasted <= 12.0 + 0.25
            elif a.kind == "cont":
                assert 2.0 <= lasted <= 40.0 + 0.25
            else:
                assert 1.0 <= lasted <= 5.0 + 0.25
    assert all(2.0 <= d <= 40.0 for d in durations["stop"])
    assert all(3.0 <= d <= 12.0 for d in durations["partition"])


@pytest.mark.parametrize("kinds", MIXES)
def test_same_seed_same_plan_other_seed_another(kinds: tuple[str, ...]) -> None:
    timing = ChaosTiming(10.0, 1.0, 5.0, 2, frozenset({"a"}), kinds, long_stop_p=0.2, long_stop_max_s=40.0)
    first, _, _ = simulate_faults(timing, seed=7, seconds=600.0)
    again, _, _ = simulate_faults(timing, seed=7, seconds=600.0)
    other, _, _ = simulate_faults(timing, seed=8, seconds=600.0)
    assert first == again
    assert first != other


@pytest.mark.parametrize(("long_p", "lo", "hi"), [(0.0, 2.0, 8.0), (1.0, 8.0, 90.0)])
def test_long_freezes_come_from_the_tail_bounded_by_its_option(long_p: float, lo: float, hi: float) -> None:
    timing = ChaosTiming(5.0, kinds=("stop",), stop_min_s=2.0, stop_max_s=8.0, long_stop_p=long_p, long_stop_max_s=90.0)
    log, _, _ = simulate_faults(timing, seed=3, seconds=3000.0)
    lasts = [a.lasts_s for _, a in log if a.kind == "stop"]
    assert len(lasts) >= 10
    assert all(lo <= x <= hi for x in lasts)


@pytest.mark.parametrize(("oneway_p", "expect"), [(0.0, {False}), (1.0, {True}), (0.5, {False, True})])
def test_partitions_are_one_way_with_their_probability(oneway_p: float, expect: set[bool]) -> None:
    timing = ChaosTiming(5.0, kinds=("partition",), partition_min_s=1.0, partition_max_s=3.0, oneway_p=oneway_p)
    log, _, _ = simulate_faults(timing, seed=4, seconds=600.0)
    assert {a.oneway for _, a in log if a.kind == "partition"} == expect


def test_end_all_ends_freezes_and_the_partition_now_but_not_restarts() -> None:
    timing = ChaosTiming(
        1.0,
        1000.0,
        1000.0,
        4,
        kinds=("kill", "stop", "partition"),
        stop_min_s=500.0,
        stop_max_s=500.0,
        long_stop_max_s=500.0,
        partition_min_s=20.0,
        partition_max_s=20.0,
    )
    # the first three faults are one of each kind, in the order seed 1 shuffles them
    schedule = FaultSchedule(timing, MEMBERS, random.Random(1), start=0.0)
    training, t, made = set(MEMBERS), 0.0, set()
    while not (made >= {"kill", "stop"} and schedule.cut is not None):
        assert t < 300.0, made
        for a in schedule.due(t, set(training)):
            made.add(a.kind)
            if a.kind == "kill":
                training.discard(a.member)
        t += 0.5
    ends = schedule.end_all(t)
    assert {a.kind for a in ends} == {"cont", "heal"}
    assert schedule.cont_at == {} and schedule.cut is None
    assert set(schedule.restart_at) == set(MEMBERS) - training  # the killed come back when due, not now
    assert schedule.due(t + 1.0, training, killing=False) == []


@pytest.mark.parametrize("kinds", MIXES)
@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_every_kind_comes_once_in_each_round_of_len_kinds_faults(kinds: tuple[str, ...], seed: int) -> None:
    timing = ChaosTiming(5.0, 1.0, 3.0, 2, frozenset({"a"}), kinds, 1.0, 3.0, 0.0, 3.0, 1.0, 3.0, 0.5)
    log, _, _ = simulate_faults(timing, seed, seconds=300.0)
    made = [a.kind for _, a in log if a.kind in ("kill", "stop", "partition")]
    rounds = [made[i : i + len(kinds)] for i in range(0, len(made) - len(kinds) + 1, len(kinds))]
    assert len(rounds) >= 5, made
    assert all(sorted(r) == sorted(kinds) for r in rounds), made
    if len(kinds) > 1:  # in a random order
        assert len({tuple(r) for r in rounds}) > 1, rounds


def test_a_partition_never_takes_a_majority_nor_comes_without_members() -> None:
    # two members: no minority group exists, the partition stays due forever
    schedule = FaultSchedule(ChaosTiming(1.0, kinds=("partition",)), ["a", "b"], random.Random(0), start=0.0)
    assert all(schedule.due(float(t), {"a", "b"}) == [] for t in range(100))
    none = FaultSchedule(ChaosTiming(1.0, kinds=()), MEMBERS, random.Random(0), start=0.0)
    assert all(none.due(float(t), set(MEMBERS)) == [] for t in range(100))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"kill_every_s": 0.0}, "kill_every_s"),
        ({"stop_min_s": 9.0, "stop_max_s": 2.0}, "stop_min_s"),
        ({"partition_min_s": -1.0}, "partition_min_s"),
        ({"stop_max_s": 30.0, "long_stop_max_s": 20.0}, "long_stop_max_s"),
        ({"long_stop_p": 1.5}, "long_stop_p"),
        ({"oneway_p": -0.1}, "oneway_p"),
        ({"kinds": ("kill", "freeze")}, "kinds"),
        ({"kinds": ("kill", "kill")}, "kinds"),
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


def test_p50_p99_max() -> None:
    assert p50_p99_max([float(x) for x in range(101)]) == {"p50": 50.0, "p99": 99.0, "max": 100.0, "n": 101}
    assert p50_p99_max([]) == {"p50": None, "p99": None, "max": None, "n": 0}


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


def test_fault_recovery_counts_from_the_end_and_waits_for_the_faults_own_members() -> None:
    steps = {"b": [5.0, 20.5, 21.0], "c": [5.0, 20.2], "d": [5.0, 24.0]}
    freeze = Fault("stop", 10.0, 20.0, ("b",), ("c", "d"))
    cut = Fault("partition", 12.0, 20.0, ("c", "d"), ("b",), oneway=True)
    lonely = Fault("stop", 10.0, 20.0, ("c",), ())
    never = Fault("stop", 10.0, 30.0, ("b",), ("c",))
    got = fault_recoveries([freeze, cut, lonely, never], steps, kills=[])
    assert got[:3] == pytest.approx([4.0, 4.0, 0.2])
    assert got[3] is None


def test_fault_recovery_leaves_out_a_member_killed_before_it_could_step() -> None:
    steps = {"b": [20.5], "c": [5.0, 40.0]}  # c's 40.0 is its next life
    got = fault_recoveries([Fault("stop", 10.0, 20.0, ("b",), ("c",))], steps, [Kill(20.3, "c", ("b",))])
    assert got == pytest.approx([0.5])


STEPS = [(0.0, 0), (1.0, 10), (2.0, 20), (2.5, 19), (3.0, 30), (4.0, 36)]


SUMMARY_FAULTS = [
    Fault("stop", 10.0, 14.0, ("b",), ("a", "c")),
    Fault("stop", 20.0, 120.0, ("c",), ("a", "b")),
    Fault("partition", 30.0, 40.0, ("b", "c"), ("a",), oneway=True),
]


@pytest.mark.parametrize(
    ("kinds", "kill_recs", "recs", "expected"),
    [
        (
            ("kill", "stop", "partition"),
            [1.0, None, 3.0],
            [0.5, 2.5, None],
            {
                "kill": {"count": 3, "recovered": 2, "recovery_s": {"p50": 2.0, "p99": 2.98, "max": 3.0, "n": 2}},
                "stop": {
                    "count": 2,
                    "recovered": 2,
                    "recovery_s": {"p50": 1.5, "p99": 2.48, "max": 2.5, "n": 2},
                    "lasted_s": {"p50": 52.0, "max": 100.0, "n": 2},
                },
                "partition": {
                    "count": 1,
                    "recovered": 0,
                    "recovery_s": {"p50": None, "p99": None, "max": None, "n": 0},
                    "lasted_s": {"p50": 10.0, "max": 10.0, "n": 1},
                    "oneway": 1,
                },
            },
        ),
        (  # a kind asked but never made is there with a count of 0; one not asked is not
            ("kill",),
            [],
            [0.5, 2.5, None],
            {"kill": {"count": 0, "recovered": 0, "recovery_s": {"p50": None, "p99": None, "max": None, "n": 0}}},
        ),
    ],
)
def test_fault_summary_per_kind(
    kinds: tuple[str, ...], kill_recs: list[float | None], recs: list[float | None], expected: dict[str, Any]
) -> None:
    assert fault_summary(kinds, kill_recs, SUMMARY_FAULTS, recs) == expected


def test_fault_summary_needs_a_recovery_per_fault() -> None:
    with pytest.raises(ValueError, match="3 faults but 2 recoveries"):
        fault_summary(("stop",), [], SUMMARY_FAULTS, [1.0, 2.0])


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


def _views(**logs: list[tuple[float, str]]) -> dict[str, list[tuple[float, frozenset[str]]]]:
    """member -> [(t, "abc")]: each PEER record's live members as one letter each."""
    return {m: [(t, frozenset(live)) for t, live in log] for m, log in logs.items()}


@pytest.mark.parametrize(
    ("fault", "views", "kills", "expected"),
    [
        # the cut-off side steps on its own at once; the ring is whole again when the last member logs it whole
        (
            Fault("partition", 10.0, 20.0, ("c",), ("a", "b")),
            _views(a=[(15.0, "ab"), (20.5, "ab"), (21.0, "abc")], b=[(22.5, "abc")], c=[(20.4, "c"), (21.5, "abc")]),
            [],
            2.5,
        ),
        # a view logged before the end does not count, even if whole (a one-way cut the view did not see)
        (Fault("stop", 10.0, 20.0, ("b",), ("a",)), _views(a=[(19.0, "ab"), (20.2, "ab")], b=[(20.9, "ab")]), [], 0.9),
        # one member never logs the ring whole again
        (Fault("stop", 10.0, 20.0, ("b",), ("a",)), _views(a=[(21.0, "ab")], b=[(21.0, "b")]), [], None),
        # a member killed after the end before it could log the whole ring counts for neither
        (
            Fault("partition", 10.0, 20.0, ("c",), ("a", "b")),
            _views(a=[(20.3, "abc")], b=[(20.6, "abc")], c=[(30.0, "abc")]),
            [Kill(20.4, "c", ("a", "b"))],
            0.6,
        ),
        # no member at all: nothing to wait for
        (Fault("stop", 10.0, 20.0, (), ()), {}, [], 0.0),
    ],
    ids=["partition", "before-end-ignored", "never-whole", "killed-after", "empty"],
)
def test_view_rejoin_waits_for_every_member_to_log_the_whole_ring(
    fault: Fault, views: dict[str, list[tuple[float, frozenset[str]]]], kills: list[Kill], expected: float | None
) -> None:
    (got,) = view_rejoins([fault], views, kills)
    assert got == (None if expected is None else pytest.approx(expected))


def test_fault_summary_reports_the_rejoins_of_stops_and_partitions() -> None:
    out = fault_summary(("stop", "partition"), [], SUMMARY_FAULTS, [1.0, 2.0, 3.0], [0.5, None, 4.0])
    assert out["stop"]["one_ring_again"] == 1 and out["stop"]["rejoin_s"]["max"] == 0.5
    assert out["partition"]["one_ring_again"] == 1 and out["partition"]["rejoin_s"]["max"] == 4.0
    with pytest.raises(ValueError, match="3 faults but 1 rejoins"):
        fault_summary(("stop",), [], SUMMARY_FAULTS, [1.0, 2.0, 3.0], [1.0])


@pytest.mark.parametrize(
    ("loss", "jitter", "emulated"), [(0.0, "0ms", False), (0.001, "0ms", True), (0.0, "5ms", True)]
)
def test_loss_or_jitter_put_the_chaos_paths_through_the_packet_emulator(
    loss: float, jitter: str, emulated: bool
) -> None:
    from dreamp2p.devtools.bench.chaos.run import ChaosRun

    assert ChaosRun(loss=loss, jitter=jitter).emulated is emulated
