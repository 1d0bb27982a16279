"""What every replica must hold alike, and how members learn whether they do: the state's tensors, a digest
of them, the 64-bit agreement round, and rank 0's broadcast for replicas that differ.

An agreement round costs 64 floats per member whatever the model's size: members that already share their
state (seeded alike, resumed from one checkpoint, just flushed) skip the transfer it would otherwise take.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch
import xxhash
from torch import nn

from dreamp2p.errors import RoundFailed
from dreamp2p.sync.comm.collective import Collective
from dreamp2p.sync.model.groups import GROUP_AGREE, GROUP_INIT
from dreamp2p.sync.model.layers import FlatGroup
from dreamp2p.sync.model.shardlocal import local_view
from dreamp2p.sync.strategies.buffers import frozen_parameters, model_buffers

log = logging.getLogger(__name__)


def state_tensors(model: nn.Module) -> list[torch.Tensor]:
    """Everything a replica must share: trainable parameters, frozen ones, and buffers."""
    tensors: list[torch.Tensor] = [p for p in model.parameters() if p.requires_grad]
    return tensors + frozen_parameters(model) + model_buffers(model)


def broadcast_state(comm: Collective, model: nn.Module, timeout: float) -> None:
    """Make every replica hold rank 0's parameters, frozen ones included, and buffers (bit-identical).

    Replicas that already agree (every member seeded its model alike, or resumed from one checkpoint) need
    no copy of rank 0's: a round of 64 digest bits (`states_agree`) says so, and the model's bytes stay home.
    """
    tensors = state_tensors(model)
    if len(comm.members) == 1 or not tensors:
        return
    if states_agree(comm, tensors, timeout):
        log.info("attach: every member holds the same state already; no broadcast")
        return
    broadcast_tensors(comm, tensors, timeout)


def tensors_digest(tensors: Iterable[torch.Tensor]) -> int:
    """64 bits of xxh3 over the tensors' bytes, in order (equal digests: bit-identical tensors, but for
    a collision no replica can arrange); a CPU tensor's memory is hashed in place, not copied; a DTensor's
    local shard only (FSDP2: each rank compares what it owns)."""
    h = xxhash.xxh3_64()
    for t in tensors:
        h.update(local_view(t).detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().data)
    return h.intdigest()


def agreement_group(tensors: Iterable[torch.Tensor]) -> FlatGroup:
    """This member's contribution to an agreement round over ``tensors``: its digest's bits, snapshotted;
    after the round, `bits_agree` on the group's ``work`` says whether every member sent the same."""
    group = FlatGroup([digest_bits(tensors_digest(tensors))])
    group.snapshot()
    return group


def states_agree(comm: Collective, tensors: list[torch.Tensor], timeout: float) -> bool:
    """Whether every member holds bit-identical ``tensors``: one round of 64 floats, the same answer everywhere.

    Each member sends its digest's bits as 0.0/1.0; a bit's mean is exactly 0 or 1 only where every member
    holds the same bit, so any fraction means some replica differs (the anchors' check, `sync.strategies.outer`, on a
    whole digest). A failed round answers False: the caller then does the full transfer.
    """
    group = agreement_group(tensors)
    try:
        comm.allreduce_group(group, GROUP_AGREE, "fp32", guard_norm=False).result(timeout)
    except RoundFailed:
        return False
    return bits_agree(group.work)


def digest_bits(digest: int) -> torch.Tensor:
    """A 64-bit digest as 64 floats of 0.0 or 1.0: one member's contribution to an agreement round."""
    return torch.tensor([float((digest >> i) & 1) for i in range(64)], dtype=torch.float32)


def bits_agree(mean: torch.Tensor) -> bool:
    """From the members' averaged `digest_bits`: whether every member sent the same digest."""
    return not bool(((mean > 0) & (mean < 1)).any())


def broadcast_tensors(comm: Collective, tensors: list[torch.Tensor], timeout: float) -> None:
    """Make every replica hold rank 0's values of ``tensors`` (bit-identical on all peers afterwards)."""
    members = comm.members  # read once: the view may change on the comm thread meanwhile
    if len(members) == 1 or not tensors:
        return
    group = FlatGroup(tensors)
    group.snapshot()
    # rank 0 contributes N x its values, the others zero: the mean is rank 0's values on every peer
    group.snap.mul_(float(len(members)) if members.index(comm.node_id) == 0 else 0.0)
    comm.allreduce_group(group, GROUP_INIT, "fp32", guard_norm=False).result(timeout)
    group.write(group.work)
