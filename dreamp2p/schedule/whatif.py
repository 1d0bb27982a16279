"""`dreamp2p plan`: predict step time and compute utilization before launch, from a model description.

A model of ``params`` parameters in ``layers`` equal layers, whose forward+backward takes ``step_time``
seconds (split 1:2, as backward costs about twice forward), on a ring of ``peers`` joined by links of a
given rate and RTT. Pure: the same cost model and planner the trainer uses at run time (the command passes
DreamDDP's run-time defaults: delays up to period - 1, the first plan codec, the plan margin and the
round cost, so it predicts the plan a run with defaults adopts).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from dreamp2p.schedule.cost import LayerCost, LinkModel
from dreamp2p.schedule.dreamddp import PLANNED_SCHEDULES, plan_dreamddp, predict
from dreamp2p.schedule.plan import Plan
from dreamp2p.schedule.stretch import choose_delta_codec


def uniform_costs(params: float, layers: int, step_time_s: float) -> list[LayerCost]:
    if params <= 0 or layers < 1 or step_time_s <= 0:
        raise ValueError("need params > 0, layers >= 1 and step time > 0")
    nbytes = int(4 * params / layers)
    return [
        LayerCost(f"layer{i}", step_time_s / 3 / layers, 2 * step_time_s / 3 / layers, nbytes) for i in range(layers)
    ]


def what_if(
    params: float,
    layers: int,
    step_time_s: float,
    peers: int,
    bandwidth_Bps: float,
    rtt_s: float,
    period: int = 10,
    codec_ratio: float = 1.0,
    max_delay: int = 0,
    margin: float = 1.0,
    round_cost_s: float = 0.0,
) -> dict[str, Any]:
    """Predictions per schedule and DreamDDP's plan. ``margin`` and ``round_cost_s`` are the planner's
    (`LinkModel.margin`, `plan_dreamddp`): pass the run's own to predict what it will adopt."""
    costs = uniform_costs(params, layers, step_time_s)
    link = LinkModel(bandwidth_Bps=bandwidth_Bps, rtt_s=rtt_s, world=peers, codec_ratio=codec_ratio, margin=margin)
    out: dict[str, Any] = {}
    for name in PLANNED_SCHEDULES:
        delay = max_delay if name == "dreamddp" else 0
        pred = predict(costs, link, period, name, max_delay=delay, bubble_fill=False, round_cost_s=round_cost_s)
        out[name] = {k: pred[k] for k in ("step_time_s", "compute_utilization", "bytes_per_step", "rounds_per_step")}
    plan = plan_dreamddp(costs, link, period, max_delay=max_delay, bubble_fill=False, round_cost_s=round_cost_s)
    schedule = [
        {
            "iteration": s.iteration,
            "layers": [s.layers[0], s.layers[-1]],
            "delay": s.delay,
            "comm_s": round(s.comm_s, 4),
        }
        for s in plan.syncs
    ]
    return {"predictions": out, "dreamddp_schedule": schedule, "period": period, "peers": peers}


def run_delta_codec(
    chain: Sequence[tuple[str, float]],
    params: float,
    layers: int,
    step_time_s: float,
    peers: int,
    bandwidth_Bps: float,
    rtt_s: float,
    period: int,
    max_delay: int,
    margin: float = 1.0,
    round_cost_s: float = 0.0,
) -> str:
    """The codec of ``chain`` (name, wire bytes per fp32 byte; least compressive first) a run's planner
    gives its pseudo-gradients on this link at ``period``: `stretch.choose_delta_codec`, the run's own rule,
    on the uniform model."""
    costs = uniform_costs(params, layers, step_time_s)
    link = LinkModel(bandwidth_Bps=bandwidth_Bps, rtt_s=rtt_s, world=peers, margin=margin)

    def make_plan(lk: LinkModel, H: int) -> Plan:
        return plan_dreamddp(costs, lk, H, max_delay=max_delay, bubble_fill=False, round_cost_s=round_cost_s)

    return choose_delta_codec(chain, costs, link, (period,), make_plan)[0]
