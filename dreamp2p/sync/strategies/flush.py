"""`Strategy.flush`'s rounds: every parameter and buffer made bit-identical on every member, checked first.

Two parts, each checked first with a round of 64 digest bits (`dreamp2p.sync.strategies.replicas`): the
trainable parameters (unless the strategy already made them identical through its compressed path), then
frozen parameters and buffers. A part every member already holds alike sends nothing more; the others are
averaged in fp32, a failed average tried again, since a flush promises identical replicas and so cannot
skip a round as training does.
"""

from __future__ import annotations

import concurrent.futures
import logging
from collections.abc import Callable, Iterable

import torch
from torch import nn

from dreamp2p.errors import FlushIncomplete, RoundFailed
from dreamp2p.messages import RoundResult
from dreamp2p.sync.comm.collective import Collective
from dreamp2p.sync.model.groups import GROUP_FLUSH, GROUP_FLUSH_CHECK
from dreamp2p.sync.model.layers import FlatGroup
from dreamp2p.sync.strategies.buffers import frozen_parameters, model_buffers
from dreamp2p.sync.strategies.replicas import agreement_group, bits_agree

log = logging.getLogger(__name__)

# flush() tries this many rounds before it gives up (it promises identical replicas, so it cannot skip)
FLUSH_ATTEMPTS = 3
# round ids one flush reserves per group: an average of each of its two parts, with its attempts
FLUSH_IDS = 2 * FLUSH_ATTEMPTS

# `Strategy._wait` at its default timeout: a round's result, None where it failed (everywhere)
Wait = Callable[[concurrent.futures.Future[RoundResult]], RoundResult | None]
# `Strategy._flush_params`: the trainable parameters made identical by the strategy's own path, or None
Compressed = Callable[[int], RoundResult | None]


class ReplicaFlush:
    """The flush rounds of one strategy; ``wait`` is the strategy's `Strategy._wait`, so they count as its own
    (exposed time, skipped rounds, the members its newest round ran among)."""

    def __init__(self, comm: Collective, model: nn.Module, pin: bool, wait: Wait) -> None:
        self._comm = comm
        self._model = model
        self._pin = pin
        self._wait = wait
        self._newest_round = 0  # the id of the newest flush round

    def run(self, step: int, codec: str, expected: Iterable[str], compressed: Compressed) -> str:
        """Flush at ``step``, averaging in ``codec``; FlushIncomplete when it completed among fewer members
        than ``expected`` (those kept their own state). Returns how the trainable parameters became identical:
        "compressed" (the strategy's own path, which DreamDDP takes only where every member's outer weights
        agreed), "agreed" (they already were) or "averaged" (in ``codec``)."""
        # Round ids from the step, as every other round's: a member that joined refuses rounds numbered
        # before its first step, and ids counted from 1 were (whenever a frame beat its own round open).
        # Every member flushes at the same step, the same number of times, so the ids agree.
        first = max(self._newest_round + 1, (step + 1) * FLUSH_IDS)
        self._newest_round = first + FLUSH_IDS - 1
        done = compressed(first)
        rest: list[torch.Tensor] = [*frozen_parameters(self._model), *model_buffers(self._model)]
        trainable: list[torch.Tensor] = [p for p in self._model.parameters() if p.requires_grad]
        parts = [rest] if done is not None else [trainable, rest]
        last = done
        path = "compressed" if done is not None else "agreed"
        for k, tensors in enumerate(part for part in parts if part):
            agree, res = self._check(tensors, first + k)
            if not agree:
                res = self._average(tensors, codec, first + k * FLUSH_ATTEMPTS)
                if tensors is trainable:
                    path = "averaged"
            last = res or last
        averaged = last.members if last is not None and last.members else tuple(self._comm.members)
        missing = tuple(sorted(set(expected) - set(averaged)))
        if missing:
            raise FlushIncomplete(averaged, missing)
        return path

    def _check(self, tensors: list[torch.Tensor], round_id: int) -> tuple[bool, RoundResult | None]:
        """Whether every member holds ``tensors`` bit-identical already (a failed check says no)."""
        group = agreement_group(tensors)
        res = self._wait(
            self._comm.allreduce_group(group, GROUP_FLUSH_CHECK, "fp32", round_id=round_id, guard_norm=False)
        )
        return (res is not None and bits_agree(group.work)), res

    def _average(self, tensors: list[torch.Tensor], codec: str, first: int) -> RoundResult:
        """Average ``tensors`` in ``codec``, tried up to FLUSH_ATTEMPTS times."""
        group = FlatGroup(tensors, pin=self._pin)
        for attempt in range(FLUSH_ATTEMPTS):
            group.snapshot()
            fut = self._comm.allreduce_group(group, GROUP_FLUSH, codec, round_id=first + attempt)
            res = self._wait(fut)
            if res is not None:
                group.merge()
                return res
            log.warning("flush: round %d of %d failed; trying again", attempt + 1, FLUSH_ATTEMPTS)
        raise RoundFailed(None, f"flush: no averaging round completed in {FLUSH_ATTEMPTS} attempts")
