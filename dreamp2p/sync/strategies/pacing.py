"""Time-paced periods (``sync.periods = "time"``): a member follows the cluster's step clock, and the merge weighs
each member's pseudo-gradient by the local steps it took.

In lockstep every member takes ``period`` local steps per period, so a cluster runs at its slowest member's
pace and the fast ones idle at every rendezvous. Paced by time, the cluster's step clock is its fastest
member's: after each of its own steps, a member moves its step counter up to the highest step its live
peers report (`Strategy._follow`), running what is due at each step it passes (launches and landings of
rounds) without a local update. A slow member thus takes fewer local steps per period and still meets the
others at the same round ids, so plans, rounds and outer steps stay the same everywhere.

Its pseudo-gradient then holds less training, so the outer merge weighs it by tokens, as Decoupled DiLoCo
(Douillard et al., 2026) merges learners of different speeds: each member's share ``w`` is the fraction of
the last ``period`` steps of the clock (the window one pseudo-gradient covers) at which it trained. Every
member sends ``w * g`` in its pseudo-gradient round and ``w`` in a one-element round beside it, and divides
the first mean by the second: ``sum(w_i g_i) / sum(w_i)``. Every member divides the same two means, so the
replicas stay bit-identical. With equal paces every ``w`` is 1 and the merge is the plain mean.
"""

from __future__ import annotations

import collections
import concurrent.futures
from collections.abc import Sequence

import torch

from dreamp2p.messages import RoundResult
from dreamp2p.sync.comm.collective import Collective
from dreamp2p.sync.model.groups import GROUP_TOKENS
from dreamp2p.sync.model.layers import FlatGroup


class StepWindow:
    """Whether this member trained at each of the clock's last ``period`` steps (pure)."""

    def __init__(self, period: int, marks: Sequence[bool] = ()) -> None:
        if period < 1:
            raise ValueError(f"period must be >= 1, got {period}")
        self._marks: collections.deque[bool] = collections.deque(marks, maxlen=period)

    def record(self, trained: bool) -> None:
        """The clock passed one step: ``trained`` if this member took a local step at it."""
        self._marks.append(trained)

    def share(self) -> float:
        """The fraction of the window's steps this member trained at: its pseudo-gradient's weight in (0, 1].

        Steps before the window filled (the run's first period) count as trained: every member started
        from the same parameters then, and a pseudo-gradient measured from them holds all the training done.
        """
        period = self._marks.maxlen or 1
        missed = sum(not m for m in self._marks)
        return (period - missed) / period

    def marks(self) -> list[bool]:
        """The window, oldest first (saved with the strategy's state: a joiner's parameters carry its donor's)."""
        return list(self._marks)


def share_round(
    comm: Collective, group: FlatGroup, share: float, round_id: int
) -> concurrent.futures.Future[RoundResult]:
    """Average ``share`` among the members in fp32 through the one-element ``group``, under ``round_id``."""
    group.snap.fill_(share)
    # a share is a count, not an update: the norm guard's history of updates does not apply
    return comm.allreduce_group(group, GROUP_TOKENS, "fp32", round_id=round_id, guard_norm=False)


class TokenShares:
    """The one-element rounds that carry each member's share beside its pseudo-gradients, one buffer per slot
    (a fragment): a slot's buffer holds its mean until the slot's pseudo-gradient lands."""

    def __init__(self, comm: Collective, slots: int) -> None:
        self._comm = comm
        self._groups = [FlatGroup([torch.zeros(1)]) for _ in range(slots)]

    def launch(self, slot: int, share: float, round_id: int) -> concurrent.futures.Future[RoundResult]:
        """Average ``share`` among the members in fp32, under the launch's round id."""
        return share_round(self._comm, self._groups[slot], share, round_id)

    def mean(self, slot: int) -> float:
        """The landed mean share of ``slot``'s round (valid once its future completed)."""
        return float(self._groups[slot].work[0])


class Shares:
    """One shares' round in flight: its one-element buffer receives the members' mean share."""

    def __init__(self, group: FlatGroup, fut: concurrent.futures.Future[RoundResult]) -> None:
        self.group = group
        self.fut = fut

    def mean(self) -> float:
        """The landed mean share (valid once :attr:`fut` completed)."""
        return float(self.group.work[0])


class StepShares:
    """DreamDDP's shares' rounds: one per launch step, beside every pseudo-gradient sync launched at that step
    (they all cover the same window of the clock), each in a buffer of its own that lives as long as a sync
    launched with it travels (syncs of several steps travel at once)."""

    def __init__(self, comm: Collective, window: StepWindow) -> None:
        self._comm = comm
        self._window = window
        self._current: tuple[int, float, Shares] | None = None  # (round id, share, its round)

    def launch(self, round_id: int) -> tuple[float, Shares]:
        """This member's share of the window and the shares' round of ``round_id``, launched on first use."""
        if self._current is None or self._current[0] != round_id:
            share = self._window.share()
            group = FlatGroup([torch.zeros(1)])
            self._current = (round_id, share, Shares(group, share_round(self._comm, group, share, round_id)))
        return self._current[1], self._current[2]


def unweigh(mean: torch.Tensor, mean_share: float) -> bool:
    """Turn the landed mean of ``w * g`` into the token-weighted mean ``sum(w g) / sum(w)``, in place; False
    where no member trained (a mean share of 0: nothing to merge)."""
    if not mean_share > 0.0:
        return False
    mean.div_(mean_share)
    return True
