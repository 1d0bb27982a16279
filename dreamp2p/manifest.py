"""Model identity: the manifest hash (names, shapes, dtypes) peers must share, and a digest of the values."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

import torch


def manifest_hash(named: Iterable[tuple[str, torch.Tensor]]) -> bytes:
    h = hashlib.sha256()
    for name, t in named:
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype}\n".encode())
    return h.digest()


def param_digest(model: torch.nn.Module) -> str:
    """xxh3 digest of every parameter's bytes: equal digests mean bit-identical replicas. A model sharded with
    FSDP2 is digested whole (each DTensor gathered: a collective, so every rank of its mesh must call it)."""
    return _digest(model.parameters())


def state_digest(model: torch.nn.Module) -> str:
    """xxh3 digest of every parameter's and buffer's bytes (frozen ones and BatchNorm statistics too); whole
    under FSDP2, as :func:`param_digest`."""
    return _digest((*model.parameters(), *model.buffers()))


def _digest(tensors: Iterable[torch.Tensor]) -> str:
    import xxhash

    h = xxhash.xxh3_64()
    for t in tensors:
        gather = getattr(t, "full_tensor", None)  # a DTensor (FSDP2): its whole value, from every rank
        whole = gather() if callable(gather) else t
        h.update(whole.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()
