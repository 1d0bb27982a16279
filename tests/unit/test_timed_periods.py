"""Time-paced periods (``sync.periods = "time"``): the step window's shares, and members of different speeds
against the in-process collective: the slow one follows the cluster's step clock, takes fewer local steps,
and the merge weighs each member's pseudo-gradient by its share (`dreamp2p.sync.strategies.pacing`)."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from test_strategy_logic import batch, config, each, local_step, make_model, members

from dreamp2p.config.sync import SyncConfig
from dreamp2p.sync.comm.inprocess import InProcessHub
from dreamp2p.sync.model.groups import ANCHOR_OFFSET, GROUP_PARAMS, GROUP_PLAN_BASE, GROUP_TOKENS, SYNCS_PER_PLAN
from dreamp2p.sync.strategies.base import Strategy
from dreamp2p.sync.strategies.pacing import StepWindow, unweigh


@pytest.mark.parametrize(
    ("period", "marks", "share"),
    [
        (4, [], 1.0),  # nothing recorded: a full share
        (4, [True] * 4, 1.0),
        (4, [True, False, False, True], 0.5),
        (4, [False, False, True], 0.5),  # before the window fills, the steps not seen count as trained
        (2, [True, False, False, False, True], 0.5),  # only the last ``period`` marks count
        (5, [False] * 5, 0.0),
    ],
)
def test_a_windows_share_is_its_trained_fraction_of_the_period(period: int, marks: list[bool], share: float) -> None:
    window = StepWindow(period)
    for m in marks:
        window.record(m)
    assert window.share() == pytest.approx(share)
    assert StepWindow(period, window.marks()).share() == window.share()  # saved and restored alike


def test_a_window_needs_a_period() -> None:
    with pytest.raises(ValueError, match="period must be >= 1"):
        StepWindow(0)


def test_unweigh_divides_by_the_mean_share_and_refuses_none() -> None:
    mean = torch.tensor([0.75, -1.5])
    assert unweigh(mean, 0.75)
    torch.testing.assert_close(mean, torch.tensor([1.0, -2.0]))
    assert not unweigh(mean, 0.0)


@pytest.mark.parametrize("strategy", ["ssgd", "localsgd", "co2"])
def test_time_periods_are_refused_where_they_do_not_apply(strategy: str) -> None:
    with pytest.raises(ValueError, match=r"sync\.periods = .time. applies to diloco, streaming, dreamddp"):
        SyncConfig(strategy=strategy, periods="time")
    with pytest.raises(ValueError, match=r"sync\.periods must be one of steps, time"):
        SyncConfig(strategy="diloco", periods="seconds")


def _replay(rank: int, indices: list[int]) -> torch.Tensor:
    """A member's parameters after SGD steps on its batches of these steps of the clock, flattened."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for t in indices:
        x, y = batch(rank, t)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def test_a_member_that_trained_half_the_period_counts_half_in_the_merge() -> None:
    """Member 1 starts only once member 0 waits at the period's end (step 3 of period 4): it trains at step 0,
    follows the clock past steps 1 and 2, and trains at step 3, a share of 0.5. DiLoCo over SGD takes a plain
    outer step (lr 1, momentum 0), so the global copy becomes (p0 + 0.5 p1) / 1.5 exactly as replayed."""
    hub = InProcessHub(2)
    cfg = config("diloco", periods="time", codec="fp32")
    fast, slow = members(hub, cfg)
    steps = [0, 0]

    def run(rank: int, s: Strategy) -> None:
        while s.step_count < cfg.period:
            local_step(s, rank)
            steps[rank] += 1

    leader = threading.Thread(target=run, args=(0, fast))
    leader.start()
    deadline = time.monotonic() + 30
    while hub.training_steps()[0] != cfg.period - 1 and time.monotonic() < deadline:
        time.sleep(0.001)
    run(1, slow)
    leader.join(30)
    assert steps == [cfg.period, 2]
    shares = [r for r in hub.rounds if r.group_id == GROUP_TOKENS]
    assert [(r.round_id, r.codec) for r in shares] == [(cfg.period, "fp32")]  # beside the pseudo-gradient
    assert [r.round_id for r in hub.rounds if r.group_id == GROUP_PARAMS] == [cfg.period]
    want = (_replay(0, [0, 1, 2, 3]) + 0.5 * _replay(1, [0, 3])) / 1.5
    for s in (fast, slow):
        torch.testing.assert_close(s.outer_state()[0], want, rtol=1e-5, atol=1e-6)
    assert fast.outer_digest() == slow.outer_digest()


@pytest.mark.parametrize("strategy", ["diloco", "streaming", "dreamddp"])
def test_a_slow_member_follows_the_clock_and_the_replicas_agree(strategy: str) -> None:
    hub = InProcessHub(2)
    cfg = config(strategy, period=4, periods="time", fragments=2, stream_delay=1)
    strategies = members(hub, cfg)
    steps = [0, 0]
    end = 6 * cfg.period

    def run(rank: int, s: Strategy) -> None:
        while s.step_count < end:
            local_step(s, rank)
            steps[rank] += 1
            if rank == 1:
                time.sleep(0.03)  # a member at a fraction of the other's pace
        s.close()

    each(strategies, run)
    assert steps[0] == end
    assert steps[1] < steps[0], steps  # it followed the leader's clock instead of holding it back
    assert all(s.step_count == end for s in strategies)
    assert strategies[0].outer_digest() == strategies[1].outer_digest()
    assert all(torch.isfinite(p).all() for s in strategies for p in s.model.parameters())
    each(strategies, lambda rank, s: s.flush())
    assert len({b"".join(p.detach().numpy().tobytes() for p in s.model.parameters()) for s in strategies}) == 1


def _is_pseudo_gradient_sync(group_id: int) -> bool:
    """A DreamDDP layer sync's own round (not its anchor's, nor a check's)."""
    return group_id >= GROUP_PLAN_BASE and (group_id - GROUP_PLAN_BASE) % SYNCS_PER_PLAN < ANCHOR_OFFSET


def test_dreamddp_sends_each_launch_steps_share_beside_its_layer_syncs() -> None:
    """Every pseudo-gradient sync is weighed: a shares' round under its round id, one per launch step however
    many syncs that step launches; the slow member's syncs launch at steps it only passed (its ticks)."""
    hub = InProcessHub(2)
    cfg = config("dreamddp", period=4, periods="time", delta_codec="fp32")
    strategies = members(hub, cfg)
    steps = [0, 0]

    def run(rank: int, s: Strategy) -> None:
        while s.step_count < 5 * cfg.period:
            local_step(s, rank)
            steps[rank] += 1
            if rank == 1:
                time.sleep(0.03)
        s.close()

    each(strategies, run)
    assert steps[1] < steps[0] == 5 * cfg.period, steps
    syncs = [r for r in hub.rounds if _is_pseudo_gradient_sync(r.group_id)]
    shares = [r for r in hub.rounds if r.group_id == GROUP_TOKENS]
    assert syncs and not any(r.failed for r in syncs + shares)
    assert sorted(r.round_id for r in shares) == sorted({r.round_id for r in syncs})
    assert strategies[0].outer_digest() == strategies[1].outer_digest()  # type: ignore[attr-defined]


@pytest.mark.parametrize("strategy", ["diloco", "dreamddp"])
def test_steps_periods_keep_lockstep_and_send_no_shares(strategy: str) -> None:
    hub = InProcessHub(2)
    strategies = members(hub, config(strategy))
    each(strategies, lambda rank, s: [local_step(s, rank) for _ in range(8)])
    assert not [r for r in hub.rounds if r.group_id == GROUP_TOKENS]


@pytest.mark.parametrize("strategy", ["diloco", "streaming", "dreamddp"])
def test_the_clocks_window_travels_with_the_state(strategy: str) -> None:
    """A joiner or a resumed member takes the donor's parameters, and with them the steps they hold: the
    window of trained steps travels in the state, so its next pseudo-gradient is weighed alike."""
    cfg = config(strategy, period=4, periods="time", fragments=2, stream_delay=1)
    (donor,) = members(InProcessHub(1), cfg)
    for _ in range(6):
        local_step(donor, 0)
    donor.close()
    state = donor.state_dict()
    assert state["clock"] == [True] * 4
    (taker,) = members(InProcessHub(1), cfg)
    taker.load_state_dict({**state, "clock": [True, False, False, True]})
    assert taker.step_count == 6
    local_step(taker, 0)  # step 6: the window's oldest mark gives way
    assert taker.state_dict()["clock"] == [False, False, True, True]
    lockstep = members(InProcessHub(1), config(strategy))[0]
    assert lockstep.state_dict()["clock"] is None
