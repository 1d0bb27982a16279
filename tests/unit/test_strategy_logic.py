"""Each strategy's own logic against the in-process collective: what it averages when, what it merges, what
state it checkpoints. Milliseconds per case; the multi-process tests in test_strategies.py stay."""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import math
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from dreamp2p.config.sync import STRATEGIES, SyncConfig
from dreamp2p.errors import PeerError
from dreamp2p.state.donor import StateDonor
from dreamp2p.sync.comm.inprocess import InProcessHub
from dreamp2p.sync.model.groups import (
    ANCHOR_OFFSET,
    GROUP_FLUSH,
    GROUP_FLUSH_CHECK,
    GROUP_FRAGMENT_BASE,
    GROUP_GRADS,
    GROUP_PARAMS,
    GROUP_PLAN_BASE,
)
from dreamp2p.sync.strategies import base, layersync
from dreamp2p.sync.strategies import control as control_sync
from dreamp2p.sync.strategies import dreamddp as dreamddp_sync
from dreamp2p.sync.strategies.base import Strategy
from dreamp2p.sync.strategies.registry import STRATEGY_CLASSES, strategy_class

DETERMINISTIC = ["ssgd", "localsgd", "diloco", "streaming", "co2"]  # no measured timings in their decisions


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + step)
    x = torch.randn(8, 6, generator=g)
    return x, torch.sin(x[:, :3]) + 0.1 * rank


def local_step(strategy: Strategy, rank: int) -> None:
    x, y = batch(rank, strategy.step_count)
    nn.functional.mse_loss(strategy.model(x), y).backward()
    strategy.step()
    strategy.zero_grad()


def digest(strategy: Strategy) -> bytes:
    return b"".join(p.detach().numpy().tobytes() for p in strategy.model.parameters())


def members(hub: InProcessHub, cfg: SyncConfig, lr: float = 0.05) -> list[Strategy]:
    out = []
    for rank in range(len(hub.node_ids)):
        model = make_model()
        opt = torch.optim.SGD(model.parameters(), lr=lr)
        out.append(strategy_class(cfg.strategy)(model, opt, hub.member(rank), cfg))
    return out


def each(strategies: list[Strategy], fn: Callable[[int, Strategy], Any]) -> list[Any]:
    """Run ``fn`` for every member at once, one thread each, as every node's trainer runs."""
    with concurrent.futures.ThreadPoolExecutor(len(strategies)) as pool:
        return list(pool.map(fn, range(len(strategies)), strategies))


def train(strategies: list[Strategy], steps: int, after: Callable[[int, Strategy], None] | None = None) -> None:
    def run(rank: int, s: Strategy) -> None:
        for _ in range(steps):
            local_step(s, rank)
            if after is not None:
                after(rank, s)

    each(strategies, run)


def config(strategy: str, **kw: Any) -> SyncConfig:
    base = {"strategy": strategy, "period": 4, "warmup_steps": 2, "control_every": 4}
    return SyncConfig(**{**base, **kw})


def test_ssgd_equals_one_process_on_the_union_batch() -> None:
    hub = InProcessHub(3)
    strategies = members(hub, config("ssgd"))
    train(strategies, 6)
    assert len({digest(s) for s in strategies}) == 1
    ref = make_model()
    opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    for step in range(6):
        # equal per-member batches: the mean of their mean losses is the union batch's mean loss
        loss = sum(nn.functional.mse_loss(ref(x), y) for x, y in (batch(r, step) for r in range(3))) / 3
        loss.backward()
        opt.step()
        opt.zero_grad()
    for got, want in zip(strategies[0].model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    grads = [r for r in hub.rounds if r.group_id == GROUP_GRADS]
    assert [r.round_id for r in grads] == [1, 2, 3, 4, 5, 6]  # one gradient round per step, numbered step + 1


@pytest.mark.parametrize("strategy", ["localsgd", "diloco", "co2"])
def test_whole_model_strategies_average_once_per_period(strategy: str) -> None:
    hub = InProcessHub(2)
    strategies = members(hub, config(strategy, period=3))
    train(strategies, 9)
    rounds = [r.round_id for r in hub.rounds if r.group_id == GROUP_PARAMS]
    assert rounds == [3, 6, 9]  # the step that ends each period launches the round


def test_localsgd_replicas_agree_right_after_each_boundary_and_differ_between() -> None:
    hub = InProcessHub(3)
    strategies = members(hub, config("localsgd", period=3))
    train(strategies, 3)
    assert len({digest(s) for s in strategies}) == 1  # step 3 ended a period: all hold the average
    train(strategies, 1)
    assert len({digest(s) for s in strategies}) == 3  # one local step later they differ again


def test_diloco_with_plain_outer_step_is_local_sgd() -> None:
    """outer_lr 1, momentum 0: global - mean(global - local) = mean(local), the local-SGD average."""
    hubs = InProcessHub(2), InProcessHub(2)
    diloco = members(hubs[0], config("diloco", period=3, outer_lr=1.0, outer_momentum=0.0))
    local = members(hubs[1], config("localsgd", period=3))
    train(diloco, 6)
    train(local, 6)
    for a, b in zip(diloco[0].model.parameters(), local[0].model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_streaming_syncs_every_fragment_once_per_period_with_its_delay() -> None:
    hub = InProcessHub(2)
    cfg = config("streaming", period=4, fragments=2, stream_delay=1)
    strategies = members(hub, cfg)
    train(strategies, 12)
    # the fragments' own rounds (their checks and heals have ranges of their own, see groups.py)
    frags = sorted({r.group_id for r in hub.rounds if r.group_id - GROUP_FRAGMENT_BASE in range(cfg.fragments)})
    assert frags == [GROUP_FRAGMENT_BASE, GROUP_FRAGMENT_BASE + 1]
    for gid in frags:
        ids = [r.round_id for r in hub.rounds if r.group_id == gid]
        assert all(b - a == cfg.period for a, b in itertools.pairwise(ids)), ids
        assert {r.codec for r in hub.rounds if r.group_id == gid} == {cfg.stream_codec}
    starts = [min(r.round_id for r in hub.rounds if r.group_id == gid) for gid in frags]
    assert starts[0] != starts[1]  # fragments are staggered over the period


@pytest.mark.parametrize("strategy", [*DETERMINISTIC, "dreamddp"])
def test_a_failed_round_is_skipped_alike_and_flush_leaves_identical_replicas(strategy: str) -> None:
    hub = InProcessHub(3)
    hub.fail(lambda group_id, round_id: round_id in (3, 4))  # whatever group ran at those steps
    strategies = members(hub, config(strategy))
    train(strategies, 12)
    assert any(r.failed for r in hub.rounds)
    skipped = {s.rounds_skipped for s in strategies}
    assert len(skipped) == 1 and skipped.pop() >= 1  # every member skipped the same rounds
    each(strategies, lambda rank, s: s.flush())
    assert len({digest(s) for s in strategies}) == 1


@pytest.mark.parametrize(("strategy", "averages"), [("ssgd", []), ("streaming", [78, 79])])
def test_flush_rounds_are_numbered_from_the_step(strategy: str, averages: list[int]) -> None:
    # a member that joined at step j refuses rounds numbered below j + 1: flush ids counted from 1 were
    hub = InProcessHub(2)
    strategies = members(hub, config(strategy))
    train(strategies, 12)
    hub.fail(lambda group_id, round_id: group_id == GROUP_FLUSH and round_id == 78)  # the first attempt
    each(strategies, lambda rank, s: s.flush())
    each(strategies, lambda rank, s: s.flush())
    # (12 + 1) x 6 ids per flush; each flush checks its part first (2 members, no frozen state: one part)
    checks = sorted({r.round_id for r in hub.rounds if r.group_id == GROUP_FLUSH_CHECK})
    assert checks == [78, 84], checks
    # S-SGD replicas agree already: nothing more crosses; Streaming's differ: a failed average, then its
    # retry; the second flush finds them identical
    ids = sorted({r.round_id for r in hub.rounds if r.group_id == GROUP_FLUSH})
    assert ids == averages, ids
    assert len({digest(s) for s in strategies}) == 1


@pytest.mark.parametrize("strategy", DETERMINISTIC)
def test_checkpoint_and_resume_continue_bit_identically(strategy: str) -> None:
    """What a strategy checkpoints is all it needs: a whole-cluster resume continues the same trajectory."""
    cfg = config(strategy, period=3, fragments=2, stream_delay=1)

    def checkpoint(rank: int, s: Strategy) -> dict[str, Any]:
        s.close()  # as the daemon does: land rounds in flight, so the checkpoint is a consistent cut
        return s.state_dict()

    straight = members(InProcessHub(2), cfg)
    train(straight, 5)
    each(straight, checkpoint)
    train(straight, 5)

    first = members(InProcessHub(2), cfg)
    train(first, 5)
    saved = each(first, checkpoint)
    resumed = members(InProcessHub(2), cfg)
    each(resumed, lambda rank, s: s.load_state_dict(saved[rank]))
    assert [s.step_count for s in resumed] == [5, 5]
    train(resumed, 5)
    assert [digest(s) for s in resumed] == [digest(s) for s in straight]


def test_state_for_another_strategy_is_refused() -> None:
    hub = InProcessHub(1)
    (ssgd,) = members(hub, config("ssgd"))
    (local,) = members(InProcessHub(1), config("localsgd"))
    with pytest.raises(PeerError, match=r"sync\.strategy: ssgd in the checkpoint, localsgd in the config"):
        local.load_state_dict(ssgd.state_dict())


def test_dreamddp_members_adopt_the_same_plans_and_average_every_layer_each_period() -> None:
    hub = InProcessHub(3, goodput_Bps=50e6, rtt_s=0.001)
    cfg = config("dreamddp", period=4, max_delay=2, warmup_steps=2, control_every=4)
    strategies = members(hub, cfg)
    train(strategies, 24)
    versions = {s.plan_version for s in strategies}
    assert len(versions) == 1 and versions.pop() >= 1  # a measured plan, the same everywhere
    assert len({s.plan_report()["plan"].__repr__() for s in strategies if s.plan_report()}) == 1
    layer_rounds = [r for r in hub.rounds if r.group_id >= GROUP_PLAN_BASE]
    assert layer_rounds, "no layer syncs"
    each(strategies, lambda rank, s: s.flush())
    assert len({digest(s) for s in strategies}) == 1


@pytest.mark.parametrize("feedback", [False, True])
def test_dreamddp_asks_error_feedback_for_its_pseudo_gradients_only(feedback: bool) -> None:
    hub = InProcessHub(2, goodput_Bps=50e6, rtt_s=0.001)
    cfg = config("dreamddp", period=4, max_delay=2, anchor_every=2, error_feedback=feedback)
    strategies = members(hub, cfg)
    train(strategies, 32)
    layer_rounds = [r for r in hub.rounds if r.group_id >= GROUP_PLAN_BASE]
    deltas = [r for r in layer_rounds if r.codec == cfg.delta_codec]
    anchors = [r for r in layer_rounds if r.codec != cfg.delta_codec]
    assert deltas and anchors
    # parameters (anchors, checks) are never fed back; the pseudo-gradients are exactly when asked
    assert {r.error_feedback for r in deltas} == {feedback}
    assert not any(r.error_feedback for r in anchors)
    each(strategies, lambda rank, s: s.flush())
    assert len({digest(s) for s in strategies}) == 1


def test_a_member_whose_guard_starts_on_a_pseudo_gradient_still_contributes_to_anchors() -> None:
    """A joiner's contribution guard has no history. Anchors (parameter averages) and the pseudo-gradient
    rounds between them keep separate norm histories, so a guard whose first round of a sync was a
    pseudo-gradient does not take the next anchor's parameters for a norm jump and withhold them."""
    # this small model's parameter norms are ~30x its pseudo-gradients' norms: a shared history refuses them
    hub = InProcessHub(2, goodput_Bps=50e6, rtt_s=0.001, max_norm_ratio=5.0)
    cfg = config("dreamddp", period=4, max_delay=2, anchor_every=2)
    strategies = members(hub, cfg)
    train(strategies, 12)  # plan v1 from step 8: checked pseudo-gradients in period 2
    hub.restart_guard(1)
    # its outer weights drift (as after a lost round): period 4's check sees it, period 5's syncs are anchors
    state = strategies[1].state_dict()
    state["extra"]["outer"][0][0].add_(1e-4)
    strategies[1].load_state_dict(state)
    restarted = len(hub.rounds)
    train(strategies, 16)  # periods 3-6: pseudo-gradients first, then anchors in period 5
    layer_rounds = [r for r in hub.rounds[restarted:] if r.group_id >= GROUP_PLAN_BASE]
    anchors = [r for r in layer_rounds if r.codec not in (cfg.delta_codec, "fp32")]
    deltas = [r for r in layer_rounds if r.codec == cfg.delta_codec]
    assert anchors and deltas
    for a in anchors:  # the restarted guard met this sync's pseudo-gradients before its anchor
        assert any(d.group_id == a.group_id - ANCHOR_OFFSET and d.round_id < a.round_id for d in deltas)
    assert [r.contributors for r in anchors] == [2] * len(anchors)
    assert [r.contributors for r in deltas] == [2] * len(deltas)
    each(strategies, lambda rank, s: s.flush())
    assert len({digest(s) for s in strategies}) == 1


def test_dreamddp_reports_a_syncs_pace_to_the_control_round_before_the_sync_lands(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The warm-up's first sync (step 0) lands at step 7 here; the control round of step 2 already carries its
    pace, so the first measured plan is made from it rather than re-made once it lands."""
    monkeypatch.setattr(dreamddp_sync, "RATE_SAMPLE_MIN_BYTES", 0)  # this model's rounds are a few hundred bytes
    hub = InProcessHub(2, goodput_Bps=50e6, rtt_s=0.001)
    cfg = config("dreamddp", period=8, max_delay=7, warmup_steps=2, control_every=4)
    strategies = members(hub, cfg)
    train(strategies, 2)
    for s in strategies:
        inflight = s._inflight  # type: ignore[attr-defined]
        assert inflight and inflight[0].land_step == 7
        inflight[0].fut.result()  # its round is done; it still waits for its landing step
    train(strategies, 1)  # step 2: the control round
    for s in strategies:
        assert math.isfinite(s._pace.rate)  # type: ignore[attr-defined]
        assert s._inflight[0].land_step == 7  # type: ignore[attr-defined]


def test_dreamddp_pace_is_the_links_rate_without_the_rings_latency(monkeypatch: pytest.MonkeyPatch) -> None:
    """The hub's rounds take (N-1) RTT plus their bytes at its goodput; the pace a member reports is that
    goodput, since the planner charges the latency chain on its own (`delivery_rate`)."""
    monkeypatch.setattr(dreamddp_sync, "RATE_SAMPLE_MIN_BYTES", 0)
    goodput, rtt = 2000.0, 0.05  # slow enough that a sync's bytes take longer than its chain
    hub = InProcessHub(2, goodput_Bps=goodput, rtt_s=rtt)
    cfg = config("dreamddp", period=8, max_delay=7, warmup_steps=2, control_every=4, delta_fallbacks=())
    strategies = members(hub, cfg)
    train(strategies, 2)
    done = [s._inflight[0].fut.result() for s in strategies]  # type: ignore[attr-defined]
    train(strategies, 1)  # step 2: the control round reads the RTT, then samples the finished sync
    for s, res in zip(strategies, done, strict=True):
        assert res.seconds > 2 * rtt  # the correction is not clipped at half the round
        assert s._pace.rate == pytest.approx(goodput, rel=1e-6)  # type: ignore[attr-defined]
        assert s._pace.rate > res.bytes_sent / res.seconds * 1.01  # type: ignore[attr-defined]


def test_dreamddp_pace_keeps_queueing_an_rtt_reading_grew_by(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only the least RTT a control round read comes off a sync's time: a larger reading (queueing behind the
    syncs themselves, gone by the next round) taken off a round that did not wait it would make the pace read
    faster than the link."""
    monkeypatch.setattr(dreamddp_sync, "RATE_SAMPLE_MIN_BYTES", 0)
    goodput, rtt = 2000.0, 0.05
    hub = InProcessHub(2, goodput_Bps=goodput, rtt_s=rtt)
    cfg = config(
        "dreamddp", period=8, max_delay=7, warmup_steps=2, control_every=4, control_backoff=1, delta_fallbacks=()
    )
    strategies = members(hub, cfg)
    train(strategies, 3)  # step 2: the first control round reads 0.05 s
    hub.rtt_s = 0.2  # a queue on the link: the control round of step 6 reads 0.2 s
    train(strategies, 4)
    hub.rtt_s = rtt  # drained: later rounds wait the 0.05 s chain again
    train(strategies, 10)  # steps 7-16: their syncs are sampled
    for s in strategies:
        assert s._pace.latency[1] == pytest.approx(rtt)  # type: ignore[attr-defined]
        assert s._pace.rate == pytest.approx(goodput, rel=1e-6)  # type: ignore[attr-defined]


def test_training_info_reaches_the_collective_every_step() -> None:
    hub = InProcessHub(2)
    strategies = members(hub, config("localsgd"))
    train(strategies, 3)
    assert hub.training_steps() == [3, 3]


def test_every_configurable_strategy_name_has_one_class() -> None:
    assert tuple(STRATEGY_CLASSES) == STRATEGIES
    with pytest.raises(ValueError, match="strategy must be one of"):
        strategy_class("dilocox")


def test_dreamddp_plans_made_beside_training_are_adopted_at_the_same_steps_everywhere() -> None:
    """The planner runs off the training thread; each plan still takes effect at the step fixed when the
    members decided (a period boundary), on every member, and checkpoints carry a plan still being made."""
    hub = InProcessHub(3, goodput_Bps=50e6, rtt_s=0.001)
    cfg = config("dreamddp", period=4, max_delay=2, warmup_steps=2, control_every=4)
    strategies = members(hub, cfg)
    train(strategies, 24)
    histories = {tuple(s.plan_history) for s in strategies}  # type: ignore[attr-defined]
    assert len(histories) == 1
    history = histories.pop()
    assert len(history) >= 2 and all(step % cfg.period == 0 for _, step in history[1:])
    states = each(strategies, lambda rank, s: s.state_dict())
    assert len({repr(st["extra"]["next_plan"]) for st in states}) == 1


@pytest.mark.timeout(120)  # the hang guard: nothing below is bounded by the clock
def test_a_state_request_while_a_round_is_held_waits_for_a_later_step(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A joiner asks for the state while a round the state must record has no outcome yet (here: held because
    the other member has not stepped): the step completes, no snapshot of unknown consistency is offered, and
    once the round completes a later step offers it (it used to raise TimeoutError out of ``step``)."""
    # no clock: until b steps, a record gives up on a round still in flight at once (as it would after the
    # round limit); once b has stepped, every round completes and a record waits for it
    b_stepped = threading.Event()

    def settled(fut: concurrent.futures.Future[Any], timeout: float) -> bool:
        if b_stepped.is_set():
            concurrent.futures.wait([fut])
        return base.settled(fut, 0.0)

    monkeypatch.setattr(layersync, "settled", settled)
    monkeypatch.setattr(control_sync, "settled", settled)
    hub = InProcessHub(2)
    a, b = members(hub, config("dreamddp"))
    train([a, b], 6)  # past warm-up: a control round is launched at the next step
    donor = StateDonor()
    a.donor = donor
    loop = asyncio.new_event_loop()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        request = pool.submit(loop.run_until_complete, donor.manifest(math.inf))
        while not donor.wanted:
            time.sleep(0.01)
        with caplog.at_level(logging.WARNING, logger="dreamp2p.sync.strategies.base"):
            local_step(a, 0)  # alone: its new rounds wait for b
        assert a.step_count == 7 and donor.wanted and donor.publications == 0
        assert "cannot offer the training state of step 7 yet" in caplog.text
        b_stepped.set()
        local_step(b, 1)  # b joins the held rounds
        train([a, b], 1)
        snapshot = request.result()
    loop.close()
    assert snapshot.step == 8 and not donor.wanted


def test_a_joiner_past_a_restored_control_rounds_landing_starts_on_the_plan_it_decided() -> None:
    """A state captured while a control round is in flight carries it; a node that loads that state and
    jumps past the round's landing step must decide it as the members did there, so that its first step runs
    the plan the members run (it used to run the older plan for one step: rounds no member runs)."""
    cfg = config("dreamddp", period=5, warmup_steps=10, control_every=5, control_lead=2)
    (member,) = members(InProcessHub(1), cfg)
    for _ in range(12):  # the control round launched at step 10 lands at step 12 and its plan at 15
        local_step(member, 0)
    state = member.state_dict()
    (joiner,) = members(InProcessHub(1), cfg)
    joiner.load_state_dict(state)
    joiner.jump_to(16)
    while member.step_count < 16:
        local_step(member, 0)
    assert member.plan_history == [(0, 0), (1, 15)]
    assert joiner.plan_history == member.plan_history
    assert joiner.plan == member.plan and joiner.plan_version == 1


def test_dreamddp_members_name_one_control_schedule_and_a_parted_one_differs() -> None:
    """Heartbeats name DreamDDP's control schedule beside its plan (issue 40, item 2): members in step publish
    the same name; a member whose re-planning memory parted (as on one side of a partition) another."""
    hub = InProcessHub(3, goodput_Bps=50e6, rtt_s=0.001)
    cfg = config("dreamddp", period=4, max_delay=2, warmup_steps=2, control_every=4)
    strategies = members(hub, cfg)
    train(strategies, 40)
    infos = [s.comm for s in strategies]
    names = {(c.training.schedule_step, c.training.schedule_digest) for c in infos}  # type: ignore[attr-defined]
    assert len(names) == 1 and next(iter(names))[0] > 0, names
    state = strategies[2].state_dict()
    state["extra"]["quiet"] += 1  # what one side's own control rounds would have left behind
    strategies[2].load_state_dict(state)
    strategies[2].publish_progress()
    theirs = strategies[2].comm.training  # type: ignore[attr-defined]
    assert theirs.schedule_digest not in {d for _, d in names}
