"""DreamDDP's checked pseudo-gradients: every ``anchor_every``-th period a layer sync sends its 4-bit
pseudo-gradient with a 17-element check of the members' outer weights, and the parameters themselves travel
(an anchor) only in the next sync of layers whose check found the members apart."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from dreamp2p.sync.comm.inprocess import InProcessHub, RoundRecord
from dreamp2p.sync.model.groups import GROUP_PLAN_BASE, MAX_PLAN_SYNCS, SYNCS_PER_PLAN
from dreamp2p.sync.strategies.dreamddp import DreamDDP, plan_summary
from dreamp2p.sync.strategies.layersync import InFlight
from tests.unit.test_strategy_logic import config, digest, each, make_model, members, train

KINDS = ("pseudo-gradient", "anchor", "check")


def kind(r: RoundRecord) -> str:
    return KINDS[(r.group_id - GROUP_PLAN_BASE) % SYNCS_PER_PLAN // MAX_PLAN_SYNCS]


def layer_rounds(hub: InProcessHub, since: int = 0) -> list[RoundRecord]:
    return [r for r in hub.rounds[since:] if r.group_id >= GROUP_PLAN_BASE]


def outer_weights(s: DreamDDP) -> list[torch.Tensor]:
    outer = s.state_dict()["extra"]["outer"]
    return [t for li in sorted(outer) for t in outer[li]]


def set_apart(s: DreamDDP, how: str) -> None:
    """Make ``s``'s outer weights differ from the other members', as ``how`` says."""
    state = s.state_dict()
    if how == "fresh":  # a node resumed from a checkpoint without them: they start again from its parameters
        state["extra"]["outer"], state["extra"]["fresh"] = {}, []
    else:  # "differ": they drifted, as after a round that only this member lost
        state["extra"]["outer"][0][0].add_(1e-4)
    s.load_state_dict(state)


@pytest.mark.parametrize("world", [2, 3])
def test_members_that_agree_never_send_parameters(world: int) -> None:
    hub = InProcessHub(world, goodput_Bps=50e6, rtt_s=0.001)
    cfg = config("dreamddp", period=4, max_delay=2, anchor_every=2)
    strategies = members(hub, cfg)
    train(strategies, 4)  # period 0: theta comes from the (equal) parameters at attach, and is checked
    first = len(hub.rounds)
    assert {kind(r) for r in layer_rounds(hub)} == {"pseudo-gradient", "check"}
    train(strategies, 28)  # periods 1-7: checks in the even ones
    later = layer_rounds(hub, first)
    assert {kind(r) for r in later} == {"pseudo-gradient", "check"}
    # the warm-up's in the chain's sparsest codec (the link is not measured yet), the measured plans' in
    # delta_codec on this fast link
    codecs = [r.codec for r in layer_rounds(hub) if kind(r) == "pseudo-gradient"]
    assert set(codecs) == {cfg.delta_chain[-1], cfg.delta_codec} and codecs[-1] == cfg.delta_codec
    assert 0 < sum(kind(r) == "check" for r in later) < sum(kind(r) == "pseudo-gradient" for r in later)
    assert all(isinstance(s, DreamDDP) and not s.repair_layers and s.anchors_healed == 0 for s in strategies)
    each(strategies, lambda rank, s: s.flush())
    assert len({digest(s) for s in strategies}) == 1


@pytest.mark.parametrize("world", [2, 3])
def test_members_that_start_from_different_parameters_are_found_in_the_first_period(world: int) -> None:
    """No broadcast at attach (``broadcast=False`` with unequal inits): the first period's checks see the
    outer weights differ, nothing is applied, and the next syncs are anchors that make the members equal."""
    hub = InProcessHub(world, goodput_Bps=50e6, rtt_s=0.001)
    cfg = config("dreamddp", period=4, max_delay=2, anchor_every=2)
    strategies = []
    for rank in range(world):
        model = make_model()
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.01 * rank)
        strategies.append(DreamDDP(model, torch.optim.SGD(model.parameters(), lr=0.05), hub.member(rank), cfg))
    train(strategies, 4)
    assert "anchor" not in {kind(r) for r in layer_rounds(hub)}
    since = len(hub.rounds)
    train(strategies, 8)  # the checks land within their delay; the layers' next syncs are anchors
    assert "anchor" in {kind(r) for r in layer_rounds(hub, since)}
    assert all(not s.repair_layers for s in strategies)
    healed = {s.anchors_healed for s in strategies}
    assert len(healed) == 1 and healed.pop() > 0  # every member counted the same drift
    thetas = [outer_weights(s) for s in strategies]
    for other in thetas[1:]:
        for got, want in zip(other, thetas[0], strict=True):
            assert torch.equal(got, want)
    each(strategies, lambda rank, s: s.flush())
    assert len({digest(s) for s in strategies}) == 1


@pytest.mark.parametrize("how", ["fresh", "differ"])
@pytest.mark.parametrize("world", [2, 3])
def test_a_check_that_finds_outer_weights_apart_makes_the_next_sync_an_anchor(world: int, how: str) -> None:
    hub = InProcessHub(world, goodput_Bps=50e6, rtt_s=0.001)
    cfg = config("dreamddp", period=4, max_delay=2, anchor_every=2)
    strategies = members(hub, cfg)
    assert all(isinstance(s, DreamDDP) for s in strategies)
    train(strategies, 12)  # periods 0-2; the measured plan is in force
    set_apart(strategies[-1], how)  # type: ignore[arg-type]
    since = len(hub.rounds)
    train(strategies, 4)  # period 3: unchecked pseudo-gradients, nothing is seen
    assert all(not s.repair_layers for s in strategies)  # type: ignore[attr-defined]
    assert "anchor" not in {kind(r) for r in layer_rounds(hub, since)}
    for _ in range(8):  # period 4's checks land, each within its delay
        train(strategies, 1)
        if strategies[0].repair_layers:  # type: ignore[attr-defined]
            break
    repair = [s.repair_layers for s in strategies]  # type: ignore[attr-defined]
    assert repair[0] and len(set(repair)) == 1  # the same layers on every member, from the same check
    assert len({tuple(t.sum().item() for t in outer_weights(s)) for s in strategies}) > 1  # type: ignore[arg-type]

    # a checkpoint taken now carries the repair, so a resumed node launches the same anchors
    state = strategies[0].state_dict()
    assert state["extra"]["repair"] == list(repair[0])
    resumed = members(InProcessHub(1), cfg)[0]
    resumed.load_state_dict(state)
    assert resumed.repair_layers == repair[0]  # type: ignore[attr-defined]

    since = len(hub.rounds)
    train(strategies, 8)  # the layers' next syncs are anchors (a period at most); they land and clear the repair
    assert "anchor" in {kind(r) for r in layer_rounds(hub, since)}
    assert all(not s.repair_layers for s in strategies)  # type: ignore[attr-defined]
    # a drift is counted as healed (a fresh node's reset is expected, not a fault)
    assert [s.anchors_healed for s in strategies] == [1 if how == "differ" else 0] * world  # type: ignore[attr-defined]
    thetas = [outer_weights(s) for s in strategies]  # type: ignore[arg-type]
    for other in thetas[1:]:
        for got, want in zip(other, thetas[0], strict=True):
            assert torch.equal(got, want)
    each(strategies, lambda rank, s: s.flush())
    assert len({digest(s) for s in strategies}) == 1


def _record(**extra: Any) -> dict[str, Any]:
    model = make_model()
    n = sum(p.numel() for p in model[0].parameters())
    return {"land": 7, "key": [1, 0], "layers": [0], "mean": torch.zeros(n), "snap": torch.zeros(n), **extra}


@pytest.mark.parametrize(
    ("extra", "anchor"),
    [
        ({}, False),  # an unchecked pseudo-gradient
        ({"check": torch.zeros(17), "anchor": False}, False),  # a checked pseudo-gradient
        ({"check": torch.zeros(17), "anchor": True}, True),
        ({"check": torch.zeros(17)}, True),  # before checked pseudo-gradients, every checked sync was an anchor
    ],
)
def test_a_restored_sync_keeps_what_it_averaged(extra: dict[str, Any], anchor: bool) -> None:
    s = members(InProcessHub(1), config("dreamddp"))[0]
    assert isinstance(s, DreamDDP)
    inf = InFlight.restore(_record(**extra), s.layers, pin=False)
    assert inf.anchor is anchor
    assert (inf.check is not None) is ("check" in extra)
    rec = inf.record(1.0)
    assert rec is not None and rec["anchor"] is anchor


@pytest.mark.parametrize(
    ("delta", "fallbacks", "line"),
    [
        ("int4", (), "codec: int4 pseudo-gradients, int8 anchors"),
        # the warm-up plan sends the chain's sparsest codec: the parameters keep what it leaves out
        ("int4", ("int2", "topk"), "codec: topk pseudo-gradients, int8 anchors"),
        ("", (), "codec: int8"),
    ],
)
def test_the_status_plan_summary_names_what_the_syncs_send(delta: str, fallbacks: tuple[str, ...], line: str) -> None:
    cfg = config("dreamddp", delta_codec=delta, delta_fallbacks=fallbacks, plan_codecs=("int8",))
    s = members(InProcessHub(1), cfg)[0]
    assert isinstance(s, DreamDDP)
    assert plan_summary(s).splitlines()[-1] == line
    assert s.sync_codec == line.split()[1]
