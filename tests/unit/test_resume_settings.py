"""Settings changed between a checkpoint and its resume, against the in-process collective: the rule of
`dreamp2p.settings` (a changed strategy is refused with CONFIG_MISMATCH naming it and both values; any other
changed setting is adopted, logged, and followed from the resumed step), on every member alike.
Milliseconds per case; the same on loopback with `Checkpointer` is tests/net/test_cluster_resume_settings.py."""

from __future__ import annotations

import concurrent.futures
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from dreamp2p.config.sync import SyncConfig
from dreamp2p.errors import PeerError, Status
from dreamp2p.service.checkpoint import save_checkpoint
from dreamp2p.service.lifecycle import check_resume
from dreamp2p.settings import resume_changes, resume_refusal
from dreamp2p.sync.comm.inprocess import InProcessHub
from dreamp2p.sync.model.groups import GROUP_PARAMS, GROUP_PLAN_BASE
from dreamp2p.sync.strategies.base import Strategy, saved_settings
from dreamp2p.sync.strategies.registry import strategy_class

ADOPTED = "resume: {} {} -> {} (config changed since the checkpoint)"


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))


def members(hub: InProcessHub, cfg: SyncConfig) -> list[Strategy]:
    out = []
    for rank in range(len(hub.node_ids)):
        model = make_model()
        out.append(
            strategy_class(cfg.strategy)(model, torch.optim.SGD(model.parameters(), lr=0.05), hub.member(rank), cfg)
        )
    return out


def each(strategies: list[Strategy], fn: Callable[[int, Strategy], Any]) -> list[Any]:
    """``fn`` for every member at once, one thread each, as every node's trainer runs."""
    with concurrent.futures.ThreadPoolExecutor(len(strategies)) as pool:
        return list(pool.map(fn, range(len(strategies)), strategies))


def train(strategies: list[Strategy], steps: int) -> None:
    def run(rank: int, s: Strategy) -> None:
        for _ in range(steps):
            g = torch.Generator().manual_seed(1000 * rank + s.step_count)
            x = torch.randn(8, 6, generator=g)
            nn.functional.mse_loss(s.model(x), torch.sin(x[:, :3])).backward()
            s.step()
            s.zero_grad()

    each(strategies, run)


def checkpoint(strategies: list[Strategy]) -> list[dict[str, Any]]:
    def save(rank: int, s: Strategy) -> dict[str, Any]:
        s.close()  # as the daemon does: land rounds in flight, so the checkpoint is a consistent cut
        return s.state_dict()

    return each(strategies, save)


def digest(s: Strategy) -> bytes:
    return b"".join(p.detach().numpy().tobytes() for p in s.model.parameters())


CHECK_ELEMENTS = 17  # a check round: a flag and 16 digest bits (see dreamp2p.sync.strategies.dreamddp)
DREAMDDP = {"strategy": "dreamddp", "period": 4, "max_delay": 2, "warmup_steps": 2, "control_every": 4}


@pytest.mark.parametrize("recorded", [True, False], ids=["settings-recorded", "older-checkpoint"])
def test_dreamddp_resumed_under_another_period_plans_for_it_on_every_member(
    recorded: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """The user's report: period 5 -> 10 on every node, and the resumed cluster kept period 5 silently."""
    first = members(InProcessHub(2, goodput_Bps=50e6, rtt_s=0.001), SyncConfig(**DREAMDDP))
    train(first, 16)
    assert {(s.plan.version >= 1, s.plan.period) for s in first} == {(True, 4)}  # a measured plan of period 4
    saved = checkpoint(first)
    if not recorded:  # a checkpoint written before the settings were saved still holds its plan's period
        for state in saved:
            del state["settings"]

    hub = InProcessHub(2, goodput_Bps=50e6, rtt_s=0.001)
    resumed = members(hub, SyncConfig(**{**DREAMDDP, "period": 8}))
    with caplog.at_level(logging.INFO, logger="dreamp2p.sync.strategies.base"):
        each(resumed, lambda rank, s: s.load_state_dict(saved[rank]))
    assert [s.adopted for s in resumed] == [[("sync.period", "4", "8")]] * 2
    assert [r.getMessage() for r in caplog.records].count(ADOPTED.format("sync.period", 4, 8)) == 2
    assert [(s.step_count, s.plan.period, s.plan.effective_step) for s in resumed] == [(16, 8, 16)] * 2
    assert [s.plan_report()["plan"]["period"] for s in resumed] == [8, 8]  # what plan.json shows

    train(resumed, 24)  # the first control rounds after the resume make a measured plan for period 8
    plans = {(s.plan.version, s.plan.period, s.plan.digest()) for s in resumed}
    assert len(plans) == 1 and plans.pop()[:2] >= (1, 8)
    assert {s.plan.period for s in resumed} == {8}
    assert [r for r in hub.rounds if r.group_id >= GROUP_PLAN_BASE and not r.failed], "no layer syncs"
    each(resumed, lambda rank, s: s.flush())
    assert len({digest(s) for s in resumed}) == 1


def test_dreamddp_resumed_under_another_codec_sends_its_syncs_in_it() -> None:
    # without pseudo-gradients and plan codecs, every layer sync is an anchor in the base codec
    cfg = {**DREAMDDP, "delta_codec": "", "plan_codecs": (), "codec": "int8"}
    first = members(InProcessHub(2, goodput_Bps=50e6, rtt_s=0.001), SyncConfig(**cfg))
    train(first, 16)
    saved = checkpoint(first)

    hub = InProcessHub(2, goodput_Bps=50e6, rtt_s=0.001)
    resumed = members(hub, SyncConfig(**{**cfg, "codec": "fp16"}))
    each(resumed, lambda rank, s: s.load_state_dict(saved[rank]))
    assert [s.adopted for s in resumed] == [[("sync.codec", "int8", "fp16")]] * 2
    train(resumed, 16)
    # the layer syncs, not their 17-element fp32 check rounds: the restored plans' codec (int8) no longer holds
    codecs = {r.codec for r in hub.rounds if r.group_id >= GROUP_PLAN_BASE and r.elements > CHECK_ELEMENTS}
    assert codecs == {"fp16"}
    each(resumed, lambda rank, s: s.flush())
    assert len({digest(s) for s in resumed}) == 1


@pytest.mark.parametrize("strategy", ["localsgd", "diloco", "co2"])
def test_whole_model_strategies_resumed_under_another_period_and_codec_follow_them(
    strategy: str, caplog: pytest.LogCaptureFixture
) -> None:
    cfg = {"strategy": strategy, "period": 3, "codec": "fp32"}
    first = members(InProcessHub(2), SyncConfig(**cfg))
    train(first, 6)
    saved = checkpoint(first)

    hub = InProcessHub(2)
    resumed = members(hub, SyncConfig(**{**cfg, "period": 4, "codec": "fp16"}))
    with caplog.at_level(logging.INFO, logger="dreamp2p.sync.strategies.base"):
        each(resumed, lambda rank, s: s.load_state_dict(saved[rank]))
    changes = [("sync.codec", "fp32", "fp16"), ("sync.period", "3", "4")]
    assert [s.adopted for s in resumed] == [changes] * 2
    logged = [r.getMessage() for r in caplog.records]
    assert (
        logged.count(ADOPTED.format("sync.period", 3, 4))
        == logged.count(ADOPTED.format("sync.codec", "fp32", "fp16"))
        == 2
    )
    train(resumed, 8)  # steps 6..13: the new period's boundaries are steps 8 and 12
    rounds = {(r.round_id, r.codec) for r in hub.rounds if r.group_id == GROUP_PARAMS}
    assert rounds == {(8, "fp16"), (12, "fp16")}


def test_diloco_resumed_under_another_outer_lr_steps_with_it() -> None:
    cfg = {"strategy": "diloco", "period": 2, "outer_lr": 0.7, "outer_momentum": 0.9}
    (first,) = members(InProcessHub(1), SyncConfig(**cfg))
    train([first], 4)
    (saved,) = checkpoint([first])
    (resumed,) = members(InProcessHub(1), SyncConfig(**{**cfg, "outer_lr": 0.5, "outer_momentum": 0.0}))
    resumed.load_state_dict(saved)
    # an optimizer's load_state_dict puts back the saved hyperparameters: the config's must win
    group = resumed._outer.param_groups[0]  # type: ignore[attr-defined]
    assert (group["lr"], group["momentum"], group["nesterov"]) == (0.5, 0.0, False)
    assert ("sync.outer_lr", "0.7", "0.5") in resumed.adopted


@pytest.mark.parametrize(
    ("saved", "now", "setting"),
    [
        ({"strategy": "dreamddp"}, {"strategy": "localsgd"}, "sync.strategy"),
        ({"strategy": "localsgd"}, {"strategy": "diloco"}, "sync.strategy"),
        ({"strategy": "streaming", "fragments": 2}, {"strategy": "streaming", "fragments": 3}, "sync.fragments"),
    ],
)
def test_a_changed_strategy_is_refused_naming_it_and_both_values_before_anything_loads(
    saved: dict[str, Any], now: dict[str, Any], setting: str
) -> None:
    first = members(InProcessHub(2), SyncConfig(period=2, **saved))
    train(first, 4)
    states = checkpoint(first)
    resumed = members(InProcessHub(2), SyncConfig(period=2, **now))
    before = [digest(s) for s in resumed]

    def load(rank: int, s: Strategy) -> PeerError:
        with pytest.raises(PeerError) as info:
            s.load_state_dict(states[rank])
        return info.value

    errors = each(resumed, load)
    old, new = (str(d.get(setting.removeprefix("sync."))) for d in (saved, now))
    for err in errors:  # the same answer on every member
        assert err.status == Status.CONFIG_MISMATCH
        assert f"{setting}: {old} in the checkpoint, {new} in the config" in err.detail
        assert "without --resume" in err.detail and f"{setting} = {old}" in err.detail
    assert [s.step_count for s in resumed] == [0, 0] and [digest(s) for s in resumed] == before


def test_the_rule_compares_only_what_both_sides_name_and_refuses_only_fixed_settings() -> None:
    saved = {"sync.strategy": "dreamddp", "sync.period": "5", "sync.old_knob": "1"}
    now = {"sync.strategy": "dreamddp", "sync.period": "10", "sync.new_knob": "2"}
    assert resume_changes(saved, now) == [("sync.period", "5", "10")]
    assert resume_refusal(resume_changes(saved, now)) is None
    refusal = resume_refusal([("sync.strategy", "dreamddp", "localsgd")], where="ckpt-0000000010.pt")
    assert refusal is not None and "sync.strategy: dreamddp in ckpt-0000000010.pt, localsgd in the config" in refusal


def test_saved_settings_of_an_older_state_name_its_strategy_and_plan_period() -> None:
    state = {"strategy": "dreamddp", "extra": {"plan": {"period": 5}}}
    assert saved_settings(state) == {"sync.strategy": "dreamddp", "sync.period": "5"}
    assert saved_settings({"strategy": "localsgd", "extra": {}}) == {"sync.strategy": "localsgd"}


def test_check_resume_refuses_a_changed_strategy_from_the_newest_checkpoint_alone(tmp_path: Path) -> None:
    """What the daemon and Checkpointer run before they connect: the node's own checkpoint and config only."""
    (first,) = members(InProcessHub(1), SyncConfig(strategy="dreamddp", period=5))
    train([first], 2)
    save_checkpoint(tmp_path, 2, {"sync": first.state_dict()})
    check_resume(tmp_path, SyncConfig(strategy="dreamddp", period=10, codec="fp16"))  # adopted at load: no refusal
    check_resume(tmp_path / "none", SyncConfig(strategy="localsgd"))  # no checkpoint: a fresh start
    with pytest.raises(PeerError) as info:
        check_resume(tmp_path, SyncConfig(strategy="localsgd", period=5))
    assert info.value.status == Status.CONFIG_MISMATCH
    assert f"sync.strategy: dreamddp in {tmp_path / 'ckpt-0000000002.pt'}, localsgd in the config" in info.value.detail
