"""The one map from strategy name to class; the names themselves are `dreamp2p.config.sync.STRATEGIES`."""

from __future__ import annotations

from dreamp2p.config.sync import STRATEGIES
from dreamp2p.sync.strategies.base import Strategy
from dreamp2p.sync.strategies.baselines import CO2, SSGD, DiLoCo, LocalSGD, NoSync
from dreamp2p.sync.strategies.dreamddp import DreamDDP
from dreamp2p.sync.strategies.streaming import StreamingDiLoCo

STRATEGY_CLASSES: dict[str, type[Strategy]] = {
    cls.name: cls for cls in (NoSync, SSGD, LocalSGD, DiLoCo, StreamingDiLoCo, CO2, DreamDDP)
}


def strategy_class(name: str) -> type[Strategy]:
    try:
        return STRATEGY_CLASSES[name]
    except KeyError:
        raise ValueError(f"strategy must be one of {', '.join(STRATEGIES)}; got {name!r}") from None
