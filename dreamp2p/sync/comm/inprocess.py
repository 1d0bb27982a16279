"""An in-memory :class:`~dreamp2p.sync.comm.collective.Collective`: N members in one process, no network.

For unit tests of a strategy's own logic (what it averages when, what it merges, what it checkpoints),
and for anyone who writes a strategy. Each member runs on its own thread, as a node's trainer would;
a round completes when every member has contributed to the same (group id, round id), with the mean
computed once, in member order, and passed through the round's codec once, so every member gets
bit-identical values as from the real ring. Rounds are all-or-none like the real ones: ``fail``
makes chosen rounds raise RoundFailed on every member. Each member's contributions pass the peer's own
contribution guard (`dreamp2p.peer.guard`): non-finite values always, and norm jumps when the hub is made
with ``max_norm_ratio``; refused ones are left out of the mean (a round with none left fails everywhere).
Nothing here is for production traffic.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

from dreamp2p.compression import Codec, get_codec
from dreamp2p.errors import RoundFailed
from dreamp2p.messages import LinkSnapshot, RingCodecPlan, RoundResult, TrainingInfo
from dreamp2p.peer.guard import ContributionGuard
from dreamp2p.sync.model.layers import FlatGroup


@dataclass(frozen=True)
class RoundRecord:
    """One completed (or failed) round, as the hub saw it: what tests assert on."""

    group_id: int
    round_id: int
    codec: str
    elements: int
    failed: bool
    error_feedback: bool = False
    contributors: int = 0  # members whose values entered the mean (the others' were refused by their guard)


@dataclass
class _Contribution:
    values: torch.Tensor
    out: torch.Tensor
    future: concurrent.futures.Future[RoundResult]
    refused: bool


class InProcessHub:
    """The shared meeting point of ``world`` in-process members (``hub.member(i)`` is member i's handle)."""

    def __init__(
        self,
        world: int,
        round_timeout_s: float = 10.0,
        goodput_Bps: float = 10e6,
        rtt_s: float = 0.01,
        max_norm_ratio: float = 0.0,
    ) -> None:
        if world < 1:
            raise ValueError(f"world must be >= 1, got {world}")
        self.node_ids = tuple(f"m{i}" for i in range(world))
        self.round_timeout_s = round_timeout_s
        self.goodput_Bps = goodput_Bps
        self.rtt_s = rtt_s
        self.rounds: list[RoundRecord] = []
        self._lock = threading.Lock()
        self._pending: dict[tuple[int, int], dict[int, _Contribution]] = {}
        self._fail: Callable[[int, int], bool] = lambda group_id, round_id: False
        # error feedback, emulated on the hub's one encode of the mean: what it lost, per group
        self._residuals: dict[int | tuple[int, int], torch.Tensor] = {}  # by group; gathered: by (group, rank)
        self._max_norm_ratio = max_norm_ratio
        self._guards = [ContributionGuard(max_norm_ratio) for _ in range(world)]
        self._members = [InProcessCollective(self, i) for i in range(world)]

    def member(self, rank: int) -> InProcessCollective:
        return self._members[rank]

    def fail(self, predicate: Callable[[int, int], bool]) -> None:
        """Make every round for which ``predicate(group_id, round_id)`` holds fail on every member."""
        self._fail = predicate

    def restart_guard(self, rank: int) -> None:
        """Give member ``rank`` a guard with no history, as a restarted or newly joined peer has."""
        self._guards[rank] = ContributionGuard(self._max_norm_ratio)

    def training_steps(self) -> list[int | None]:
        """Each member's last published step (None before its first)."""
        return [m.training.step if m.training is not None else None for m in self._members]

    def contribute(
        self,
        rank: int,
        key: tuple[int, int],
        values: torch.Tensor,
        out: torch.Tensor,
        codec: str,
        error_feedback: bool = False,
        guard_norm: bool = True,
    ) -> concurrent.futures.Future[RoundResult]:
        future: concurrent.futures.Future[RoundResult] = concurrent.futures.Future()
        with self._lock:
            round_ = self._pending.setdefault(key, {})
            if rank in round_:
                raise RuntimeError(f"member {rank} contributed twice to round {key}")
            refused = self._guards[rank].check(key[0], values, guard_norm) is not None
            round_[rank] = _Contribution(values, out, future, refused)
            if len(round_) < len(self.node_ids):
                return future
            del self._pending[key]
            failed = self._fail(*key)
            accepted = sum(not c.refused for c in round_.values())
            self.rounds.append(RoundRecord(key[0], key[1], codec, values.numel(), failed, error_feedback, accepted))
        self._complete(key, round_, codec, failed, error_feedback)
        return future

    def _complete(
        self, key: tuple[int, int], round_: dict[int, _Contribution], codec: str, failed: bool, feedback: bool
    ) -> None:
        contributions = [round_[r] for r in sorted(round_)]
        # refused at their source by the member's guard: the mean is over the others, and a round where
        # every contribution was refused fails on every member
        finite = [c for c in contributions if not c.refused]
        if failed or not finite:
            why = "injected by the in-process hub" if failed else "every contribution was refused by its guard"
            for c in contributions:
                c.future.set_exception(RoundFailed(key, why))
            return
        cod = get_codec(codec)
        world = len(contributions)
        if cod.sparse and world > 1:
            # gathered, as `collective.gather` does: each contribution encoded once, decoded, summed in order
            mean = self._gathered_mean(key[0], round_, cod, feedback)
            wire = cod.encoded_nbytes(mean.numel()) * (world - 1)
            self._finish(key, contributions, codec, mean, wire, len(finite))
            return
        total = torch.zeros_like(contributions[0].values)
        for c in finite:
            total += c.values
        mean = total / len(finite)
        if not cod.lossless:
            carried = self._residuals.get(key[0]) if feedback else None
            sent = mean + carried if carried is not None and carried.shape == mean.shape else mean
            mean = cod.decode(cod.encode(sent), mean.numel())
            if feedback:
                self._residuals[key[0]] = sent - mean
        wire = cod.encoded_nbytes(mean.numel()) * 2 * (world - 1) // max(world, 1)
        self._finish(key, contributions, codec, mean, wire, len(finite))

    def _gathered_mean(
        self, group_id: int, round_: dict[int, _Contribution], cod: Codec, feedback: bool
    ) -> torch.Tensor:
        total = torch.zeros_like(next(iter(round_.values())).values)
        for rank in sorted(round_):
            c = round_[rank]
            if c.refused:
                continue
            carried = self._residuals.get((group_id, rank)) if feedback else None
            sent = c.values + carried if carried is not None and carried.shape == c.values.shape else c.values
            decoded = cod.decode(cod.encode(sent), sent.numel())
            if feedback:
                self._residuals[(group_id, rank)] = sent - decoded
            total += decoded
        return total / sum(not c.refused for c in round_.values())

    def _finish(
        self,
        key: tuple[int, int],
        contributions: list[_Contribution],
        codec: str,
        mean: torch.Tensor,
        wire: int,
        accepted: int,
    ) -> None:
        world = len(contributions)
        # the time the round would take on the hub's links: 2(N-1) ring steps of half an RTT each, plus its bytes
        seconds = (world - 1) * self.rtt_s + wire / self.goodput_Bps if world > 1 else 0.0
        for c in contributions:
            c.out.copy_(mean)
            c.future.set_result(
                RoundResult(
                    key[0], key[1], seconds, wire, wire, mean.numel(), codec, 0, accepted, members=self.node_ids
                )
            )


class InProcessCollective:
    """Member ``rank``'s handle: the Collective a strategy gets in place of a CommThread."""

    def __init__(self, hub: InProcessHub, rank: int) -> None:
        self._hub = hub
        self._rank = rank
        self._counters: dict[int, int] = {}
        self.training: TrainingInfo | None = None

    @property
    def node_id(self) -> str:
        return self._hub.node_ids[self._rank]

    @property
    def members(self) -> tuple[str, ...]:
        return self._hub.node_ids

    @property
    def world(self) -> int:
        return len(self._hub.node_ids)

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def round_timeout_s(self) -> float:
        return self._hub.round_timeout_s

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
        if round_id is None:  # like the peer: rounds without an id count per group
            round_id = self._counters.get(group_id, 0)
            self._counters[group_id] = round_id + 1
        name = codec.gather if isinstance(codec, RingCodecPlan) else (codec or "fp32")
        return self._hub.contribute(
            self._rank, (group_id, round_id), source.clone(), group.work, name, error_feedback, guard_norm
        )

    def links(self) -> list[LinkSnapshot]:
        return [
            LinkSnapshot(node, self._hub.rtt_s, self._hub.goodput_Bps, 0, 0, 1, 0)
            for node in self._hub.node_ids
            if node != self.node_id
        ]

    def set_training_info(self, info: TrainingInfo) -> None:
        self.training = info

    @property
    def diverged_from(self) -> tuple[str, ...]:
        return ()  # one process, no partitions: every member always holds the same plan

    @property
    def leading_step(self) -> int:
        return max((s for s in self._hub.training_steps() if s is not None), default=0)
