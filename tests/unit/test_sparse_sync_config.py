"""`[sync]` with the sparse codec: only as DreamDDP's pseudo-gradient codec, with error feedback or with the unsent
parts kept in the parameters, where it trains."""

from __future__ import annotations

import concurrent.futures
from typing import Any

import pytest
import torch
from torch import nn

from dreamp2p.cli import main
from dreamp2p.config.sync import SyncConfig
from dreamp2p.settings import settings_mismatch
from dreamp2p.sync.comm.inprocess import InProcessHub
from dreamp2p.sync.model.groups import GROUP_PLAN_BASE
from dreamp2p.sync.strategies.registry import strategy_class


def test_delta_codec_topk_with_error_feedback_is_accepted_and_shared() -> None:
    cfg = SyncConfig.from_dict({"strategy": "dreamddp", "delta_codec": "topk", "error_feedback": True})
    shared = cfg.shared_settings()
    assert (shared["sync.delta_codec"], shared["sync.error_feedback"]) == ("topk", "True")
    # members must agree on it: a member with the default 4-bit pseudo-gradients is refused, naming it
    other = SyncConfig.from_dict({"strategy": "dreamddp", "error_feedback": True}).shared_settings()
    assert settings_mismatch(shared, shared) is None
    assert "sync.delta_codec: topk on this node, int4 on the peer" in (settings_mismatch(shared, other) or "")


@pytest.mark.parametrize(
    ("settings", "match"),
    [
        ({"delta_codec": "topk", "keep_unsent": False}, "sync.delta_codec topk is sparse .*error_feedback = true"),
        ({"codec": "topk", "error_feedback": True}, "sync.codec: topk is a sparse codec"),
        ({"stream_codec": "topk"}, "sync.stream_codec: topk is a sparse codec"),
        ({"plan_codecs": ["int8", "topk"]}, "sync.plan_codecs: topk is a sparse codec"),
        ({"link_codecs": ["fp32", "int8", "topk"]}, "sync.link_codecs: topk is a sparse codec"),
    ],
)
def test_sparse_codec_refused_where_parameters_or_unfed_increments_travel(settings: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SyncConfig.from_dict({"strategy": "dreamddp", **settings})


@pytest.mark.parametrize(
    ("settings", "match"),
    [
        ({"delta_codec": "int2", "keep_unsent": False}, "sync.delta_codec int2 loses about half .*error_feedback"),
        ({"delta_fallbacks": ["int3"]}, "sync.delta_fallbacks: unknown codec 'int3'"),
        ({"delta_fallbacks": "int2"}, "sync.delta_fallbacks must be a list of codec names"),
        ({"delta_fallbacks": ["topk", "int2"]}, "sync.delta_fallbacks: int2 sends no fewer bytes than topk"),
    ],
)
def test_2_bit_pseudo_gradients_need_error_feedback_and_fallbacks_are_checked(
    settings: dict[str, Any], match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        SyncConfig.from_dict({"strategy": "dreamddp", **settings})


@pytest.mark.parametrize(
    ("settings", "chain"),
    [
        ({}, ("int4", "int2", "topk")),
        ({"delta_fallbacks": []}, ("int4",)),
        ({"delta_codec": "int2", "error_feedback": True}, ("int2", "topk")),  # int2 is no fallback of itself
        ({"delta_codec": "int8", "delta_fallbacks": ["INT2", "topk"]}, ("int8", "int2", "topk")),
        ({"delta_codec": ""}, ()),  # parameter averaging: no pseudo-gradients to compress
    ],
)
def test_the_codecs_pseudo_gradients_may_use(settings: dict[str, Any], chain: tuple[str, ...]) -> None:
    assert SyncConfig.from_dict({"strategy": "dreamddp", **settings}).delta_chain == chain


def _train_pair(hub: InProcessHub, cfg: SyncConfig, steps: int) -> tuple[list[Any], list[list[float]]]:
    """Two members of ``hub`` training the same small model on different data for ``steps``, then flush():
    the strategies and each member's training losses."""
    strategies = []
    for rank in range(2):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 64), nn.Tanh(), nn.Linear(64, 3))
        strategies.append(
            strategy_class("dreamddp")(model, torch.optim.SGD(model.parameters(), lr=0.05), hub.member(rank), cfg)
        )
    losses: list[list[float]] = [[], []]

    def run(rank: int) -> None:
        s = strategies[rank]
        for step in range(steps):
            g = torch.Generator().manual_seed(1000 * rank + step)
            x = torch.randn(16, 6, generator=g)
            loss = nn.functional.mse_loss(s.model(x), torch.sin(x[:, :3]))
            loss.backward()
            s.step()
            s.zero_grad()
            losses[rank].append(float(loss.detach()))
        s.flush()

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        list(pool.map(run, range(2)))
    return strategies, losses


@pytest.mark.parametrize(
    ("goodput_Bps", "settings", "warmup", "measured"),
    [
        # the defaults: the unsent parts stay in the parameters, no residual, and the warm-up sends the sparse
        # codec already
        (2e3, {}, ("topk", False), ("topk", False)),
        (1e9, {}, ("topk", False), ("int4", False)),
        # without keep_unsent: 2 bits with error feedback, and the warm-up in int4
        (2e3, {"delta_fallbacks": ["int2"], "keep_unsent": False}, ("int4", False), ("int2", True)),
        (1e9, {"delta_fallbacks": ["int2"], "keep_unsent": False}, ("int4", False), ("int4", False)),
    ],
)
def test_pseudo_gradients_travel_in_a_fallback_where_the_link_cannot_carry_int4(
    goodput_Bps: float, settings: dict[str, Any], warmup: tuple[str, bool], measured: tuple[str, bool]
) -> None:
    """A measured plan on a link far too slow for a period of int4 pseudo-gradients sends them in the fallback,
    with keep_unsent (the default) keeping what it leaves out in the parameters, or else with error feedback
    though the run did not ask for it. A fast link's plan keeps int4, as does the warm-up plan before the
    link is measured without keep_unsent. The replicas end identical after flush() either way."""
    cfg = SyncConfig(strategy="dreamddp", period=4, warmup_steps=2, control_every=4, max_delay=2, **settings)
    hub = InProcessHub(2, goodput_Bps=goodput_Bps, rtt_s=0.001)
    strategies, _ = _train_pair(hub, cfg, 40)
    assert [s.sync_codec for s in strategies] == [measured[0]] * 2
    # the layer syncs (not their 17-element fp32 checks), in order
    syncs = [(r.codec, r.error_feedback) for r in hub.rounds if r.group_id >= GROUP_PLAN_BASE and r.elements > 17]
    assert syncs[0] == warmup and syncs[-1] == measured
    assert set(syncs) == {warmup, measured}
    a, b = (b"".join(p.detach().numpy().tobytes() for p in s.model.parameters()) for s in strategies)
    assert a == b


def test_dreamddp_trains_with_sparse_pseudo_gradients_and_replicas_stay_identical() -> None:
    """In memory (InProcessHub encodes each mean with the round's codec and keeps its residual): the layer
    syncs between anchors go as topk with error feedback, training goes on, and members end identical."""
    hub = InProcessHub(2, goodput_Bps=50e6, rtt_s=0.001)
    cfg = SyncConfig(
        strategy="dreamddp",
        period=4,
        warmup_steps=2,
        control_every=4,
        max_delay=2,
        anchor_every=2,
        delta_codec="topk",
        error_feedback=True,
    )
    strategies, losses = _train_pair(hub, cfg, 48)
    deltas = [r for r in hub.rounds if r.group_id >= GROUP_PLAN_BASE and r.codec == "topk"]
    assert deltas and all(r.error_feedback for r in deltas)
    for curve in losses:
        assert sum(curve[-8:]) < 0.7 * sum(curve[:8])
    a, b = (b"".join(p.detach().numpy().tobytes() for p in s.model.parameters()) for s in strategies)
    assert a == b


def test_the_demo_refuses_the_sparse_codec_before_starting_anything(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["demo", "--codec", "topk"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    # argparse's choices (quoted or not, by Python version): the dense codecs, never the sparse one
    assert "argument --codec: invalid choice: 'topk' (choose from " in err
    offered = err.split("choose from")[1]
    assert "fp32" in offered and "int8" in offered and "topk" not in offered
