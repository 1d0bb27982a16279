"""What a DreamDDP re-plan prices its syncs at (pure: `Replanner.make` on a fixed request).

With pseudo-gradients on, nearly every layer sync sends ``delta_codec``'s bytes, so the plan is made for
that size and the plan codecs name only the anchors' codec; without them, every sync averages parameters in
the least lossy plan codec that hides."""

from __future__ import annotations

import dataclasses

import pytest

from dreamp2p.config.sync import SyncConfig
from dreamp2p.schedule.cost import LayerCost, LinkModel
from dreamp2p.schedule.dreamddp import plan_dreamddp
from dreamp2p.schedule.linkcodec import wire_ratio
from dreamp2p.sync.strategies.control import PlanRequest, Replanner

# the judged workload's shape: 3.3M parameters in 6 scheduled layers, 0.27 s per step
COSTS = tuple(LayerCost(f"l{i}", 0.015, 0.03, 2_215_000) for i in range(6))
H = 20


def _request(cfg: SyncConfig, bandwidth_Bps: float) -> PlanRequest:
    link = LinkModel(bandwidth_Bps, 0.0, 2, codec_ratio=Replanner(cfg).ratio, margin=cfg.link_margin)
    return PlanRequest(COSTS, link, 1, H)


def _plan_at(cfg: SyncConfig, bandwidth_Bps: float, codec: str):  # type: ignore[no-untyped-def]
    link = LinkModel(bandwidth_Bps, 0.0, 2, codec_ratio=wire_ratio(codec), margin=cfg.link_margin)
    return plan_dreamddp(
        list(COSTS),
        link,
        H,
        version=1,
        effective_step=H,
        max_delay=cfg.delay_cap,
        bubble_fill=cfg.bubble_fill,
        round_cost_s=cfg.round_cost_s,
    )


@pytest.mark.parametrize("bandwidth_Bps", [1.25e6, 2.5e6, 12.5e6])
def test_pseudo_gradient_plans_are_priced_at_the_delta_codec(bandwidth_Bps: float) -> None:
    cfg = SyncConfig(strategy="dreamddp", period=H)
    assert cfg.delta_codec == "int4" and cfg.plan_codecs == ("int8",)
    made = Replanner(cfg).make(_request(cfg, bandwidth_Bps))
    assert made.plan == _plan_at(cfg, bandwidth_Bps, "int4")
    assert made.deltas == "int4"  # these links carry 4 bits of every pseudo-gradient within a period
    assert made.anchors == "int8"  # the only candidate: over budget or not, the anchors' codec


def test_pricing_at_int4_plans_shorter_delays_than_int8_on_a_slow_link() -> None:
    cfg = SyncConfig(strategy="dreamddp", period=H)
    plan = Replanner(cfg).make(_request(cfg, 2.5e6)).plan
    int8 = _plan_at(cfg, 2.5e6, "int8")
    assert max(s.delay for s in plan.syncs) < max(s.delay for s in int8.syncs)


def test_parameter_plans_are_priced_at_the_chosen_plan_codec() -> None:
    cfg = SyncConfig(strategy="dreamddp", period=H, delta_codec="", plan_codecs=("bf16", "int8"))
    made = Replanner(cfg).make(_request(cfg, 2.5e6))
    assert made.plan == _plan_at(cfg, 2.5e6, made.anchors)
    assert made.anchors in cfg.plan_codecs and made.deltas == ""


def test_anchor_codec_follows_the_budget() -> None:
    cfg = SyncConfig(strategy="dreamddp", period=H, plan_codecs=("fp32", "bf16", "int8"))
    fast = Replanner(cfg).make(_request(cfg, 1e9)).anchors
    slow = Replanner(dataclasses.replace(cfg, codec_link_budget=0.05)).make(_request(cfg, 2.5e6)).anchors
    assert (fast, slow) == ("fp32", "int8")


# 2 and 1 Mbit/s: a period's int4 pseudo-gradients (1.87 MB) keep the link busy 1.4 and 2.8 times the period's
# 5.4 s of compute; int2's (1.04 MB) 0.77 and 1.5 times
@pytest.mark.parametrize(
    ("bandwidth_Bps", "fallbacks", "deltas"),
    [
        (0.25e6, ("int2",), "int2"),  # int2 fits
        (0.125e6, ("int2",), "int2"),  # nothing fits: the most compressive
        (0.25e6, (), "int4"),  # no fallbacks: int4 whatever the link
        (0.25e6, ("e3m0",), "int4"),  # e3m0 sends no fewer bytes than int4: not a fallback
        (0.125e6, ("int2", "topk"), "topk"),
        (0.25e6, ("int2", "topk"), "int2"),  # the least compressive that fits
    ],
)
def test_a_tight_link_sends_the_first_fallback_it_carries(
    bandwidth_Bps: float, fallbacks: tuple[str, ...], deltas: str
) -> None:
    cfg = SyncConfig(strategy="dreamddp", period=H, delta_fallbacks=fallbacks)
    made = Replanner(cfg).make(_request(cfg, bandwidth_Bps))
    assert made.deltas == deltas
    assert made.plan == _plan_at(cfg, bandwidth_Bps, deltas)  # priced at the codec it sends
    assert made.plan.period == H  # a fallback comes before any stretch (and max_stretch is 1 here)


def test_a_fallback_comes_before_a_longer_period() -> None:
    cfg = SyncConfig(strategy="dreamddp", period=H, max_stretch=8, delta_fallbacks=("int2",))
    made = Replanner(cfg).make(_request(cfg, 0.25e6))
    assert (made.deltas, made.plan.period) == ("int2", H)
    # where even the last fallback cannot be carried, its plan is stretched
    made = Replanner(cfg).make(_request(cfg, 0.125e6))
    assert made.deltas == "int2" and made.plan.period == 2 * H
