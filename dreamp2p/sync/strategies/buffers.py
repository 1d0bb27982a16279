"""Model state that is not a trainable parameter: frozen parameters and registered buffers.

Gradient-based strategies only move trainable parameters, so without help a frozen parameter keeps each
member's own initial values and BatchNorm running statistics drift apart (DDP broadcasts buffers for the
same reason). Frozen parameters are broadcast once at attach (and arrive with the state on a join);
buffers are broadcast at attach and, whenever a strategy syncs parameters, averaged (or replaced by rank
0's values, ``sync.buffers = "broadcast"``) in a small round of their own.
"""

from __future__ import annotations

import concurrent.futures

import torch
from torch import nn

from dreamp2p.messages import RoundResult
from dreamp2p.sync.comm.collective import Collective
from dreamp2p.sync.model.groups import GROUP_BUFFERS
from dreamp2p.sync.model.layers import FlatGroup


def frozen_parameters(model: nn.Module) -> list[nn.Parameter]:
    """Parameters that no optimizer moves (``requires_grad=False``), each once (tied weights)."""
    seen: set[int] = set()
    out = []
    for p in model.parameters():
        if not p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


def model_buffers(model: nn.Module) -> list[torch.Tensor]:
    """Every registered buffer (persistent or not), each once, in registration order."""
    seen: set[int] = set()
    out = []
    for b in model.buffers():
        if id(b) not in seen and b.numel() > 0:
            seen.add(id(b))
            out.append(b)
    return out


class BufferSync:
    """One in-flight round over a model's buffers; the strategy decides when to launch and land it.

    Landing merges the mean into the buffers with the local progress made since the launch kept
    (``avg + (now - launched)``, see :meth:`FlatGroup.merge`), so a round landing in the same step leaves
    bit-identical buffers everywhere and one landing a step later loses no local update.
    """

    def __init__(self, comm: Collective, buffers: list[torch.Tensor], mode: str, pin: bool) -> None:
        self._comm = comm
        self._mode = mode
        self._group = FlatGroup(buffers, pin=pin)
        self._fut: concurrent.futures.Future[RoundResult] | None = None

    def launch(self, round_id: int) -> None:
        self._group.snapshot()
        if self._mode == "broadcast":
            # rank 0 contributes N x its values, the others zero: the mean is rank 0's values everywhere
            self._group.snap.mul_(float(self._comm.world) if self._comm.rank == 0 else 0.0)
        # buffers are statistics, not updates: their norm may move by orders of magnitude legitimately
        self._fut = self._comm.allreduce_group(self._group, GROUP_BUFFERS, "fp32", round_id=round_id, guard_norm=False)

    @property
    def buffers(self) -> tuple[torch.Tensor, ...]:
        """The round's host memory (the buffers as sent, and their mean)."""
        return self._group.buffers

    def take(self) -> concurrent.futures.Future[RoundResult] | None:
        """The round in flight, if any, handed to the caller to wait on (then :meth:`apply` it)."""
        fut, self._fut = self._fut, None
        return fut

    def apply(self) -> None:
        self._group.merge()
