"""Per-layer forward/backward timing from module and gradient hooks (DreamDDP's scheduler input).

Forward time of a layer is the span between its forward pre- and post-hook. Backward time is read from
the moments each layer's gradients become ready (post-accumulate-grad hooks), as the DreamDDP authors
do: a layer's backward time is the gap since the previous layer (in backward order) became ready. On
CUDA the hooks synchronize, so they are installed only while profiling. Medians over steps.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from dreamp2p.schedule.cost import LayerCost
from dreamp2p.sync.layers import Layer


class LayerProfiler:
    def __init__(self, layers: Sequence[Layer]) -> None:
        self.layers = list(layers)
        self._handles: list[Any] = []
        self._fwd_start: dict[int, float] = {}
        self._fwd: dict[int, list[float]] = {i: [] for i in range(len(self.layers))}
        self._bwd: dict[int, list[float]] = {i: [] for i in range(len(self.layers))}
        self._ready: dict[int, float] = {}
        self._pending: dict[int, int] = {}
        self._fwd_end = 0.0
        self._cuda = any(p.device.type == "cuda" for layer in self.layers for p in layer.params)
        self.steps = 0

    def _now(self) -> float:
        if self._cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    def start(self) -> None:
        if self._handles:
            return
        for layer in self.layers:
            i = layer.index
            self._handles.append(layer.module.register_forward_pre_hook(self._pre(i)))
            self._handles.append(layer.module.register_forward_hook(self._post(i)))
            for p in layer.params:
                self._handles.append(p.register_post_accumulate_grad_hook(self._grad(i)))
        self._begin_step()

    def stop(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    @property
    def active(self) -> bool:
        return bool(self._handles)

    def _begin_step(self) -> None:
        self._ready.clear()
        self._pending = {layer.index: len(layer.params) for layer in self.layers}

    def _pre(self, i: int) -> Callable[..., None]:
        def hook(*_: Any) -> None:
            self._fwd_start[i] = self._now()

        return hook

    def _post(self, i: int) -> Callable[..., None]:
        def hook(*_: Any) -> None:
            now = self._now()
            self._fwd[i].append(now - self._fwd_start.get(i, now))
            self._fwd_end = now

        return hook

    def _grad(self, i: int) -> Callable[[torch.Tensor], None]:
        def hook(_: torch.Tensor) -> None:
            self._pending[i] -= 1
            if self._pending[i] == 0:
                self._ready[i] = self._now()

        return hook

    def skip_step(self) -> None:
        """Discard this step's timings (e.g. the first step, which pays one-time costs)."""
        self._begin_step()

    def end_step(self) -> None:
        """Call after backward: turns this step's ready times into per-layer backward times."""
        if not self.active:
            return
        order = sorted(self._ready, key=self._ready.__getitem__)
        prev = self._fwd_end
        for i in order:
            self._bwd[i].append(max(0.0, self._ready[i] - prev))
            prev = self._ready[i]
        self.steps += 1
        self._begin_step()

    def costs(self) -> list[LayerCost]:
        """Median forward/backward seconds per layer (forward order), with fp32 parameter bytes."""
        out = []
        for layer in self.layers:
            fwd = statistics.median(self._fwd[layer.index]) if self._fwd[layer.index] else 0.0
            bwd = statistics.median(self._bwd[layer.index]) if self._bwd[layer.index] else 0.0
            out.append(LayerCost(layer.name, fwd, bwd, layer.nbytes))
        return out
