"""A region of many local ranks taking the members' state: one transfer, the same state on every rank.

Each local rank's peer joins its own shard ring (it must be counted alive there, so every ring's rounds
include it and fail while it still refuses frames); once every rank of the region is, local rank 0 alone
fetches the training state from a live member, exactly as a one-rank joiner does, and hands it and the
step to start at to the other ranks over the region's process group (the transfer's JSON skeleton plus
the raw tensor bytes, each tensor's SHA-256 checked on arrival; nothing is unpickled). Every rank then
loads the same state, starts at the same step and is admitted from the same round, so the region comes
back as one replica. A rank that fails any stage fails the others' too instead of leaving them waiting.
A running region that missed the members' plan (after a partition or a freeze) takes their state the same
way (`resync_region`), at the step every rank learns of it (`dreamp2p.sync.comm.regiondrift`).

A region sharded with FSDP2 has no one state to hand over: each rank takes its own shards' state from its
own ring (`join_owned`, `resync_owned`), and the region starts at the latest step any rank took.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from dreamp2p.errors import PeerError
from dreamp2p.state.snapshot import TensorMeta, tensor_from_bytes, tensor_to_bytes, unflatten_state
from dreamp2p.sync.comm.sharded import ShardedCollective
from dreamp2p.sync.comm.shards import rank_node_id

log = logging.getLogger(__name__)

T = TypeVar("T")
NOT_ADMITTED = "another rank of the region was not admitted to its shard ring"

# what local rank 0's fetch gives: the step to start at, the state's JSON skeleton and its named tensors
Fetched = tuple[int, bytes, dict[str, torch.Tensor]]


def encode_fetched(start: int, skeleton: bytes, tensors: dict[str, torch.Tensor]) -> bytes:
    """One buffer: an 8-byte header length, a JSON header (start, skeleton, tensor metadata), the tensors' bytes."""
    metas, blobs = [], []
    for name, t in tensors.items():
        meta, data = tensor_to_bytes(name, t)
        metas.append([meta.name, meta.dtype, list(meta.shape), meta.nbytes, meta.sha256.hex()])
        blobs.append(bytes(data))
    head = json.dumps({"start": start, "skeleton": skeleton.decode("utf-8"), "tensors": metas}).encode()
    return len(head).to_bytes(8, "little") + head + b"".join(blobs)


def decode_fetched(buf: bytes) -> Fetched:
    """What :func:`encode_fetched` packed; ValueError on a malformed buffer or a tensor whose hash differs."""
    if len(buf) < 8:
        raise ValueError(f"a region's state buffer of {len(buf)} bytes has no header")
    size = int.from_bytes(buf[:8], "little")
    head = json.loads(buf[8 : 8 + size])
    offset = 8 + size
    tensors: dict[str, torch.Tensor] = {}
    for name, dtype, shape, nbytes, sha in head["tensors"]:
        meta = TensorMeta(name, dtype, tuple(shape), nbytes, bytes.fromhex(sha))
        tensors[name] = tensor_from_bytes(meta, buf[offset : offset + nbytes])
        offset += nbytes
    if offset != len(buf):
        raise ValueError(f"a region's state buffer has {len(buf) - offset} bytes past its tensors")
    return int(head["start"]), head["skeleton"].encode("utf-8"), tensors


def join_region(
    region: ShardedCollective,
    admit: Callable[[], None],
    fetch: Callable[[], Fetched],
    load: Callable[[Any, int], None],
    timeout: float,
) -> int:
    """Join as every local rank of ``region``; the step the region starts at (the same on every rank).

    ``admit``: ask in and wait until this rank's ring counts it in its view. ``fetch`` (local rank 0
    only): take the state from the live members and load it here; returns what the others load.
    ``load(state, start)``: load that state into this rank's strategy and start it at ``start``.
    """
    _together(region, admit, NOT_ADMITTED, timeout)
    start, error = _hand_over(region, fetch, load, timeout)
    if error is not None:
        raise error
    if start is None:
        raise RuntimeError("local rank 0 of the region could not fetch the members' state")
    log.warning("region rank %d joined at step %d with local rank 0's transfer", region.local_rank, start)
    return start


def resync_region(
    region: ShardedCollective, fetch: Callable[[], Fetched], load: Callable[[Any, int], None], timeout: float
) -> int | None:
    """Every rank of a running ``region`` takes the state local rank 0 fetches (``fetch``, which loads it
    there); the step to start at, the same on every rank, or None when local rank 0 could not fetch it
    (every rank then trains on with its own state). Called by every rank at the same step."""
    region.forget_verdict()  # posted before this transfer: out of date after it
    start, error = _hand_over(region, fetch, load, timeout)
    if error is not None and not isinstance(error, PeerError | RuntimeError | TimeoutError):
        raise error
    if error is not None:
        log.error("could not take the members' state (%s): the region trains on with its own", error)
    return start


def _hand_over(
    region: ShardedCollective, fetch: Callable[[], Fetched], load: Callable[[Any, int], None], timeout: float
) -> tuple[int | None, Exception | None]:
    """Local rank 0 fetches (``fetch`` loads the state there) and hands the state and the step to start at
    to the other ranks, which ``load`` it: that step on every rank, or None when the fetch failed, and on
    local rank 0 the fetch's error. An empty buffer tells the other ranks the fetch failed."""
    error: Exception | None = None
    payload: bytes | None = None
    if region.local_rank == 0:
        try:
            payload = encode_fetched(*fetch())
        except Exception as exc:  # the other ranks are told by the empty buffer; the caller decides
            error = exc
            payload = b""
    buf = region.broadcast_bytes(payload, timeout)
    if not buf:
        return None, error
    start, skeleton, tensors = decode_fetched(buf)
    if region.local_rank != 0:
        load(unflatten_state(skeleton, tensors), start)
    return start, error


def join_owned(region: ShardedCollective, admit: Callable[[], None], fetch: Callable[[], int], timeout: float) -> int:
    """Join as every local rank of an FSDP2 ``region`` (`ShardedCollective.own_shards`); the step the region
    starts at. Each rank holds shards no other rank has, so each takes its own from its ring (``fetch``:
    load them, return the step to start at) once every rank is admitted; the region starts at the latest
    of those steps, so its ranks stay in step with each other."""
    _together(region, admit, NOT_ADMITTED, timeout)
    start = _together(region, fetch, "another rank of the region could not fetch its shards' state", timeout)
    return region.max_int(start, timeout)


def _together(region: ShardedCollective, step: Callable[[], T], why: str, timeout: float) -> T:
    """Run ``step`` on this rank, then learn whether it succeeded on every rank of the region: its result, or
    on every rank an error (this rank's own, or RuntimeError(``why``) where another rank's step failed), so no
    rank goes on while another stopped."""
    try:
        result = step()
    except Exception:
        region.all_ok(False, timeout)  # the other ranks hear of it first
        raise
    if not region.all_ok(True, timeout):
        raise RuntimeError(why)
    return result


def resync_owned(
    region: ShardedCollective, ahead: tuple[str, ...], fetch: Callable[[tuple[str, ...]], int], timeout: float
) -> int | None:
    """Every rank of a running FSDP2 ``region`` takes its own shards' state from the members ahead on its own
    ring (``fetch(ahead)``: load it, return the step to start at); local rank 0's verdict names them
    (``ahead``, given there), each rank asks the same regions' ranks of its own ring. The step to start at,
    the latest any rank fetched, the same on every rank; None when no rank could fetch. A rank that could not
    trains on with its own state from there (its peer checks again). Called by every rank at the same step."""
    region.forget_verdict()
    names = region.broadcast_bytes(",".join(ahead).encode() if region.local_rank == 0 else None, timeout)
    regions = tuple(n for n in names.decode().split(",") if n)
    start = -1
    error: Exception | None = None
    try:
        start = fetch(tuple(rank_node_id(r, region.local_rank) for r in regions))
    except (PeerError, RuntimeError, TimeoutError) as exc:
        error = exc
        log.error("could not take the members' state for this rank's shards (%s): training on with its own", exc)
    latest = region.max_int(start if error is None else -1, timeout)
    return latest if latest >= 0 else None
