"""A ring of one for `bench memory`: each round as the peer runs it alone, so its memory is the peer's.

The peer copies a round's source into one flat fp32 buffer (`dreamp2p.peer.roundrun`), runs the ring over it
(a ring of one sends nothing and encodes nothing) and copies the result into ``work``: the round holds that
copy, 4 bytes per element, while it runs. This collective does the same, before `allreduce_group` returns,
and remembers the largest round it ran. Nothing else of the peer (links, control, state transfer) is here.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable

from dreamp2p.messages import LinkSnapshot, RingCodecPlan, RoundResult, TrainingInfo
from dreamp2p.sync.model.layers import FlatGroup


class SoloCollective:
    """The Collective of a member alone in its ring."""

    node_id = "solo"
    members = ("solo",)
    world = 1
    rank = 0
    round_timeout_s = 60.0
    diverged_from: tuple[str, ...] = ()
    leading_step = 0

    def __init__(self) -> None:
        self.largest = 0  # elements of the largest round run
        self.rounds = 0
        self.training: TrainingInfo | None = None

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
        group.ready()
        source = group.snap
        if prepare is not None:
            prepare()
            source = group.work
        flat = source.clone()  # the round's own flat copy, as the peer's
        group.work.copy_(flat)
        self.largest = max(self.largest, flat.numel())
        self.rounds += 1
        name = codec.gather if isinstance(codec, RingCodecPlan) else (codec or "fp32")
        fut: concurrent.futures.Future[RoundResult] = concurrent.futures.Future()
        fut.set_result(RoundResult(group_id, round_id or 0, 0.0, 0, 0, flat.numel(), name, 0, 1, members=self.members))
        return fut

    def links(self) -> list[LinkSnapshot]:
        return []

    def set_training_info(self, info: TrainingInfo) -> None:
        self.training = info
