"""Model manifest hash: peers only average with peers that hold the same tensor names, shapes and dtypes."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

import torch


def manifest_hash(named: Iterable[tuple[str, torch.Tensor]]) -> bytes:
    h = hashlib.sha256()
    for name, t in named:
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype}\n".encode())
    return h.digest()
