"""`RoundRegistry`: frames waiting for a round that can no longer open here are refused as soon as that is
known, not at their deadline (a sender's round and its stream would wait that long for nothing)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from dreamp2p.collective.ring import RingRound, RoundSpec
from dreamp2p.compression import get_codec
from dreamp2p.errors import PeerError, Status
from dreamp2p.messages import DType, Frame, Phase, RoundResult
from dreamp2p.peer.commit import Undecided
from dreamp2p.peer.rounds import RETRY_GROUP_BIT, RoundRegistry

G = 7
RETRY = G | RETRY_GROUP_BIT


def frame(group_id: int, round_id: int) -> Frame:
    return Frame(
        round_id=round_id,
        plan_version=0,
        group_id=group_id,
        phase=Phase.REDUCE_SCATTER,
        ring_step=0,
        segment_index=0,
        chunk_offset=0,
        chunk_length=4,
        codec=get_codec("fp32").wire_id,
        dtype=DType.FP32,
        element_count=4,
        checksum=0,
        zstd=False,
        raw_length=16,
        payload=bytes(16),
        sender="p1",
    )


def open_round(reg: RoundRegistry, group_id: int, round_id: int) -> RingRound:
    """Claim and open a round of one member (a peer alone in its view, e.g. on its side of a partition)."""
    reg.claim(group_id, round_id)
    spec = RoundSpec(
        group_id=group_id,
        round_id=round_id,
        plan_version=0,
        rank=0,
        world=1,
        node_id="p0",
        predecessor="p0",
        codec=get_codec("fp32"),
    )
    rnd = RingRound(spec, torch.zeros(4), None)
    reg.open((group_id, round_id), rnd, ["p0"])
    return rnd


async def waiting(reg: RoundRegistry, group_id: int, round_id: int) -> asyncio.Future[RingRound]:
    fut = asyncio.ensure_future(reg.round_for(frame(group_id, round_id)))
    await asyncio.sleep(0.01)
    assert not fut.done(), "the frame should wait for its round to open here"
    return fut


async def refused_now(fut: asyncio.Future[RingRound], match: str) -> None:
    with pytest.raises(PeerError, match=match) as err:
        await asyncio.wait_for(fut, 1.0)  # the registry's own deadline is a minute away
    assert err.value.status == Status.STALE_ROUND


async def test_a_round_this_peer_went_past_refuses_its_waiting_frames() -> None:
    reg = RoundRegistry(round_timeout_s=60.0)
    ahead = await waiting(reg, G, 6)  # a member ahead of us started round 6
    open_round(reg, G, 7)  # we never run round 6 (the member ran it among others): we are at 7 now
    await refused_now(ahead, "round 6 of group 7 is not open here")
    # a frame of the round we did open gets it
    assert (await reg.round_for(frame(G, 7))).spec.round_id == 7


@pytest.mark.parametrize("failed_here", [False, True])
async def test_a_retry_waits_only_while_its_first_run_may_still_fail_here(failed_here: bool) -> None:
    reg = RoundRegistry(round_timeout_s=60.0)
    open_round(reg, G, 8)
    retry = await waiting(reg, RETRY, 8)  # a member retries round 8; ours is still running
    if failed_here:
        reg.note_failure((G, 8), "a member left", deadline=False)
    reg.close((G, 8))
    if not failed_here:  # it succeeded here: we never retry it
        await refused_now(retry, "round 8 was not retried here")
        return
    await asyncio.sleep(0.01)
    assert not retry.done()  # it failed here too: our retry comes, and the frame is handed to it
    open_round(reg, RETRY, 8)
    assert (await asyncio.wait_for(retry, 1.0)).spec.group_id == RETRY


@pytest.mark.parametrize("waited", [False, True])
async def test_a_retry_of_a_round_completed_here_is_refused_as_completed(waited: bool) -> None:
    """A member that gave the round up after voting commit learns from this refusal that it completed here
    (it then applies its own result, see `roundrun.Undecided`); a frame of another round is not told so."""
    reg = RoundRegistry(round_timeout_s=60.0)
    open_round(reg, G, 9)
    retry = await waiting(reg, RETRY, 9) if waited else None
    reg.note_completion((G, 9))
    reg.close((G, 9))
    with pytest.raises(PeerError, match="round 9 of group 7 completed here") as err:
        await asyncio.wait_for(retry if retry is not None else reg.round_for(frame(RETRY, 9)), 1.0)
    assert err.value.status == Status.ROUND_COMPLETED
    # a late frame of the first run itself is stale, not "completed": only a retry is told
    with pytest.raises(PeerError) as stale:
        await reg.round_for(frame(G, 9))
    assert stale.value.status == Status.STALE_ROUND


async def test_a_retry_of_a_round_this_peer_skipped_is_refused_once_it_went_past() -> None:
    reg = RoundRegistry(round_timeout_s=60.0)
    open_round(reg, G, 3)
    reg.close((G, 3))
    retry = await waiting(reg, RETRY, 5)  # round 5 never opened here yet: it might, and fail, and be retried
    open_round(reg, G, 6)  # past it: round 5 never runs here, so neither does its retry
    await refused_now(retry, "round 5 was not retried here")


async def test_admitting_from_a_later_round_refuses_earlier_waiting_frames() -> None:
    reg = RoundRegistry(round_timeout_s=60.0)
    early = await waiting(reg, G, 10)
    reg.admit_from(12)  # a joiner holds the state of a later step
    await refused_now(early, "round 10 of group 7 is not open here")


async def test_a_waiting_frame_tells_who_is_ahead_only_for_groups_run_here() -> None:
    """Time-paced periods read a frame of round r that waits here as its sender being past step r - 1; a
    group this peer never ran (a first flush, whose ids are not steps) tells nothing."""
    reg = RoundRegistry(round_timeout_s=60.0)
    early: list[int] = []
    reg.on_early = early.append
    first = await waiting(reg, G, 40)  # no round of G ran here yet
    assert early == []
    open_round(reg, G, 2)
    ahead = await waiting(reg, G, 5)
    assert early == [5]
    for fut in (first, ahead):
        fut.cancel()


@pytest.mark.parametrize(
    ("first", "retry", "named"),
    [
        (("p0", "p1", "p2"), ("p2",), ("p2", "p0", "p1")),  # the others left: they may have applied the first run
        (("p0", "p1"), ("p0", "p1"), ("p0", "p1")),  # the same members: nothing to add
        (("p0", "p1"), ("p0", "p1", "p2"), ("p0", "p1", "p2")),  # a member joined meanwhile
    ],
)
def test_a_retry_after_a_first_run_given_up_names_that_runs_members(
    first: tuple[str, ...], retry: tuple[str, ...], named: tuple[str, ...]
) -> None:
    """So a flush does not count itself whole among the retry's members alone (`Strategy.flush`)."""
    undecided = Undecided((G, 4), "no commit from p0 in time")
    undecided.members = first
    result = RoundResult(RETRY, 4, 0.1, 0, 0, 8, "fp32", 0, members=retry)
    assert undecided.widen(result).members == named
