"""DiLoCo's, Streaming DiLoCo's and CO2's outer-state check (`dreamp2p.sync.strategies.outercheck`): a member
whose global copy or outer momentum drifted from the others' (as after a partition) is found by the next check and every
member's copy is reset to the mean, bit-identical, within ``anchor_every`` + 1 periods."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from dreamp2p.sync.comm.inprocess import InProcessHub, RoundRecord
from dreamp2p.sync.model.groups import GROUP_OUTER_CHECK, GROUP_OUTER_HEAL, fragment_check_group, fragment_heal_group
from dreamp2p.sync.strategies.base import Strategy
from dreamp2p.sync.strategies.registry import strategy_class
from tests.unit.test_strategy_logic import config, digest, each, make_model, members, train

STRATEGIES = ["diloco", "streaming", "co2"]
PERIOD = 4
EVERY = 2
# the bound: the next check launches within EVERY periods, and its sync lands (and heals) within a period
BOUND = (EVERY + 1) * PERIOD


def cfg_for(strategy: str, **kw: Any) -> Any:
    # Nesterov outer momentum for DiLoCo and Streaming, so the momentum must heal too
    return config(
        strategy,
        period=PERIOD,
        anchor_every=EVERY,
        fragments=2,
        stream_delay=1,
        outer_lr=0.7,
        outer_momentum=0.9,
        **kw,
    )


def outer_digests(strategies: list[Strategy]) -> list[str]:
    return [s.outer_digest() for s in strategies]  # type: ignore[attr-defined]


def drift(s: Strategy, strategy: str) -> None:
    """Move ``s``'s global copy away from the other members' (what a side of a partition does to it)."""
    state = s.state_dict()
    extra = state["extra"]
    if strategy == "diloco":
        extra["global"].add_(1e-3)
    elif strategy == "streaming":
        extra["global"][0].add_(1e-3)
    else:
        extra["outer"].add_(1e-3)
        extra["momentum"].add_(1e-4)
    s.load_state_dict(state)


def heal_rounds(hub: InProcessHub) -> list[RoundRecord]:
    heal_groups = {GROUP_OUTER_HEAL, *(fragment_heal_group(p) for p in range(2))}
    return [r for r in hub.rounds if r.group_id in heal_groups]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_members_that_agree_send_only_the_checks(strategy: str) -> None:
    hub = InProcessHub(3)
    strategies = members(hub, cfg_for(strategy))
    train(strategies, 6 * PERIOD)
    assert heal_rounds(hub) == []
    assert all(s.outer_heals == 0 for s in strategies)  # type: ignore[attr-defined]
    checks = [
        r for r in hub.rounds if r.group_id in {GROUP_OUTER_CHECK, fragment_check_group(0), fragment_check_group(1)}
    ]
    # 17 fp32 elements (a flag and 16 digest bits) every EVERY-th period, per fragment under streaming
    assert checks and {(r.elements, r.codec) for r in checks} == {(17, "fp32")}
    per_period = 2 if strategy == "streaming" else 1
    assert len(checks) <= per_period * (6 // EVERY + 1)
    assert len(set(outer_digests(strategies))) == 1


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_member_whose_outer_state_drifted_is_healed_within_the_bound(strategy: str) -> None:
    hub = InProcessHub(3)
    strategies = members(hub, cfg_for(strategy))
    train(strategies, 2 * PERIOD + 1)
    drift(strategies[1], strategy)
    assert len(set(outer_digests(strategies))) == 2
    train(strategies, BOUND)
    assert len(set(outer_digests(strategies))) == 1, outer_digests(strategies)
    assert [s.outer_heals for s in strategies] == [1, 1, 1]  # type: ignore[attr-defined]
    assert {(r.codec, r.failed) for r in heal_rounds(hub)} == {("fp32", False)}
    # and they stay together: the next checks agree, nothing more is averaged
    train(strategies, 3 * PERIOD)
    assert len(set(outer_digests(strategies))) == 1
    assert [s.outer_heals for s in strategies] == [1, 1, 1]  # type: ignore[attr-defined]
    if strategy == "diloco":
        train(strategies, PERIOD - (strategies[0].step_count % PERIOD))  # to a boundary: params = global copy
        assert len({digest(s) for s in strategies}) == 1
    each(strategies, lambda rank, s: s.flush())
    assert len({digest(s) for s in strategies}) == 1


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_heal_round_that_fails_is_tried_again_at_the_next_landing(strategy: str) -> None:
    hub = InProcessHub(3)
    failed: list[tuple[int, int]] = []

    def first_heal_fails(group_id: int, round_id: int) -> bool:
        if group_id in {GROUP_OUTER_HEAL, fragment_heal_group(0), fragment_heal_group(1)} and not failed:
            failed.append((group_id, round_id))
            return True
        return False

    hub.fail(first_heal_fails)
    strategies = members(hub, cfg_for(strategy))
    train(strategies, 2 * PERIOD + 1)
    drift(strategies[2], strategy)
    train(strategies, BOUND + PERIOD)  # one landing more for the retry
    assert failed, "no heal round ran"
    assert len(set(outer_digests(strategies))) == 1, outer_digests(strategies)
    assert [s.outer_heals for s in strategies] == [1, 1, 1]  # type: ignore[attr-defined]
    assert [r.failed for r in heal_rounds(hub)] == [True, False]


@pytest.mark.parametrize("strategy", ["streaming", "co2"])
def test_a_check_in_flight_travels_with_the_state(strategy: str) -> None:
    """A member that took the state while a check that found the copies apart was in flight (a joiner, a
    resume) decides at the landing as the others do, and runs the heal round with them."""
    hub = InProcessHub(2)
    cfg = cfg_for(strategy)
    strategies = members(hub, cfg)
    train(strategies, 2 * PERIOD + 1)
    drift(strategies[1], strategy)
    # through the step (11) that launches the next check, whose landing is still ahead
    train(strategies, PERIOD - 1)
    assert [s.outer_heals for s in strategies] == [0, 0]  # type: ignore[attr-defined]
    saved = strategies[1].state_dict()
    assert "pending_check" in saved["extra"] or any(
        rec[2] is not None for rec in saved["extra"].get("inflight", {}).values()
    ), saved["extra"].keys()
    model = make_model()
    replica = strategy_class(strategy)(model, torch.optim.SGD(model.parameters(), lr=0.05), hub.member(1), cfg)
    replica.load_state_dict(saved)
    strategies[1] = replica
    train(strategies, BOUND)
    assert len(set(outer_digests(strategies))) == 1, outer_digests(strategies)
    assert [s.outer_heals for s in strategies] == [1, 1]  # type: ignore[attr-defined]


def test_the_digest_names_the_momentum_too() -> None:
    hub = InProcessHub(1)
    (s,) = members(hub, cfg_for("co2"))
    before = s.outer_digest()  # type: ignore[attr-defined]
    state = s.state_dict()
    state["extra"]["momentum"].add_(torch.finfo(torch.float32).tiny)
    s.load_state_dict(state)
    assert s.outer_digest() != before  # type: ignore[attr-defined]
