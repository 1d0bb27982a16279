"""The round registry: which rounds are open on this peer, who they run among, and frames waiting for one.

Frames may arrive before this peer opened their round (a faster member already started it); they wait
here, bounded in number and in time, and are handed the round when it opens. Ids of closed rounds are
remembered so late or replayed frames are refused as stale instead of opening a round again, and frames
still waiting for a round this peer has gone past are refused as soon as it has. Runs on the
peer's event loop only.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from dreamp2p.collective.ring import RingRound
from dreamp2p.errors import PeerError, Status
from dreamp2p.messages import Frame

Key = tuple[int, int]  # (group id, round id)

# How far ahead of our newest round of a group a peer may send (it may be ahead of us); beyond: refused.
# Not applied to a group this peer has not used yet (a restarted peer joins at the others' round ids).
MAX_ROUNDS_AHEAD = 1 << 16
# How many rounds may be waited on before they open here (bounds memory a sender can make us hold).
MAX_PENDING_ROUNDS = 256
# Of those, how many one sender's frames may wait for at once, so no sender can use up the others' share.
MAX_PENDING_ROUNDS_PER_SENDER = 32
# Closed round ids remembered per group before the oldest are forgotten (older ids are stale anyway).
MAX_CLOSED_IDS = 1024
# Failed rounds whose reasons are kept for status and tests (the newest; older ones are dropped).
MAX_FAILURE_RECORDS = 64
# Rounds that completed here, remembered so a member that gave one up after voting commit learns on its
# retry that the round completed (the newest; a retry comes within a heartbeat or two).
MAX_COMPLETED_RECORDS = 1024
# A failed round is retried under its group id with this bit set (same round id), see RoundRunner.allreduce.
RETRY_GROUP_BIT = 1 << 31


@dataclass(frozen=True)
class RoundFailure:
    """Why one of our rounds failed: ``deadline`` when it ran out of time rather than being given up."""

    key: Key
    reason: str
    deadline: bool


@dataclass(frozen=True)
class RegistrySnapshot:
    """A read-only view of the registry, for status and tests."""

    open_rounds: frozenset[Key]
    next_round: dict[int, int]
    closed: dict[int, frozenset[int]]
    pending: int  # rounds frames are waiting for, plus frames waiting
    frames_waiting: int = 0  # frames waiting for a round to open here


class RoundRegistry:
    def __init__(self, round_timeout_s: float) -> None:
        self.round_timeout_s = round_timeout_s
        # a joiner refuses rounds from before the step it starts at (see admit_from)
        self._min_round_id = 0
        self._open: dict[Key, RingRound] = {}
        self._members: dict[Key, frozenset[str]] = {}
        self._waiters: dict[Key, asyncio.Future[RingRound]] = {}
        self._waiter_refs: dict[Key, int] = {}
        self._sender_refs: dict[tuple[str, Key], int] = {}  # frames of one sender waiting for one round
        self._sender_rounds: dict[str, int] = {}  # rounds each sender has frames waiting for
        self._next: dict[int, int] = {}
        self._closed: dict[int, set[int]] = {}
        # why our recent rounds failed, oldest first: a member that left, a failed vote, or the deadline
        self.failures: deque[RoundFailure] = deque(maxlen=MAX_FAILURE_RECORDS)
        self._completed: dict[Key, None] = {}  # an ordered set, oldest first: looked up per retry frame
        # told the round id of each frame that waits for a round not open here yet: a member launched it
        # before us (time-paced periods follow it, see `dreamp2p.peer.drift.LeadingStep`)
        self.on_early: Callable[[int], None] | None = None

    def claim(self, group_id: int, round_id: int | None) -> int:
        """The id of our next round of ``group_id`` (``round_id`` when given, which must be newer)."""
        newest = self._next.get(group_id, 0)
        if round_id is None:
            round_id = newest + 1
        elif round_id <= newest:
            raise ValueError(f"round {round_id} of group {group_id} is not after this peer's newest round {newest}")
        self._next[group_id] = round_id
        return round_id

    def open(self, key: Key, rnd: RingRound, members: Iterable[str]) -> None:
        """Register ``rnd`` as open among ``members``; frames that waited for it get it now."""
        self._open[key] = rnd
        self._members[key] = frozenset(members)
        waiter = self._waiters.pop(key, None)
        if waiter is not None and not waiter.done():
            waiter.set_result(rnd)
        self._expire_waiters()

    def get(self, key: Key) -> RingRound | None:
        return self._open.get(key)

    def members_of(self, key: Key) -> frozenset[str]:
        return self._members.get(key, frozenset())

    def close(self, key: Key) -> None:
        """Forget an open round (done or failed): frames still waiting for it are told it was abandoned."""
        self._open.pop(key, None)
        self._members.pop(key, None)
        waiter = self._waiters.pop(key, None)
        if waiter is not None and not waiter.done():
            waiter.set_exception(PeerError(Status.STALE_ROUND, f"round {key} was abandoned here"))
        closed = self._closed.setdefault(key[0], set())
        closed.add(key[1])
        if len(closed) > MAX_CLOSED_IDS:
            # ids at or below our newest round are refused as stale anyway; keep the set small
            for rid in sorted(closed)[: -MAX_CLOSED_IDS // 2]:
                closed.discard(rid)
        self._expire_waiters()

    def note_failure(self, key: Key, reason: str, *, deadline: bool) -> None:
        """Record why round ``key`` failed here (see `failures`)."""
        self.failures.append(RoundFailure(key, reason, deadline))

    def note_completion(self, key: Key) -> None:
        """Record that round ``key`` (a first run, never a retry: that may run among fewer members)
        completed here: a retry of it is refused with ROUND_COMPLETED, which tells a member that gave the
        round up after voting commit to apply it too."""
        self._completed[key] = None
        if len(self._completed) > MAX_COMPLETED_RECORDS:
            del self._completed[next(iter(self._completed))]

    async def round_for(self, frame: Frame, check: Callable[[Frame], None] | None = None) -> RingRound:
        """The open round ``frame`` belongs to, waiting (bounded) for it to open; PeerError when it cannot.

        ``check`` vets a frame that would wait (see `collective.framecheck`): it raises to refuse it at once.
        """
        key = (frame.group_id, frame.round_id)
        rnd = self._open.get(key)
        if rnd is not None:
            return rnd
        stale = self._stale(key)
        if stale is not None:
            raise stale
        newest = self._next.get(frame.group_id, 0)
        if newest and frame.round_id > newest + MAX_ROUNDS_AHEAD:
            raise PeerError(
                Status.BAD_FRAME, f"round {frame.round_id} is more than {MAX_ROUNDS_AHEAD} ahead of {newest}"
            )
        if check is not None:
            check(frame)
        if self.on_early is not None and newest:
            # only for a group we ran rounds of: those number rounds by step (a first flush's ids do not)
            self.on_early(frame.round_id)
        mine = (frame.sender, key)
        if mine not in self._sender_refs and self._sender_rounds.get(frame.sender, 0) >= MAX_PENDING_ROUNDS_PER_SENDER:
            raise PeerError(
                Status.OVERSIZE,
                f"sender {frame.sender!r} already has frames waiting for {MAX_PENDING_ROUNDS_PER_SENDER} rounds "
                "that have not opened here",
            )
        fut = self._waiters.get(key)
        if fut is None:
            if len(self._waiters) >= MAX_PENDING_ROUNDS:
                raise PeerError(Status.OVERSIZE, "too many rounds pending")
            fut = self._waiters[key] = asyncio.get_running_loop().create_future()
        self._waiter_refs[key] = self._waiter_refs.get(key, 0) + 1
        self._hold(mine, +1)
        try:
            return await asyncio.wait_for(asyncio.shield(fut), self.round_timeout_s)
        except TimeoutError:
            raise PeerError(Status.TIMEOUT, f"round {key} did not open here in time") from None
        finally:
            self._hold(mine, -1)
            # the last stream to give up on a round that never opened forgets it
            self._waiter_refs[key] -= 1
            if not self._waiter_refs[key]:
                del self._waiter_refs[key]
                if self._waiters.get(key) is fut:
                    del self._waiters[key]

    def _hold(self, mine: tuple[str, Key], delta: int) -> None:
        """Count one more (or one fewer) frame of a sender waiting for a round; track its rounds waited for."""
        sender = mine[0]
        refs = self._sender_refs.get(mine, 0) + delta
        if refs:
            if delta > 0 and refs == 1:
                self._sender_rounds[sender] = self._sender_rounds.get(sender, 0) + 1
            self._sender_refs[mine] = refs
            return
        del self._sender_refs[mine]
        left = self._sender_rounds[sender] - 1
        if left:
            self._sender_rounds[sender] = left
        else:
            del self._sender_rounds[sender]

    def _stale(self, key: Key) -> PeerError | None:
        """Why round ``key``, not open here, never will be (a frame of it is stale); None if it still may."""
        group_id, round_id = key
        base = (group_id & ~RETRY_GROUP_BIT, round_id)
        if group_id & RETRY_GROUP_BIT and base in self._completed:
            return PeerError(
                Status.ROUND_COMPLETED, f"round {round_id} of group {base[0]} completed here: it is not retried"
            )
        if (
            round_id == 0
            or round_id < self._min_round_id
            or round_id in self._closed.get(group_id, ())
            or round_id <= self._next.get(group_id, 0)
        ):
            return PeerError(Status.STALE_ROUND, f"round {round_id} of group {group_id} is not open here")
        if self._never_retried(group_id, round_id):
            return PeerError(Status.STALE_ROUND, f"round {round_id} was not retried here: it did not fail here")
        return None

    def _expire_waiters(self) -> None:
        """Refuse the frames waiting for rounds that became stale here (a round of their group opened past
        them, or their first run closed without failing): else each holds its sender's stream, and so the
        sender's round, until the deadline. After a healed partition a member that trained on alone can be
        past the rounds the others retry with it."""
        for key, fut in self._waiters.items():
            if not fut.done() and (stale := self._stale(key)) is not None:
                fut.set_exception(stale)

    def _never_retried(self, group_id: int, round_id: int) -> bool:
        """Whether a frame of a retry round is for a round we will never retry: its first run is over here
        and did not fail (we applied or passed it, e.g. while the sender was out of our view and its round
        ids drifted from ours), so the frame would only wait here until the deadline."""
        base = (group_id & ~RETRY_GROUP_BIT, round_id)
        if not group_id & RETRY_GROUP_BIT or base in self._open or round_id > self._next.get(base[0], 0):
            return False
        return all(f.key != base for f in self.failures)

    def admit_from(self, round_id: int) -> None:
        """Refuse frames of rounds before ``round_id`` from now on (a joiner holds the state of that step)."""
        self._min_round_id = round_id
        self._expire_waiters()

    def fail_open(self, reason: str, where: Callable[[Key, RingRound], bool] = lambda key, rnd: True) -> None:
        """Fail every open round for which ``where(key, round)`` holds (their tensors stay untouched)."""
        for key, rnd in list(self._open.items()):
            if where(key, rnd):
                rnd.fail(reason)

    def fail_without(self, alive: Iterable[str]) -> None:
        """A round that needs a member no longer alive cannot finish: fail it now, not at its deadline."""
        live = set(alive)
        for key, rnd in list(self._open.items()):
            gone = self._members.get(key, frozenset()) - live
            if gone:
                rnd.fail(f"member(s) {', '.join(sorted(gone))} left")

    def refuse_waiting(self, error: PeerError) -> None:
        """Fail every frame waiting for a round that has not opened here (it never will)."""
        for fut in self._waiters.values():
            if not fut.done():
                fut.set_exception(error)
                fut.exception()

    def snapshot(self) -> RegistrySnapshot:
        return RegistrySnapshot(
            open_rounds=frozenset(self._open),
            next_round=dict(self._next),
            closed={g: frozenset(ids) for g, ids in self._closed.items()},
            pending=len(self._waiters) + len(self._waiter_refs),
            frames_waiting=sum(self._waiter_refs.values()),
        )
