"""`bench memory`'s arithmetic, pure: the bytes of each buffer a strategy names, each storage counted once,
per parameter, and the verdict against the targets of issue 36.

Targets (bytes per parameter beyond the model, its gradients and the inner optimizer): S-SGD at most 4 (one
buffer of gradients); DiLoCo, Streaming DiLoCo and DreamDDP at most 12 at steady state (INTELLECT-1's
figure: a global copy, an outer momentum and one buffer for the pseudo-gradient, fp32); and at the peak at
most steady + 4 x the largest group a round carries (the flat copy a round makes while it runs).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from dreamp2p.sync.strategies.base import Held

STEADY_TARGETS: dict[str, float] = {"ssgd": 4.0, "diloco": 12.0, "streaming": 12.0, "dreamddp": 12.0}
# bytes per parameter a process-level peak may read above its limit: pages of Python objects and the
# allocator's own, which a model of tens of millions of parameters makes small next to 4 bytes each
PEAK_TOLERANCE_BPP = 0.25
BYTES_PER_ELEMENT = 4  # every flat round buffer is fp32

StorageKey = tuple[str, int]  # (device type, storage address)


def storage_key(t: torch.Tensor) -> tuple[StorageKey, int]:
    """The storage behind ``t`` (a view names its whole storage) and that storage's size in bytes."""
    storage = t.untyped_storage()
    return (t.device.type, storage.data_ptr()), storage.nbytes()


@dataclass(frozen=True)
class BufferBytes:
    """One named buffer's bytes, host (pinned included) and device apart."""

    name: str
    why: str
    host: int
    device: int


def account(held: Sequence[Held], exclude: Iterable[torch.Tensor] = ()) -> list[BufferBytes]:
    """Bytes of each buffer in ``held``: a storage counts once, for the first entry that holds it, and not at
    all where a tensor of ``exclude`` (the model's parameters, gradients, buffers, the optimizer's state) does."""
    seen = {storage_key(t)[0] for t in exclude}
    out = []
    for h in held:
        host = device = 0
        for t in h.tensors:
            key, nbytes = storage_key(t)
            if key in seen:
                continue
            seen.add(key)
            if key[0] == "cpu":
                host += nbytes
            else:
                device += nbytes
        out.append(BufferBytes(h.name, h.why, host, device))
    return out


def per_param(nbytes: float, params: int) -> float:
    """Bytes per parameter, rounded to 3 decimals; a negative reading (noise of a process-level delta) is 0."""
    return round(max(0.0, nbytes) / params, 3)


def steady_target(strategy: str, ranks: int = 1) -> float | None:
    """The steady target of ``strategy`` per rank of an FSDP2 region of ``ranks`` (each holds 1/ranks of the
    state), in bytes per parameter of the whole model; None where the strategy has none."""
    target = STEADY_TARGETS.get(strategy)
    return None if target is None else round(target / ranks, 3)


def verdict(strategy: str, steady: float, peak: float, largest_round: float, ranks: int = 1) -> dict[str, Any]:
    """The targets for ``strategy`` and whether they hold, all in bytes per parameter: ``steady`` at most its
    target (None: it has none; divided by ``ranks`` for a rank of an FSDP2 region), ``peak`` at most steady +
    the largest round's copy (within PEAK_TOLERANCE_BPP)."""
    target = steady_target(strategy, ranks)
    limit = steady + largest_round
    return {
        "steady_target_Bpp": target,
        "steady_ok": None if target is None else steady <= target,
        "peak_limit_Bpp": round(limit, 3),
        "peak_ok": peak <= limit + PEAK_TOLERANCE_BPP,
    }


def over_target(steady: float, target: float | None, buffers: Sequence[BufferBytes], params: int) -> str | None:
    """Where ``steady`` is above ``target``: which buffers hold it and why each is needed (None where it is not)."""
    if target is None or steady <= target:
        return None
    parts = [f"{b.name} {per_param(b.host, params):g} ({b.why})" for b in buffers if b.host]
    return f"steady {steady:g} B/param > {target:g}: " + "; ".join(parts)


def buffer_rows(buffers: Sequence[BufferBytes], params: int) -> list[dict[str, Any]]:
    """The JSON rows of ``buffers``: name, host bytes per parameter (device ones where any), why."""
    rows = []
    for b in buffers:
        row: dict[str, Any] = {"name": b.name, "Bpp": per_param(b.host, params)}
        if b.device:
            row["device_Bpp"] = per_param(b.device, params)
        row["why"] = b.why
        rows.append(row)
    return rows
