"""Layers of a model as the unit of scheduling, and flat host buffers for snapshotting and merging them.

A "layer" is a module that owns parameters directly (Linear, Embedding, LayerNorm, ...), in the order the
model registers them, which is the order forward uses them for ordinary models. Buffers live in host
memory (pinned when the model is on CUDA), so syncing costs no extra accelerator memory.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from dreamp2p.sync.model.shardlocal import local_view


@dataclass(frozen=True)
class Layer:
    index: int
    name: str
    module: nn.Module
    params: tuple[nn.Parameter, ...]

    @property
    def numel(self) -> int:
        """Elements this rank holds (its shards' under FSDP2, `dreamp2p.sync.model.shardlocal`)."""
        return sum(local_view(p).numel() for p in self.params)

    @property
    def nbytes(self) -> int:
        return 4 * self.numel


def discover_layers(model: nn.Module) -> list[Layer]:
    """Modules owning trainable parameters, in registration order; each parameter belongs to one layer."""
    seen: set[int] = set()
    layers: list[Layer] = []
    for name, module in model.named_modules():
        params = tuple(p for p in module.parameters(recurse=False) if p.requires_grad and id(p) not in seen)
        if not params:
            continue
        seen.update(id(p) for p in params)
        layers.append(Layer(len(layers), name or type(module).__name__, module, params))
    if not layers:
        raise ValueError("model has no trainable parameters")
    return layers


class FlatGroup:
    """Parameters (or any tensors: buffers, gradients) of several layers viewed as one flat fp32 host buffer.

    Integer and bool tensors (BatchNorm's ``num_batches_tracked``) travel as fp32 and are rounded back.

    ``snapshot()`` copies the live parameters into ``snap`` (host); ``merge()`` sets them to
    ``avg + (params - snap)``, which keeps any local progress made since the snapshot (merge
    deltas, never overwrite). For a merge right after the snapshot this is exactly ``params <- avg``.

    ``one_buffer``: ``snap`` is ``work`` itself (4 bytes per element instead of 8), for a strategy that
    never merges (its result is built from the mean alone): the round averages the buffer in place, as
    every collective copies its source before it writes ``work``.

    FSDP2 parameters (DTensors) are taken as this rank's local shards: the group holds what this rank owns.
    """

    def __init__(self, params: Sequence[torch.Tensor], pin: bool = False, one_buffer: bool = False) -> None:
        self.params = [local_view(p) for p in params]
        self.numel = sum(p.numel() for p in self.params)
        self.device = self.params[0].device if self.params else torch.device("cpu")
        pin = pin and self.device.type == "cuda"
        self.work = torch.empty(self.numel, dtype=torch.float32, pin_memory=pin)
        self.snap = self.work if one_buffer else torch.empty(self.numel, dtype=torch.float32, pin_memory=pin)
        self._event: torch.cuda.Event | None = None

    @property
    def buffers(self) -> tuple[torch.Tensor, ...]:
        """The group's host memory: ``snap`` and ``work``, or the one buffer."""
        return (self.work,) if self.snap is self.work else (self.snap, self.work)

    def snapshot(self, source: Sequence[torch.Tensor] | None = None) -> None:
        """Copy ``source`` (default: the parameters) into ``snap``; on CUDA the copy is asynchronous."""
        offset = 0
        with torch.no_grad():
            for p in source if source is not None else self.params:
                n = p.numel()
                self.snap[offset : offset + n].copy_(p.detach().reshape(-1), non_blocking=True)
                offset += n
            if self.device.type == "cuda":
                self._event = torch.cuda.Event()
                self._event.record()

    def ready(self) -> None:
        """Wait until an asynchronous device-to-host snapshot has landed (call off the training thread)."""
        if self._event is not None:
            self._event.synchronize()
            self._event = None

    def merge(self) -> None:
        """params <- avg + (params - snap): the average plus whatever local progress was made meanwhile.

        Written this way round so that with no progress (params == snap) the result is exactly ``avg``
        on every peer; ``params + (avg - snap)`` would differ between peers in the last bit.
        """
        if self.snap is self.work:
            raise RuntimeError("a one-buffer group keeps no snapshot to merge against; write() its mean")
        offset = 0
        with torch.no_grad():
            for p in self.params:
                n = p.numel()
                avg = self.work[offset : offset + n].view(p.shape)
                snap = self.snap[offset : offset + n].view(p.shape)
                if p.device.type == "cpu" and p.dtype == torch.float32:
                    # in place, no temporaries: p - snap rounds as before, and adding avg to it is
                    # bit-identical to avg + (p - snap) (IEEE addition commutes)
                    p.detach().sub_(snap).add_(avg)
                elif p.device.type == "cpu":
                    _assign(p, avg + (p.detach().to(torch.float32) - snap))
                else:
                    # on the accelerator: two uploads from (pinned) host memory, queued on the current stream
                    # and so done before the next snapshot's event; no download, no host sync
                    avg_d = avg.to(p.device, non_blocking=True)
                    snap_d = snap.to(p.device, non_blocking=True)
                    _assign(p, avg_d + (p.detach().to(torch.float32) - snap_d))
                offset += n

    def read(self, target: torch.Tensor) -> None:
        """Copy the parameters into a flat host tensor."""
        offset = 0
        with torch.no_grad():
            for p in self.params:
                n = p.numel()
                target[offset : offset + n].copy_(p.detach().reshape(-1))
                offset += n

    def write(self, source: torch.Tensor) -> None:
        """Overwrite the parameters from a flat host tensor."""
        offset = 0
        with torch.no_grad():
            for p in self.params:
                n = p.numel()
                _assign(p, source[offset : offset + n].view(p.shape))
                offset += n


def _assign(target: torch.Tensor, value: torch.Tensor) -> None:
    """target <- value (fp32), rounding for integer and bool tensors (a cast would truncate 2.9999998 to 2)."""
    if target.is_floating_point() or target.is_complex():
        target.copy_(value)
    else:
        target.copy_(value.round())
