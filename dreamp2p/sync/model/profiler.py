"""Per-layer forward/backward timing from module and gradient hooks (DreamDDP's scheduler input).

Forward time of a layer is the span between its forward pre- and post-hook. Backward time is read from
the moments each layer's gradients become ready (post-accumulate-grad hooks), as the DreamDDP authors
do: a layer's backward time is the gap since the previous layer (in backward order) became ready. On
CUDA the hooks synchronize, so they are installed only while profiling. Medians over steps.

Gradient accumulation (several forward/backward passes per optimizer step): each layer's readiness is
taken from the step's last backward pass and measured from the end of the last forward, so the profile is
that of one micro-batch.

``torch.compile``: the forward hooks do their work only when not traced (``torch.compiler.is_compiling()``
is a constant to dynamo, so inside a compiled region they are empty and cause no graph break; the clock
itself, ``time.perf_counter``, cannot be traced). A compiled forward is one fused graph whose layers have
no separate times anyway: their forward times stay unmeasured (0), and backward is measured from the
gradient hooks, which run in the autograd engine outside the compiled graph; without a forward end to
measure from, the first layer ready in each backward pass is left out.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from dreamp2p.schedule.cost import LayerCost
from dreamp2p.sync.model.layers import Layer


class LayerProfiler:
    def __init__(self, layers: Sequence[Layer]) -> None:
        self.layers = list(layers)
        self._handles: list[Any] = []
        self._fwd_start: dict[int, float] = {}
        self._fwd: dict[int, list[float]] = {i: [] for i in range(len(self.layers))}
        self._bwd: dict[int, list[float]] = {i: [] for i in range(len(self.layers))}
        self._ready: dict[int, float] = {}
        self._pending: dict[int, int] = {}
        self._nparams = {layer.index: len(layer.params) for layer in self.layers}
        self._fwd_end: float | None = None  # end of the step's last eager forward (None: none seen)
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
        self._pending = dict(self._nparams)
        self._fwd_end = None

    def _pre(self, i: int) -> Callable[..., None]:
        def hook(*_: Any) -> None:
            if torch.compiler.is_compiling():  # traced: nothing to time, and no graph break
                return
            self._fwd_start[i] = self._now()

        return hook

    def _post(self, i: int) -> Callable[..., None]:
        def hook(*_: Any) -> None:
            if torch.compiler.is_compiling():
                return
            now = self._now()
            self._fwd[i].append(now - self._fwd_start.get(i, now))
            self._fwd_end = now

        return hook

    def _grad(self, i: int) -> Callable[[torch.Tensor], None]:
        def hook(_: torch.Tensor) -> None:
            if torch.compiler.is_compiling():  # compiled autograd: not timed
                return
            self._pending[i] -= 1
            if self._pending[i] == 0:
                self._ready[i] = self._now()
                self._pending[i] = self._nparams[i]  # the next backward pass (gradient accumulation)

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
            if prev is not None:  # None: a compiled forward, no start to measure the first layer from
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
