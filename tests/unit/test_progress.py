"""The daemon's lines for people: progress cadence and ETA, membership changes, lifecycle lines (pure logic)."""

from __future__ import annotations

import pytest

from dreamp2p.service.progress import Progress, ProgressClock, format_duration, lifecycle_message, membership_change


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(None, "?"), (float("inf"), "?"), (-1.0, "?"), (0.0, "0s"), (44.6, "45s"), (725, "12m05s"), (11220, "3h07m")],
)
def test_format_duration(seconds: float | None, text: str) -> None:
    assert format_duration(seconds) == text


def test_the_first_step_then_every_period_gets_a_line() -> None:
    clock = ProgressClock(10.0)
    # (steps done, time) -> due?
    seen = [clock.due(step, t) for step, t in [(1, 0.0), (2, 4.0), (3, 9.9), (4, 10.0), (5, 15.0), (9, 20.5)]]
    assert seen == [True, False, False, True, False, True]


def test_every_step_with_a_period_of_zero() -> None:
    clock = ProgressClock(0.0)
    assert all(clock.due(step, 1.0) for step in range(1, 5))


def test_eta_follows_the_pace_between_the_last_two_lines() -> None:
    clock = ProgressClock(10.0)
    assert clock.due(1, 0.0) and clock.eta(1, 101) is None  # no pace yet
    assert clock.due(11, 10.0)  # 10 steps in 10 s
    assert clock.eta(11, 101) == pytest.approx(90.0)
    assert clock.due(16, 20.0)  # the link slowed: 5 steps in 10 s
    assert clock.eta(16, 101) == pytest.approx(170.0)
    assert clock.eta(200, 101) == 0.0


def test_a_negative_period_is_refused() -> None:
    with pytest.raises(ValueError):
        ProgressClock(-1.0)


@pytest.mark.parametrize(
    ("before", "after", "lost", "joined"),
    [
        (("a", "b", "c"), ("a", "b", "c"), [], []),
        (("a", "b", "c"), ("a", "c"), ["b"], []),
        (("a", "c"), ("c", "a", "b"), [], ["b"]),
        (("a", "b"), ("a", "c"), ["b"], ["c"]),
    ],
)
def test_membership_change(before: tuple[str, ...], after: tuple[str, ...], lost: list[str], joined: list[str]) -> None:
    assert membership_change(before, after) == (lost, joined)


def test_a_progress_line_says_everything_in_one_line() -> None:
    line = Progress(
        step=120,
        final=1000,
        loss=2.34567,
        tokens_per_s=5234.4,
        hidden_fraction=0.973,
        link_Bps=2.5e6,
        plan_version=3,
        eta_s=725.0,
    )
    assert line.message() == "step 120/1000 loss 2.3457 tok/s 5234 hidden 97% link 20.0 Mbit/s plan v3 ETA 12m05s"
    fields = line.fields()
    assert fields["event"] == "progress" and fields["link_mbit_s"] == pytest.approx(20.0) and fields["eta_s"] == 725.0
    unknown = Progress(1, 10, 5.0, 0.0, 0.0, None, 0, None).message()
    assert "link - Mbit/s" in unknown and unknown.endswith("ETA ?")


@pytest.mark.parametrize(
    ("kind", "fields", "text"),
    [
        (
            "start",
            {"device": "cpu", "params": 1234567, "resume": False, "join": False},
            "node started on cpu: 1,234,567",
        ),
        ("start", {"device": "cpu", "params": 1, "resume": True, "join": False}, "parameters, resuming"),
        ("join", {"step": 40, "resumed": True}, "joined the cluster at step 40 (asked to resume"),
        ("resume", {"step": 30, "path": "/c/ckpt-30.pt"}, "resumed from /c/ckpt-30.pt at step 30"),
        ("checkpoint", {"step": 50, "path": "/c/ckpt-50.pt"}, "checkpoint at step 50: /c/ckpt-50.pt"),
        ("stop", {"step": 60, "signal": "SIGTERM", "checkpoint": "/c/x"}, "stopped at step 60 on SIGTERM; checkpoint"),
        ("stop", {"step": 60, "signal": None, "checkpoint": "/c/x"}, "stopped at step 60; checkpoint /c/x"),
    ],
)
def test_lifecycle_lines(kind: str, fields: dict[str, object], text: str) -> None:
    message = lifecycle_message(kind, fields)
    assert message is not None and text in message, message


@pytest.mark.parametrize("kind", ["step", "eval", "link", "peer"])
def test_records_that_are_not_lifecycle_events_have_no_line(kind: str) -> None:
    assert lifecycle_message(kind, {"step": 1}) is None
