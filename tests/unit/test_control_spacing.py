"""DreamDDP's control rounds space out while the link holds steady and come back to full pace on a change:
the spacing rule itself, the re-planner's memory behind it, and members (and a joiner) that agree on it."""

from __future__ import annotations

import math

import pytest

from dreamp2p.config.sync import SyncConfig
from dreamp2p.schedule.cost import LayerCost
from dreamp2p.schedule.dreamddp import warmup_plan
from dreamp2p.sync.comm.inprocess import InProcessHub
from dreamp2p.sync.model.groups import GROUP_CONTROL
from dreamp2p.sync.strategies.control import Gathered, Replanner, control_interval
from dreamp2p.sync.strategies.dreamddp import DreamDDP
from tests.unit.test_strategy_logic import config, local_step, members, train


@pytest.mark.parametrize(
    ("every", "backoff", "quiet", "want"),
    [
        (10, 4, 0, 10),
        (10, 4, 1, 20),
        (10, 4, 2, 40),
        (10, 4, 7, 40),
        (10, 1, 5, 10),  # backoff 1: the fixed grid
        (10, 3, 1, 20),
        (10, 3, 2, 30),
        (5, 8, 3, 40),
        (4, 4, 10**6, 16),  # no overflow however long the link holds
    ],
)
def test_control_interval_doubles_per_quiet_round_up_to_the_backoff(
    every: int, backoff: int, quiet: int, want: int
) -> None:
    assert control_interval(every, backoff, quiet) == want


def gathered(bw: float) -> Gathered:
    return Gathered(bw, 0.01, (LayerCost("l0", 0.01, 0.02, 4096),), (bw,))


def test_only_steady_rounds_after_the_first_measured_plan_count_as_quiet() -> None:
    cfg = SyncConfig(strategy="dreamddp", period=4, control_every=4, replan_sustain=2, replan_threshold=0.5)
    r = Replanner(cfg)
    plan = warmup_plan([LayerCost("l0", 0.0, 0.0, 4096)], 4, 1, delay=3)
    assert r.decide(gathered(math.inf), 4, plan, 1, 2) is None  # the link is not measured yet
    assert r.quiet == 0 and r.control_interval() == 4
    assert r.decide(gathered(1e6), 8, plan, 1, 2) is not None  # the first measured plan
    assert r.quiet == 0
    assert r.decide(gathered(1.2e6), 12, plan, 2, 2) is None  # within the threshold: steady
    assert (r.quiet, r.control_interval()) == (1, 8)
    assert r.decide(gathered(0.9e6), 20, plan, 2, 2) is None
    assert (r.quiet, r.control_interval()) == (2, 16)
    assert r.decide(gathered(0.3e6), 36, plan, 2, 2) is None  # a change: watched at full pace again
    assert (r.changed, r.quiet, r.control_interval()) == (1, 0, 4)
    assert r.decide(gathered(0.3e6), 40, plan, 2, 2) is not None  # sustained: re-planned
    assert r.quiet == 0
    assert [step for step, _, _ in r.seen()] == [4, 8, 12, 20, 36, 40]
    state = r.state()
    again = Replanner(cfg)
    again.load(state)
    assert (again.quiet, again.changed, again.basis_bw) == (r.quiet, r.changed, r.basis_bw)


def control_launches(hub: InProcessHub) -> list[int]:
    """Steps at which the control rounds were launched (round ids are step + 1), each counted once."""
    return sorted({r.round_id - 1 for r in hub.rounds if r.group_id == GROUP_CONTROL})


@pytest.mark.parametrize(
    ("backoff", "want"),
    [
        (4, [2, 6, 10, 18, 34, 50]),  # the first plan decided at 4, then 1, 2, 3 quiet rounds: 4, 8, 16, 16 apart
        (1, [2, 6, 10, 14, 18, 22, 26, 30, 34, 38, 42, 46, 50, 54]),
        (2, [2, 6, 10, 18, 26, 34, 42, 50]),
    ],
)
def test_members_space_their_control_rounds_alike_on_a_steady_link(backoff: int, want: list[int]) -> None:
    hub = InProcessHub(3, goodput_Bps=10e6, rtt_s=0.001)
    strategies = members(hub, config("dreamddp", max_delay=2, control_backoff=backoff))
    train(strategies, 56)
    assert control_launches(hub) == want
    rounds = [r for r in hub.rounds if r.group_id == GROUP_CONTROL]
    assert len(rounds) == len(want)  # one round per launch, so every member launched each of them
    assert len({s.next_control_step for s in strategies if isinstance(s, DreamDDP)}) == 1
    assert {tuple(s.plan_history) for s in strategies if isinstance(s, DreamDDP)} == {((0, 0), (1, 8))}


def test_a_change_brings_control_rounds_back_to_full_pace_and_re_plans() -> None:
    hub = InProcessHub(2, goodput_Bps=10e6, rtt_s=0.001)
    strategies = members(hub, config("dreamddp", max_delay=2, replan_sustain=2))

    def slow_down(rank: int, s: object) -> None:
        if rank == 0 and isinstance(s, DreamDDP) and s.step_count == 40:
            hub.goodput_Bps = 1e6  # far from the next control round (34, then 50): no member reads it mid-way

    train(strategies, 72, after=slow_down)
    # steady until 34 (next one 16 later, at 50); 50 sees the change and pulls the next to 54, which confirms
    # it (replan_sustain 2): the plan made there takes effect at the next period boundary, then full pace
    assert control_launches(hub) == [2, 6, 10, 18, 34, 50, 54, 58, 62, 70]
    histories = {tuple(s.plan_history) for s in strategies if isinstance(s, DreamDDP)}
    assert histories == {((0, 0), (1, 8), (2, 60))}
    for s in strategies:
        assert isinstance(s, DreamDDP)
        seen = [(round(bw), round(goodput)) for step, bw, goodput in s.controls_seen if step >= 52]
        assert seen == [(10**6, 10**6)] * 4


def test_a_joiner_spaces_its_control_rounds_as_the_members_do() -> None:
    """A node that takes a member's state and jumps ahead launches its next control round where the member
    does: the rounds it skipped decided nothing (they included it while it refused their frames)."""
    cfg = config("dreamddp", max_delay=2)
    (member,) = members(InProcessHub(1, goodput_Bps=10e6, rtt_s=0.001), cfg)
    for _ in range(30):
        local_step(member, 0)
    assert isinstance(member, DreamDDP)
    state = member.state_dict()
    assert state["extra"]["next_control"] == 34
    (joiner,) = members(InProcessHub(1, goodput_Bps=10e6, rtt_s=0.001), cfg)
    assert isinstance(joiner, DreamDDP)
    joiner.load_state_dict(state)
    assert joiner.next_control_step == 34
    joiner.jump_to(40)  # past the round at 34: the next is 16 steps after it, as for the member
    while member.step_count < 40:
        local_step(member, 0)
    assert joiner.next_control_step == member.next_control_step == 50


def test_a_checkpoint_without_the_next_control_step_resumes_on_the_fixed_grid() -> None:
    cfg = config("dreamddp", max_delay=2, control_every=5, warmup_steps=3)
    (member,) = members(InProcessHub(1), cfg)
    for _ in range(10):
        local_step(member, 0)
    state = member.state_dict()
    del state["extra"]["next_control"]
    (loaded,) = members(InProcessHub(1), cfg)
    assert isinstance(loaded, DreamDDP)
    loaded.load_state_dict(state)
    assert loaded.next_control_step == 13  # warm-up 3, every 5: the grid point at or after step 10


def test_control_backoff_must_be_at_least_one() -> None:
    with pytest.raises(ValueError, match=r"sync\.control_backoff must be >= 1"):
        SyncConfig(strategy="dreamddp", control_backoff=0)
