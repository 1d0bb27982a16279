"""A region of many local ranks as one WAN member: each rank averages its shard, the region gathers them.

A region is a torch.distributed job (torchrun) whose ranks train one replica with ordinary data
parallelism (DDP); on the WAN it is one member. :class:`ShardedCollective` implements the
:class:`~dreamp2p.sync.comm.collective.Collective` protocol for local rank k: a round over a group averages
shard k of the group's flat buffer (`dreamp2p.sync.comm.shards`) over this rank's own peer, whose ring holds
local rank k of every region, then an all-gather inside the region hands every rank the whole average.
Strategies are unchanged: they see one member per region, and every rank gets the same bytes.

Agreement inside the region: before the shards, every rank's outcome (whether its shard's WAN round
succeeded) and group size are gathered; a round counts as failed on every rank of the region when any
shard failed or the ranks packed groups of different sizes (a control round packed for the member count
each rank's own ring saw, while a region leaves or joins and the rings' views differ for a moment); a
round counts as failed on every rank of every region when any shard failed (every ring's
rounds are all-or-none across regions, so each region sees the same set of failed shards). The gathers
run on one thread of their own over a gloo group of their own (host buffers; DDP keeps the default group),
in the order the rounds were launched, which is the same on every rank. The region takes the members'
state as one replica when local rank 0's peer finds it missed their plan (`regiondrift`).

A region that shards its model with FSDP2 instead of replicating it (DDP) has no shard to cut: each rank
already holds its own shards of every parameter, averages them whole over its ring and gathers nothing
(:meth:`ShardedCollective.own_shards`).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import queue
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from dreamp2p.errors import RoundFailed
from dreamp2p.messages import LinkSnapshot, RingCodecPlan, RoundResult, TrainingInfo
from dreamp2p.sync.comm.collective import Collective
from dreamp2p.sync.comm.regiondrift import DriftVerdict
from dreamp2p.sync.comm.shards import shard_bounds, shard_length
from dreamp2p.sync.model.layers import FlatGroup

log = logging.getLogger(__name__)
T = TypeVar("T")

# how long a gather waits for a WAN round beyond the round timeout before it counts the shard as failed
WAN_GRACE_S = 30.0


def region_group(region: dist.ProcessGroup | bool | None) -> dist.ProcessGroup | None:
    """The region's process group: the one given; with ``None``, the default one when torch.distributed is
    initialized with more than one rank; else (``False``, or a single-rank job) none."""
    if isinstance(region, dist.ProcessGroup):
        if not dist.is_initialized():
            raise ValueError("a region's process group was given but torch.distributed is not initialized")
        return region
    if region is False or not dist.is_available() or not dist.is_initialized():
        return None
    return dist.group.WORLD if dist.get_world_size() > 1 else None


class _Shard(FlatGroup):
    """Host buffers of one shard of a group: what this rank's WAN round averages (not views of the group's,
    so a comm process can share them whole)."""

    def __init__(self, parent: FlatGroup, start: int, stop: int) -> None:
        super().__init__([torch.empty(stop - start)])
        self.params = []  # nothing of the model: the shard is copied in and gathered out by ShardedCollective
        self.device = parent.device  # a CUDA group's snapshot is awaited off the comm loop, as for the group
        # weak: the shard is the value of a weak-keyed cache whose key is the group (a strong reference would
        # keep every group alive); a round in flight holds its group itself
        self._parent = weakref.ref(parent)
        self.start, self.stop = start, stop

    def ready(self) -> None:
        parent = self._parent()
        if parent is not None:
            parent.ready()


class ShardedCollective:
    """Local rank k's Collective: WAN rounds over shard k (``wan``: this rank's own peer), gathered in ``group``."""

    def __init__(self, wan: Collective, group: dist.ProcessGroup) -> None:
        self.wan = wan
        # the gathers get a gloo group of their own: host buffers, and no interleaving with DDP's collectives
        ranks = dist.get_process_group_ranks(group)
        gather = dist.new_group(ranks=ranks, backend="gloo")
        if gather is None:
            raise RuntimeError("torch.distributed gave no process group for the region's gathers")
        self.group: dist.ProcessGroup = gather
        self.local_rank = dist.get_rank(group)
        self.ranks = dist.get_world_size(group)
        self._root = ranks[0]  # the global rank of local rank 0 (broadcasts come from it)
        verdicts = dist.new_group(ranks=ranks, backend="gloo")  # posted from the training thread, every step
        if verdicts is None:
            raise RuntimeError("torch.distributed gave no process group for the region's drift verdicts")
        self._verdict = DriftVerdict(verdicts, self._root, self.local_rank)
        self._shards: weakref.WeakKeyDictionary[FlatGroup, _Shard] = weakref.WeakKeyDictionary()
        self._owned = False  # FSDP2: every group holds this rank's own shards, averaged whole (own_shards)
        self._jobs: queue.SimpleQueue[tuple[Callable[[], Any], concurrent.futures.Future[Any]] | None] = (
            queue.SimpleQueue()
        )
        self._thread = threading.Thread(target=self._run, name=f"dreamp2p-region-{self.local_rank}", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ the Collective protocol

    @property
    def node_id(self) -> str:
        return self.wan.node_id

    @property
    def members(self) -> tuple[str, ...]:
        return self.wan.members

    @property
    def world(self) -> int:
        return self.wan.world

    @property
    def rank(self) -> int:
        return self.wan.rank

    @property
    def round_timeout_s(self) -> float:
        return self.wan.round_timeout_s

    def links(self) -> list[LinkSnapshot]:
        return self.wan.links()

    def set_training_info(self, info: TrainingInfo) -> None:
        # the Status call tells `dreamp2p status` which rank of how many this peer is
        self.wan.set_training_info(dataclasses.replace(info, region_rank=self.local_rank, region_ranks=self.ranks))

    @property
    def diverged_from(self) -> tuple[str, ...]:
        """The members whose state the region takes: local rank 0's verdict of the step before, alike on every
        rank (`dreamp2p.sync.comm.regiondrift`). A collective of the region: read once per step, by the
        strategy."""
        return self._verdict.exchange(self.wan.diverged_from if self.local_rank == 0 else ())

    def forget_verdict(self) -> None:
        """Drop the drift verdict in flight (every rank, at the same step): the region just took the state."""
        self._verdict.discard()

    @property
    def leading_step(self) -> int:
        return self.wan.leading_step

    def allreduce_group(
        self,
        group: FlatGroup,
        group_id: int,
        codec: str | RingCodecPlan | None = None,
        plan_version: int = 0,
        round_id: int | None = None,
        guard_norm: bool = True,
        prepare: Callable[[], None] | None = None,
        error_feedback: bool = False,
    ) -> concurrent.futures.Future[RoundResult]:
        """Average shard k of ``group`` over the WAN, then gather every shard into ``group.work``; under
        FSDP2 (:meth:`own_shards`) the whole group, which holds this rank's shards, and nothing is gathered."""
        if self._owned and group.numel == 0:
            # FSDP2 gave this rank no rows of the group's layers (a layer of fewer rows than ranks), and the same
            # rank of every region alike: nothing to average, and a round of nothing would send no frame that
            # could find a member gone or joining, so it would wait for its deadline
            return _empty(group_id, round_id, codec)
        if self._owned:
            return self.wan.allreduce_group(
                group, group_id, codec, plan_version, round_id, guard_norm, prepare, error_feedback
            )
        start, stop = shard_bounds(group.numel, self.ranks, self.local_rank)
        t0 = time.perf_counter()
        shard: _Shard | None = None
        if start == stop:  # a group smaller than the region: this shard is empty, nothing crosses the WAN
            wan = _empty(group_id, round_id, codec)
        else:
            shard = self._shard(group, start, stop)
            wan = self.wan.allreduce_group(
                shard,
                group_id,
                codec,
                plan_version,
                round_id,
                guard_norm,
                prepare=_fill(group, shard, prepare),
                error_feedback=error_feedback,
            )
        return self._submit(lambda: self._gather(group, shard, group_id, round_id, wan, t0))

    # ------------------------------------------------------------------ region operations

    def own_shards(self) -> None:
        """The model is sharded with FSDP2: each rank holds its own shards of every parameter, so each group a
        strategy makes holds only this rank's elements. Its rounds average them whole over this rank's ring
        (the same local rank of every region holds the same shards) and nothing is gathered: every element
        crosses the WAN once per region, and each ring's rounds are all-or-none across the regions on their
        own. The ranks of a region may then decide plans of their own (each ring's control rounds), which no
        region-wide agreement per round could follow, and none is needed: no rank reads another's shards."""
        self._owned = True

    @property
    def owns_shards(self) -> bool:
        """Whether this region's ranks average their own FSDP2 shards (:meth:`own_shards`)."""
        return self._owned

    def max_int(self, value: int, timeout: float) -> int:
        """The largest ``value`` any rank of the region passed (a barrier: returns once every rank has called it)."""
        flag = torch.tensor([value], dtype=torch.int64)

        def run() -> None:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)

        self._submit(run).result(timeout)
        return int(flag.item())

    def broadcast(self, tensors: Sequence[torch.Tensor], timeout: float) -> None:
        """Make every rank of the region hold local rank 0's values of ``tensors`` (bit-identical)."""
        if not tensors or self.ranks == 1:
            return
        flat = FlatGroup(list(tensors))
        flat.snapshot()
        flat.ready()

        def run() -> None:
            dist.broadcast(flat.snap, src=self._root, group=self.group)

        self._submit(run).result(timeout)
        flat.write(flat.snap)

    def all_ok(self, ok: bool, timeout: float) -> bool:
        """Whether every rank of the region passed ``ok`` (a barrier: returns once every rank has called it)."""
        return self.max_int(0 if ok else 1, timeout) == 0

    def broadcast_bytes(self, data: bytes | None, timeout: float) -> bytes:
        """Local rank 0's ``data`` on every rank (the others pass None): its length, then its bytes."""
        if self.local_rank == 0 and data is None:
            raise ValueError("local rank 0 must give the bytes it broadcasts")
        size = torch.tensor([len(data) if data is not None else 0], dtype=torch.int64)
        out: list[bytes] = []

        def run() -> None:
            dist.broadcast(size, src=self._root, group=self.group)
            if self.local_rank == 0 and data:
                buf = torch.frombuffer(bytearray(data), dtype=torch.uint8)
            else:
                buf = torch.empty(int(size.item()), dtype=torch.uint8)
            if buf.numel():
                dist.broadcast(buf, src=self._root, group=self.group)
            out.append(buf.numpy().tobytes())

        self._submit(run).result(timeout)
        return out[0]

    def close(self, timeout: float = 30.0) -> None:
        """Stop the gather thread after the rounds already queued."""
        self._verdict.close(timeout)
        if self._thread.is_alive():
            self._jobs.put(None)
            self._thread.join(timeout)

    # ------------------------------------------------------------------ internals

    def _shard(self, group: FlatGroup, start: int, stop: int) -> _Shard:
        shard = self._shards.get(group)
        if shard is None or (shard.start, shard.stop) != (start, stop):
            shard = _Shard(group, start, stop)
            self._shards[group] = shard
        return shard

    def _submit(self, fn: Callable[[], T]) -> concurrent.futures.Future[T]:
        fut: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._jobs.put((fn, fut))
        return fut

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            fn, fut = job
            try:
                fut.set_result(fn())
            except Exception as exc:  # handed to the strategy that waits on this round
                fut.set_exception(exc)

    def _gather(
        self,
        group: FlatGroup,
        shard: _Shard | None,
        group_id: int,
        round_id: int | None,
        wan: concurrent.futures.Future[RoundResult],
        t0: float,
    ) -> RoundResult:
        """On the gather thread: wait for this shard's WAN round, then all-gather every shard and its flag."""
        length = shard_length(group.numel, self.ranks)
        result: RoundResult | None = None
        error: BaseException | None = None
        try:
            result = wan.result(timeout=self.round_timeout_s + WAN_GRACE_S)
        except concurrent.futures.TimeoutError:
            error = RoundFailed((group_id, round_id or 0), "this rank's shard round gave no result in time")
        except Exception as exc:  # RoundFailed and the peer's own errors: told to the region, raised here
            error = exc
        # first every rank's group size and outcome: a group packed for another member count (a control
        # round while the shard rings' views differ, e.g. a region leaving or joining) fails everywhere
        head = torch.tensor([float(group.numel), 1.0 if result is not None else 0.0], dtype=torch.float64)
        heads = [torch.empty(2, dtype=torch.float64) for _ in range(self.ranks)]
        dist.all_gather(heads, head, group=self.group)
        failed = [k for k, h in enumerate(heads) if h[1].item() != 1.0]
        sizes = {int(h[0].item()) for h in heads}
        if error is not None:
            raise error
        if failed or result is None or len(sizes) != 1:
            why = f"shard(s) {failed} failed" if failed else f"the ranks packed groups of sizes {sorted(sizes)}"
            raise RoundFailed((group_id, round_id or 0), f"the WAN round failed in this region: {why}")
        send = torch.zeros(length, dtype=torch.float32)
        if shard is not None:
            send[: shard.numel].copy_(shard.work)
        slots = [torch.empty(length, dtype=torch.float32) for _ in range(self.ranks)]
        dist.all_gather(slots, send, group=self.group)
        for k, slot in enumerate(slots):
            a, b = shard_bounds(group.numel, self.ranks, k)
            group.work[a:b].copy_(slot[: b - a])
        return dataclasses.replace(result, elements=group.numel, seconds=time.perf_counter() - t0)


def _empty(
    group_id: int, round_id: int | None, codec: str | RingCodecPlan | None
) -> concurrent.futures.Future[RoundResult]:
    """A round of no elements, completed at once."""
    name = codec.gather if isinstance(codec, RingCodecPlan) else (codec or "fp32")
    done: concurrent.futures.Future[RoundResult] = concurrent.futures.Future()
    done.set_result(RoundResult(group_id, round_id or 0, 0.0, 0, 0, 0, name, 0))
    return done


def _fill(parent: FlatGroup, shard: _Shard, prepare: Callable[[], None] | None) -> Callable[[], None]:
    """The WAN round's prepare step: the group's own (if any), then this shard's part copied in."""

    def fill() -> None:
        if prepare is not None:
            prepare()  # fills the whole group's work (e.g. a pseudo-gradient)
            shard.work.copy_(parent.work[shard.start : shard.stop])
        else:
            shard.work.copy_(parent.snap[shard.start : shard.stop])

    return fill
