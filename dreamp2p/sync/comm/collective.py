"""What a strategy needs from the network, as a Protocol: averaging rounds, the members, the links.

Strategies talk only to this interface. Two classes implement it for real runs: `dreamp2p.sync.comm.thread.CommThread`
(a gRPC peer on its own event loop, in the trainer's process) and `dreamp2p.sync.comm.process.CommProcess`
(``[node] comm = "process"``: the same peer in a child process of its own, off the trainer's GIL).
`dreamp2p.sync.comm.inprocess` implements it in memory so that a strategy's logic (what it averages when, what
it merges, what it checkpoints) is tested in one process in milliseconds. Every call is made from the training thread.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from typing import Protocol

from dreamp2p.messages import LinkSnapshot, RingCodecPlan, RoundResult, TrainingInfo
from dreamp2p.sync.model.layers import FlatGroup


class Collective(Protocol):
    """One member's handle on the cluster's averaging rounds."""

    @property
    def node_id(self) -> str: ...

    @property
    def members(self) -> tuple[str, ...]:
        """The members alive now, in ring order (the ring the next round runs among)."""
        ...

    @property
    def world(self) -> int: ...

    @property
    def rank(self) -> int: ...

    @property
    def round_timeout_s(self) -> float:
        """How long one round may run before it fails on every member."""
        ...

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
        """Average ``group.snap`` (or ``group.work`` filled by ``prepare``) into ``group.work``.

        The round is all-or-none across the members: the future raises RoundFailed on every member or
        completes on every member with bit-identical ``work``. ``error_feedback``: carry what a lossy
        codec lost into this group id's next round (increments only, e.g. pseudo-gradients).
        """
        ...

    def links(self) -> list[LinkSnapshot]:
        """Measured goodput and RTT of our link to each other member."""
        ...

    def set_training_info(self, info: TrainingInfo) -> None:
        """Publish our strategy, step and plan version for the other members to read."""
        ...

    @property
    def diverged_from(self) -> tuple[str, ...]:
        """Live members training with a plan we missed (see `dreamp2p.peer.drift`); empty normally."""
        ...

    @property
    def leading_step(self) -> int:
        """The highest step a live member last reported (0 before any did): the cluster's step clock for
        time-paced periods (`dreamp2p.sync.strategies.pacing`)."""
        ...
