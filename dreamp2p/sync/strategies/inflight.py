"""A DreamDDP layer sync in flight: its buffers and rounds, and its checkpoint record.

A sync launched at one step lands ``delay`` steps later (docs/PLANNING.md, the WAN extension of DreamDDP,
arXiv 2502.11058). Every member that took part applies it at the same step, so a checkpoint taken while it
travels keeps its result, and a joiner or a resumed node applies the same average at the same step.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from dreamp2p.messages import RoundResult
from dreamp2p.sync.model.layers import FlatGroup, Layer
from dreamp2p.sync.strategies.base import landed, settled


@dataclass
class InFlight:
    land_step: int
    key: tuple[int, int]  # (plan version, sync index)
    group: FlatGroup
    layers: tuple[int, ...]
    fut: concurrent.futures.Future[RoundResult]
    # anchors and checked pseudo-gradients: the round of (flag, 16 digest bits) beside the sync; None for
    # an unchecked pseudo-gradient sync
    check: FlatGroup | None = None
    check_fut: concurrent.futures.Future[RoundResult] | None = None
    anchor: bool = False  # whether it averages the parameters themselves (else pseudo-gradients)
    rated: bool = False  # whether its round's pace was taken into the link estimate yet (once per sync)

    def record(self, timeout: float) -> dict[str, Any] | None:
        """Wait for the sync, then its checkpoint record; None when it failed (everywhere: nobody applies it).
        RoundFailed when a round is still in flight after ``timeout`` (`dreamp2p.sync.strategies.base.settled`)."""
        if not settled(self.fut, timeout) or (self.check_fut is not None and not settled(self.check_fut, timeout)):
            return None
        rec = {
            "land": self.land_step,
            "key": list(self.key),
            "layers": list(self.layers),
            "mean": self.group.work.clone(),
            "snap": self.group.snap.clone(),
            "anchor": self.anchor,
        }
        if self.check is not None:
            rec["check"] = self.check.work.clone()
        return rec

    @classmethod
    def restore(cls, rec: dict[str, Any], model_layers: Sequence[Layer], pin: bool) -> InFlight:
        """The landed sync a :meth:`record` describes, over the parameters of ``model_layers``."""
        layers = tuple(int(li) for li in rec["layers"])
        group = FlatGroup([p for li in layers for p in model_layers[li].params], pin=pin)
        group.snap.copy_(rec["snap"])
        group.work.copy_(rec["mean"])
        key = (int(rec["key"][0]), int(rec["key"][1]))
        # records from before checked pseudo-gradients: every checked sync was an anchor
        inf = cls(
            int(rec["land"]), key, group, layers, landed(group.numel), anchor=bool(rec.get("anchor", "check" in rec))
        )
        if "check" in rec:
            inf.check = FlatGroup([rec["check"].clone()])
            inf.check.work.copy_(rec["check"])
            inf.check_fut = landed(inf.check.numel)
        return inf
