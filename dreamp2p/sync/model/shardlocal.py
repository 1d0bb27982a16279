"""A model sharded with FSDP2 (``torch.distributed.fsdp.fully_shard``) seen as the shards this rank owns.

Under FSDP2 every parameter (and its gradient and optimizer state) is a DTensor whose local tensor is this
rank's shard, a view of the storage the optimizer updates in place. In a region of FSDP2 ranks each local rank
averages exactly its own shards with the same local rank of the other regions, so every strategy works on
the local tensors: `local_view` is what flat buffers copy from and write to, and the state a rank saves or
serves a joiner holds its local shards only (`local_state`), loaded back into the DTensors it came from
(`load_model_state`, `load_optimizer_state`). A model without DTensors passes through unchanged.
"""

from __future__ import annotations

import sys
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn


def _dtensor_class() -> type | None:
    # a DTensor exists only once torch.distributed.tensor was imported (fully_shard imports it): a model that
    # never touched it pays nothing, not even the import (a third of a second)
    module = sys.modules.get("torch.distributed.tensor")
    return getattr(module, "DTensor", None) if module is not None else None


def is_dtensor(t: object) -> bool:
    cls = _dtensor_class()
    return cls is not None and isinstance(t, cls)


def local_view(t: torch.Tensor) -> torch.Tensor:
    """The elements of ``t`` this rank holds: a DTensor's local shard (sharing its storage), else ``t``."""
    if is_dtensor(t):
        with torch.no_grad():
            return t.to_local()  # type: ignore[attr-defined]
    return t


def is_sharded(model: nn.Module) -> bool:
    """Whether ``model``'s parameters are DTensors (FSDP2), i.e. each rank holds shards of them."""
    return any(is_dtensor(p) for p in model.parameters())


def shard_like(param: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """``local`` (this rank's shard) as a tensor shaped like ``param``: a DTensor placed as ``param`` is."""
    if not is_dtensor(param):
        return local
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(
        local,
        param.device_mesh,  # type: ignore[attr-defined]
        param.placements,  # type: ignore[attr-defined]
        run_check=False,
        shape=param.shape,
        stride=param.stride(),
    )


def split_like(flat: torch.Tensor, params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Views of the flat ``flat``, one per parameter of ``params`` in order, each shaped as this rank's shard of
    it (``flat`` holds their local shards concatenated, as a strategy's outer state does)."""
    views, offset = [], 0
    for p in params:
        shard = local_view(p)
        views.append(flat[offset : offset + shard.numel()].view(shard.shape))
        offset += shard.numel()
    if offset != flat.numel():
        raise ValueError(f"a flat tensor of {flat.numel()} elements for parameters of {offset}")
    return views


def local_state(state: Any) -> Any:
    """A (nested) state dict with every DTensor replaced by its local shard (sharing its storage, as
    ``state_dict()`` does); everything else as it is."""
    if isinstance(state, Mapping):
        out = {k: local_state(v) for k, v in state.items()}
        if isinstance(state, OrderedDict):  # a module's state_dict: its modules' versions travel with it
            ordered: OrderedDict[Any, Any] = OrderedDict(out)
            if hasattr(state, "_metadata"):
                ordered._metadata = state._metadata  # type: ignore[attr-defined]
            return ordered
        return out
    if isinstance(state, list | tuple):
        return type(state)(local_state(v) for v in state)
    if isinstance(state, torch.Tensor):
        return local_view(state).detach()
    return state


def load_model_state(model: nn.Module, state: Mapping[str, torch.Tensor]) -> None:
    """``model.load_state_dict(state)`` for a state of local shards (`local_state`): each DTensor entry is
    copied into this rank's shard in place; a missing, extra or wrongly shaped entry raises ValueError before
    anything is written."""
    if not is_sharded(model):
        model.load_state_dict(state)
        return
    own = model.state_dict()
    missing, extra = sorted(set(own) - set(state)), sorted(set(state) - set(own))
    if missing or extra:
        raise ValueError(f"model state: missing keys {missing[:5]}, unexpected keys {extra[:5]}")
    pairs = [(name, local_view(target), state[name]) for name, target in own.items()]
    for name, dest, value in pairs:  # every entry checked before any is written: a bad state loads nothing
        if tuple(value.shape) != tuple(dest.shape):
            raise ValueError(
                f"model state {name!r}: shape {tuple(value.shape)} where this rank holds {tuple(dest.shape)}"
            )
    with torch.no_grad():
        for _, dest, value in pairs:
            dest.copy_(value)


def load_optimizer_state(optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """``optimizer.load_state_dict(state)`` for a state of local shards: what it loads for a DTensor parameter
    is placed as that parameter is again (AdamW's moments must be DTensors beside DTensor parameters)."""
    optimizer.load_state_dict(state)
    for group in optimizer.param_groups:
        for p in group["params"]:
            if not is_dtensor(p):
                continue
            per_param = optimizer.state.get(p, {})
            for key, value in per_param.items():
                if isinstance(value, torch.Tensor) and not is_dtensor(value) and value.shape == local_view(p).shape:
                    per_param[key] = shard_like(p, value)
