"""DreamDDP's part of flush(): the trainable parameters made identical through its compressed path.

Every layer's pseudo-gradient (theta - params) travels at once in the flush's codec
(`SyncConfig.flush_delta_codec`), a few bits per weight instead of flush()'s fp32, with a check of the outer
weights beside it. Where every member's theta agreed, theta - mean pseudo-gradient is the members'
parameter mean up to the codec's error, and identical on every member, so it becomes both the parameters
and theta. Where anything is off (no delta codec, a failed round, outer weights apart) flush() averages the
parameters in fp32 instead; its digest check confirms the result either way
(`dreamp2p.sync.strategies.flush`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch

from dreamp2p.messages import RoundResult
from dreamp2p.sync.comm.collective import Collective
from dreamp2p.sync.model.groups import GROUP_FLUSH_DELTA, GROUP_FLUSH_THETA
from dreamp2p.sync.model.layers import FlatGroup, Layer
from dreamp2p.sync.strategies.flush import Wait
from dreamp2p.sync.strategies.layersync import Check
from dreamp2p.sync.strategies.outer import OuterWeights, anchor_verdict

log = logging.getLogger(__name__)

# `LayerSyncs.check`: launch the check of some layers' outer weights as (layers, group id, round id)
CheckLauncher = Callable[[tuple[int, ...], int, int], Check]


class DeltaFlush:
    """The compressed flush of every layer's parameters for one strategy, whose ``wait`` (`Strategy._wait`)
    and ``check`` (`LayerSyncs.check`) it uses."""

    def __init__(
        self,
        comm: Collective,
        weights: OuterWeights,
        layers: Sequence[Layer],
        pin: bool,
        wait: Wait,
        check: CheckLauncher,
    ) -> None:
        self._comm = comm
        self._weights = weights
        # every layer's parameters, in layer order, as theta's
        self._params = [p for layer in layers for p in layer.params]
        self._layers = tuple(range(len(layers)))
        self._pin = pin
        self._wait = wait
        self._check = check

    def run(self, round_id: int, codec: str) -> RoundResult | None:
        """The completed round of pseudo-gradients in ``codec``; None (flush() then averages in fp32) without
        one (""), alone, when a round failed or when the check found the outer weights apart."""
        if not codec or len(self._comm.members) == 1:
            return None
        layers = self._layers
        group = FlatGroup(self._params, pin=self._pin)
        group.snapshot()
        self._weights.copy_theta(layers, group.work)

        def pseudo_gradient() -> None:  # on the comm thread, once the snapshot has landed
            group.work.sub_(group.snap)

        fut = self._comm.allreduce_group(group, GROUP_FLUSH_DELTA, codec, round_id=round_id, prepare=pseudo_gradient)
        check, check_fut = self._check(layers, GROUP_FLUSH_THETA, round_id)
        res = self._wait(fut)
        checked = self._wait(check_fut)
        if res is None or checked is None:
            return None
        if anchor_verdict(check.work) != "agree":
            log.warning("flush: outer weights differ between members; the parameters are averaged in fp32")
            return None
        mean = torch.empty_like(group.work)
        self._weights.copy_theta(layers, mean)
        mean.sub_(group.work)  # theta - mean(theta - params) = mean(params), identical on every member
        group.write(mean)
        self._weights.set_theta(layers, mean)
        return res
