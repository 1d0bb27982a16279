"""Checkpoints of a region sharded with FSDP2, written and read with torch.distributed.checkpoint (DCP).

Every rank of the region writes its own shards into one checkpoint folder, asynchronously (DCP stages a copy,
then writes it on a thread of its own over a gloo group of its own, while training goes on), and a region of
another size reads it back resharded. A checkpoint holds:

- the model and the optimizer, as DCP's state dicts (DTensors keyed by parameter name);
- the strategy's outer state that lives per parameter (`Strategy.outer_shards`: DiLoCo's global copy and
  outer momentum, DreamDDP's theta and momentum, ...), each placed as its parameter is, so it reshards too;
- ``meta``: the step, the rank count, the strategy and its settings (JSON in a byte tensor);
- ``rank<k>``: each rank's remaining strategy state (plans, control schedule, checks, rounds in flight: what
  its own ring agreed), as the JSON skeleton plus raw tensor bytes of `dreamp2p.state.snapshot`, never pickled.

Resumed by a region of the same size, every rank also loads its own remaining state and carries on exactly.
Resumed by a region of another size, each rank rings with other ranks than before, so what its ring agreed
starts over from the checkpoint's step (DreamDDP: a warm-up plan, then a measured one, as after a settings
change) while parameters, optimizer and outer state carry on.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from dreamp2p.errors import PeerError, Status
from dreamp2p.settings import resume_changes, resume_refusal
from dreamp2p.state.snapshot import flatten_state, unflatten_state
from dreamp2p.sync.comm.regionjoin import decode_fetched, encode_fetched
from dreamp2p.sync.model.shardlocal import local_state, local_view, shard_like
from dreamp2p.sync.strategies.base import Strategy, saved_settings

log = logging.getLogger(__name__)

FORMAT = 1  # meta's "format": bumped when the layout above changes


class ShardedCheckpoints:
    """DCP checkpoints of ``strategy`` (attached to an FSDP2 model) in a region whose ranks all make one of
    these at the same point (collective: it makes the process group the writes run on)."""

    def __init__(self, strategy: Strategy) -> None:
        if not dist.is_initialized():
            raise ValueError("sharded checkpoints need the region's process group (torch.distributed)")
        self.strategy = strategy
        self._names = {id(p): name for name, p in strategy.model.named_parameters()}  # DCP keys by name
        self.rank, self.ranks = dist.get_rank(), dist.get_world_size()
        # the writes' own gloo group: an asynchronous save's collectives never meet FSDP2's on the default one
        group = dist.new_group(backend="gloo")
        if group is None:
            raise RuntimeError("torch.distributed gave no process group for checkpoint writes")
        self._group: dist.ProcessGroup = group
        self._pending: concurrent.futures.Future[Any] | None = None

    def save(self, directory: str | Path, blocking: bool = False) -> None:
        """Write the checkpoint of the strategy's step into ``directory`` (every rank, at the same step).

        Returns once DCP has staged its copy; the write goes on in the background (``blocking``: waits for
        it). A save still writing is waited for first, so at most one is in flight."""
        self.wait()
        state = self._state(saving=True)
        meta: dict[str, Any] = {"format": FORMAT, "step": self.strategy.step_count, "ranks": self.ranks}
        meta |= {"strategy": self.strategy.name, "settings": self.strategy.cfg.shared_settings()}
        state["meta"] = _blob(json.dumps(meta).encode())
        state[f"rank{self.rank}"] = _blob(encode_fetched(0, *_rank_state(self.strategy)))
        path = str(directory)
        if blocking:
            dcp.save(state, checkpoint_id=path, process_group=self._group)
            return
        self._pending = dcp.async_save(state, checkpoint_id=path, process_group=self._group)  # type: ignore[assignment]

    def wait(self) -> None:
        """Wait for the save in flight, if any (its error, if it failed, is raised here)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def load(self, directory: str | Path) -> int:
        """Load the checkpoint in ``directory`` into the strategy (every rank, collective); the step it resumes at.

        Refused before anything loads: a folder that is not such a checkpoint or of another format or strategy
        (ValueError), settings a resume cannot change (PeerError CONFIG_MISMATCH, as `Strategy.load_state_dict`);
        other changed settings are adopted as there."""
        path = str(directory)
        entries = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
        sizes = {k: tuple(v.size) for k, v in entries.items() if hasattr(v, "size")}
        if "meta" not in sizes:
            raise ValueError(f"{path} is not a dreamp2p sharded checkpoint (no meta entry)")
        meta_template = {"meta": torch.empty(sizes["meta"], dtype=torch.uint8)}
        dcp.load(meta_template, checkpoint_id=path, process_group=self._group)
        meta = json.loads(meta_template["meta"].numpy().tobytes())
        if meta.get("format") != FORMAT:
            raise ValueError(f"{path}: sharded checkpoint format {meta.get('format')!r}, this version reads {FORMAT}")
        if meta["strategy"] != self.strategy.name:
            raise ValueError(f"{path} was saved by {meta['strategy']}; this node runs {self.strategy.name}")
        # settings a resume cannot change are refused before anything loads, as Strategy.load_state_dict would
        ours = {**self.strategy.cfg.shared_settings(), "sync.strategy": self.strategy.name}
        refusal = resume_refusal(resume_changes(saved_settings(meta), ours), self.strategy.resume_fixed)
        if refusal is not None:
            raise PeerError(Status.CONFIG_MISMATCH, refusal)
        state = self._state(saving=False)
        own = f"rank{self.rank}"
        same = meta["ranks"] == self.ranks and own in sizes
        if same:
            state[own] = torch.empty(sizes[own], dtype=torch.uint8)
        dcp.load(state, checkpoint_id=path, process_group=self._group)
        model, optimizer = self.strategy.model, self.strategy.optimizer
        set_model_state_dict(model, state["model"])
        set_optimizer_state_dict(model, optimizer, state["optim"])
        if same:
            _, skeleton, tensors = decode_fetched(state[own].numpy().tobytes())
            rest = unflatten_state(skeleton, tensors)
        else:
            log.warning(
                "%s was saved by a region of %d ranks, this one has %d: parameters, optimizer and outer state "
                "carry on resharded, what each rank's ring had agreed (plans, schedules) starts over at step %d",
                path,
                meta["ranks"],
                self.ranks,
                meta["step"],
            )
            rest = {"strategy": meta["strategy"], "step": self.strategy.step_count, "settings": meta["settings"]}
        self.strategy.load_state_dict(
            {**rest, "model": local_state(model.state_dict()), "optimizer": local_state(optimizer.state_dict())}
        )
        self._put_outer(state["outer"])
        if self.strategy.step_count < meta["step"]:
            self.strategy.jump_to(meta["step"])
        return int(meta["step"])

    def _state(self, saving: bool) -> dict[str, Any]:
        """DCP's state of the model, the optimizer and the strategy's per-parameter outer state: a copy of the
        latter to save (its views share storages, which DCP's staging cannot copy), empty ones to load into."""
        s = self.strategy
        outer = {
            kind: {
                self._names[id(p)]: shard_like(p, view.clone() if saving else torch.empty_like(view))
                for p, view in zip(s.params, views, strict=True)
            }
            for kind, views in s.outer_shards().items()
        }
        return {
            "model": get_model_state_dict(s.model),
            "optim": get_optimizer_state_dict(s.model, s.optimizer),
            "outer": outer,
        }

    def _put_outer(self, loaded: dict[str, dict[str, torch.Tensor]]) -> None:
        """Copy the loaded outer state into the strategy's own."""
        with torch.no_grad():
            for kind, views in self.strategy.outer_shards().items():
                for p, view in zip(self.strategy.params, views, strict=True):
                    view.copy_(local_view(loaded[kind][self._names[id(p)]]))


def _blob(data: bytes) -> torch.Tensor:
    """``data`` as a byte tensor owning its memory (DCP's staging copies storages, which a view of a Python
    buffer's is not)."""
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).clone() if data else torch.empty(0, dtype=torch.uint8)


def _rank_state(strategy: Strategy) -> tuple[bytes, dict[str, torch.Tensor]]:
    """This rank's strategy state but the model and optimizer (DCP holds those), as a skeleton and its tensors."""
    state = {k: v for k, v in strategy.state_dict().items() if k not in ("model", "optimizer")}
    skeleton, named = flatten_state(state)
    return skeleton, dict(named)
