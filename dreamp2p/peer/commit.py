"""All-or-none commit of a round: each member's vote, and the wait for every member's commit.

A member that finished its part of a round sends a commit vote to every other member and applies the
result only once every member's commit (for the same view) is in; a member whose round failed votes
"failed" and the others give up at once. So a round either completes everywhere or is applied nowhere,
but for one case no vote can settle: a member that voted commit and then gave up waiting (a late commit,
a member wrongly thought gone) while a member that held every commit applied it. The round's retry
settles that one (`Undecided`).
Votes may arrive before our own part of the round is done, so they are kept per round (bounded).
Runs on the peer's event loop only.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

from dreamp2p.collective.ring import RoundAborted
from dreamp2p.errors import RoundFailed
from dreamp2p.messages import RoundEvidence, RoundResult, Vote

log = logging.getLogger(__name__)

Key = tuple[int, int]  # (group id, round id)
# Rounds whose votes are remembered (votes may arrive before our own part of the round finishes).
MAX_VOTE_ROUNDS = 4096
# How often a wait for commits re-checks liveness: a member can die without sending anything.
LIVENESS_RECHECK_S = 0.5

SendVote = Callable[[str, Key, int, bool, RoundEvidence | None], Coroutine[Any, Any, None] | None]


class CommitVotes:
    def __init__(self, node_id: str, send: SendVote, is_alive: Callable[[str], bool]) -> None:
        self.node_id = node_id
        self._send = send  # coroutine that sends our vote to a member (None: no link to it)
        self._is_alive = is_alive
        self._votes: dict[Key, dict[str, Vote]] = {}
        self._events: dict[Key, asyncio.Event] = {}
        self._evidence: dict[Key, RoundEvidence] = {}  # what we measured of our part, sent on our votes

    def record(self, v: Vote) -> None:
        """Keep a member's vote and wake a wait on its round."""
        key = (v.group_id, v.round_id)
        if key not in self._votes and len(self._votes) >= MAX_VOTE_ROUNDS:
            del self._votes[next(iter(self._votes))]  # oldest first: dicts keep insertion order
        self._votes.setdefault(key, {})[v.sender] = v
        event = self._events.get(key)
        if event is not None:
            event.set()

    def attach(self, key: Key, evidence: RoundEvidence) -> None:
        """What we measured of our part of round ``key``: our votes on it carry it (see `peer.straggler`)."""
        self._evidence[key] = evidence

    def evidence(self, key: Key) -> RoundEvidence:
        """What we attached to round ``key`` (nothing measured if we attached nothing)."""
        return self._evidence.get(key, RoundEvidence())

    def votes(self, key: Key) -> dict[str, Vote]:
        """The members' votes on round ``key`` received so far (a copy)."""
        return dict(self._votes.get(key, {}))

    def failed_before(self, key: Key, members: Sequence[str]) -> str | None:
        """A member of ``members`` that already voted the round failed (before it opened here), if any."""
        for v in self._votes.get(key, {}).values():
            if not v.commit and v.sender in members:
                return v.sender
        return None

    def announce(self, key: Key, vid: int, others: Sequence[str], *, commit: bool) -> None:
        """Send our vote to every other member without waiting (failures surface through liveness)."""
        for node in others:
            coro = self._send(node, key, vid, commit, self._evidence.get(key))
            if coro is not None:
                asyncio.ensure_future(coro).add_done_callback(_quiet)

    async def agree(self, key: Key, vid: int, others: Sequence[str], timeout: float) -> None:
        """Commit our part to every other member, then wait for all of theirs (raises if one failed)."""
        if not others:
            return
        self.announce(key, vid, others, commit=True)
        event = self._events.setdefault(key, asyncio.Event())
        deadline = time.monotonic() + max(0.1, timeout)
        while True:
            votes = self._votes.get(key, {})
            missing = []
            for node in others:
                v = votes.get(node)
                if v is not None and not v.commit:
                    raise RoundAborted(f"{node} reports the round failed there")
                if v is None or v.view_id != vid:
                    missing.append(node)
            if not missing:
                return
            gone = [n for n in missing if not self._is_alive(n)]
            if gone:
                raise RoundAborted(f"member(s) {', '.join(gone)} left before committing")
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no commit from {', '.join(missing)} in time")
            event.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(event.wait(), min(left, LIVENESS_RECHECK_S))

    def forget(self, key: Key) -> None:
        self._votes.pop(key, None)
        self._events.pop(key, None)
        self._evidence.pop(key, None)


def _quiet(task: asyncio.Future[None]) -> None:
    """Votes are fire-and-forget: a lost one shows up as a missing commit or a dead member."""
    if not task.cancelled() and task.exception() is not None:
        log.debug("vote not delivered: %s", task.exception())


class Undecided(RoundFailed):
    """We voted commit on a round, then gave it up waiting for a member's commit (it timed out, or seemed
    to leave): a member that received every commit, ours among them, applied it (a commit cannot be taken
    back once sent). Our retry of it learns so from that member's ROUND_COMPLETED refusal and then calls
    :attr:`land`, which applies our own result of the round: identical to theirs (`collective.ring`)."""

    def __init__(self, key: tuple[int, int], reason: str) -> None:
        super().__init__(key, reason)
        self.land: Callable[[], RoundResult] = _unset
        self.members: tuple[str, ...] = ()  # the first run's, in ring order

    def widen(self, retry: RoundResult) -> RoundResult:
        """A retry that completed after this first run: its result, naming the first run's members too (they
        may have applied the first run, so a flush must not count itself whole without them)."""
        extra = tuple(m for m in self.members if m not in retry.members)
        return dataclasses.replace(retry, members=retry.members + extra) if extra else retry


def _unset() -> RoundResult:
    raise AssertionError("Undecided.land was not set")
