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
    """xxh3 digest of every parameter's bytes: equal digests mean bit-identical replicas."""
    import xxhash

    h = xxhash.xxh3_64()
    for p in model.parameters():
        h.update(p.detach().cpu().numpy().tobytes())
    return h.hexdigest()


def state_digest(model: torch.nn.Module) -> str:
    """xxh3 digest of every parameter's and buffer's bytes (frozen ones and BatchNorm statistics too)."""
    import xxhash

    h = xxhash.xxh3_64()
    for t in (*model.parameters(), *model.buffers()):
        h.update(t.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()
