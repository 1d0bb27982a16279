"""Partition healing for the global (outer) state of DiLoCo, Streaming DiLoCo and CO2: a digest check every
few periods and, where the members' copies differ, one fp32 average that makes them bit-identical again.

DiLoCo (Douillard et al., arXiv 2311.08455), Streaming DiLoCo (arXiv 2501.18512) and CO2 (Sun et al., arXiv
2401.16265) each keep a global copy of the model and an outer momentum that only landed rounds change, so
every member holds them bit-identical as long as it took part in every round. A partition breaks that for
good: each side averages among itself and moves its own global copy, and after the heal the rounds average
pseudo-gradients or parameters relative to copies that stay apart.

The check is DreamDDP's (`dreamp2p.sync.strategies.outer`): beside a sync launched in every ``anchor_every``-th period
(decided from the launch step, so every member agrees without asking) a 17-element fp32 round carries a
flag and 16 bits of an xxh3 digest of the member's outer state; a bit's mean is exactly 0 or 1 only where
every member holds the same bit, so every member reads the same verdict. Where it says "differ", the key
(the whole model, or one fragment) joins the repair set, agreed memory that is checkpointed and travels to
joiners; where the sync lands, every member then runs a heal round: an fp32 average of its outer state
(global copy, momentum, and what else the strategy names), written back on every member alike, so the
copies become the mean of the sides' copies, bit-identical. A heal that fails leaves the key in the repair
set and is tried again at the key's next landing. The check costs 68 bytes per member (17 fp32) every
``anchor_every`` periods per key; the heal, 4 bytes per element of outer state, only after a mismatch.
"""

from __future__ import annotations

import concurrent.futures
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from dreamp2p.messages import RoundResult
from dreamp2p.sync.comm.collective import Collective
from dreamp2p.sync.model.layers import FlatGroup
from dreamp2p.sync.strategies.base import landed, settled
from dreamp2p.sync.strategies.outer import anchor_check_vector, anchor_verdict
from dreamp2p.sync.strategies.replicas import tensors_digest

log = logging.getLogger(__name__)

# `Strategy._wait`: a round's result, None where it failed (everywhere), within a timeout (None: the default)
Wait = Callable[[concurrent.futures.Future[RoundResult], float | None], RoundResult | None]


@dataclass
class CheckRound:
    """A check in flight: its (flag, digest bits) group, whose ``work`` receives the members' mean."""

    group: FlatGroup
    fut: concurrent.futures.Future[RoundResult]

    def record(self, timeout: float) -> torch.Tensor | None:
        """The averaged check vector for a checkpoint; None when the round failed (everywhere)."""
        return self.group.work.clone() if settled(self.fut, timeout) else None

    @classmethod
    def restore(cls, mean: torch.Tensor) -> CheckRound:
        """A check that already landed elsewhere, its mean restored from saved state."""
        group = FlatGroup([mean.clone()])
        group.work.copy_(mean)
        return cls(group, landed(group.numel))


class OuterCheck:
    """When to check, the check rounds, the repair set and the heal rounds of one strategy's outer state.

    ``check_group(key)`` and ``heal_group(key)`` give each key's round groups (a key is 0 for a whole-model
    strategy, the fragment index for Streaming DiLoCo); ``wait`` is the strategy's `Strategy._wait`, so these
    rounds count as its own (exposed time, skipped rounds).
    """

    def __init__(
        self,
        comm: Collective,
        period: int,
        every: int,
        check_group: Callable[[int], int],
        heal_group: Callable[[int], int],
        wait: Wait,
    ) -> None:
        self._comm = comm
        self._period = period
        self._every = every
        self._check_group = check_group
        self._heal_group = heal_group
        self._wait = wait
        self._repair: set[int] = set()  # keys a check found apart: their next landing heals (agreed memory)
        self.healed = 0  # heal rounds that completed here

    def due(self, step: int) -> bool:
        """Whether a sync launched at ``step`` carries a check (from the step alone: every member agrees)."""
        return (step // self._period) % self._every == 0

    def launch(self, key: int, tensors: Sequence[torch.Tensor], round_id: int) -> CheckRound:
        """Send the digest of ``tensors`` (this member's outer state of ``key``) in a 17-element fp32 round."""
        group = FlatGroup([anchor_check_vector(False, tensors_digest(tensors))])
        group.snapshot()
        fut = self._comm.allreduce_group(group, self._check_group(key), "fp32", round_id=round_id, guard_norm=False)
        return CheckRound(group, fut)

    def judge(self, key: int, check: CheckRound | None, timeout: float | None = None) -> None:
        """Wait for ``check`` (if any) and put ``key`` in the repair set where it found the members apart."""
        if check is None or self._wait(check.fut, timeout) is None:
            return  # no check, or it failed on every member: no verdict anywhere
        if anchor_verdict(check.group.work) != "agree":
            if key not in self._repair:
                log.warning("outer state %d differs between members (a partition?): averaging it at this landing", key)
            self._repair.add(key)

    def needs_heal(self, key: int) -> bool:
        return key in self._repair

    def heal(self, key: int, tensors: Sequence[torch.Tensor], round_id: int, timeout: float | None = None) -> bool:
        """Where ``key`` is in the repair set, set ``tensors`` to their mean over the members (fp32, in place,
        bit-identical everywhere); whether they were. A failed round keeps ``key`` for its next landing."""
        if key not in self._repair:
            return False
        group = FlatGroup(list(tensors))
        group.snapshot()
        fut = self._comm.allreduce_group(group, self._heal_group(key), "fp32", round_id=round_id)
        if self._wait(fut, timeout) is None:
            log.warning("outer state %d: the averaging round failed; trying again at its next landing", key)
            return False
        group.write(group.work)
        self._repair.discard(key)
        self.healed += 1
        log.warning("outer state %d: reset to the members' mean; the replicas' global copies agree again", key)
        return True

    def state(self) -> dict[str, Any]:
        return {"repair": sorted(self._repair), "healed": self.healed}

    def load(self, state: dict[str, Any] | None) -> None:
        """From :meth:`state` (None, from a checkpoint that predates checks: nothing to repair)."""
        state = state or {}
        self._repair = {int(k) for k in state.get("repair", [])}
        self.healed = int(state.get("healed", 0))
