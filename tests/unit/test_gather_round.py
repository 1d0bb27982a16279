"""Sparse contributions gathered, not reduced (`dreamp2p.collective.gather`): real rounds wired in memory."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import pytest
import torch

from dreamp2p.collective.gather import GatherRound, gathers
from dreamp2p.collective.ring import RingRound, checksum
from dreamp2p.compression import get_codec
from dreamp2p.errors import PeerError, Status
from dreamp2p.messages import DType, Frame, Phase
from dreamp2p.schedule.linkcodec import round_wire_ratio
from tests.unit.test_linkcodec import MemoryLink, make_spec, run_ring

BLOCK = 4096


def inputs(world: int, n: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=g) for _ in range(world)]


def sent_mean(xs: Sequence[torch.Tensor], codec: str = "topk", refused: frozenset[int] = frozenset()) -> torch.Tensor:
    """The mean of what each member's encode carries, summed in rank order (what every member must end with)."""
    c = get_codec(codec)
    total = torch.zeros_like(xs[0])
    for rank, x in enumerate(xs):
        total += c.decode(c.encode(torch.zeros_like(x) if rank in refused else x), x.numel())
    return total / (len(xs) - len(refused))


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize(("n", "chunk"), [(3 * BLOCK, BLOCK), (5 * BLOCK + 100, 2 * BLOCK), (700, BLOCK)])
async def test_every_member_ends_with_the_mean_of_what_each_sent_bit_for_bit(world: int, n: int, chunk: int) -> None:
    xs = inputs(world, n)
    # members chunk their own contribution as their own link asks: the sums must not depend on it
    specs = [make_spec(r, world, "topk", chunk_elems=chunk * (1 + r % 2)) for r in range(world)]
    assert all(gathers(s) for s in specs)
    rounds = (await run_ring(xs, specs, GatherRound)).rounds
    want = sent_mean(xs)
    for rnd in rounds:
        assert torch.equal(rnd.acc, want)
        assert rnd.contributors == world
    encoded = get_codec("topk").encoded_nbytes
    # each member sent its own contribution and forwarded the others' but its successor's
    for rank, rnd in enumerate(rounds):
        assert rnd.bytes_sent == sum(
            encoded(min(specs[rank].chunk_elems, n - s)) for s in range(0, n, specs[rank].chunk_elems)
        ) + sum(
            encoded(min(specs[o].chunk_elems, n - s))
            for o in range(world)
            if o not in (rank, (rank + 1) % world)
            for s in range(0, n, specs[o].chunk_elems)
        )


async def test_gathering_keeps_what_the_ring_reencodes_away() -> None:
    """Three members' top-k picks differ: the ring's re-encoded sums drop part of them, the gather none."""
    xs = inputs(3, 4 * BLOCK, seed=3)
    want = sent_mean(xs)
    specs = [make_spec(r, 3, "topk") for r in range(3)]
    gathered = (await run_ring(xs, specs, GatherRound)).results[0]
    ringed = (await run_ring(xs, specs)).results[0]
    assert torch.equal(gathered, want)
    assert float((ringed - want).norm()) > 0.3 * float(want.norm())


async def test_a_refused_contribution_is_left_out_of_the_mean_everywhere() -> None:
    xs = inputs(3, 2 * BLOCK)
    xs[1] = torch.zeros_like(xs[1])  # what a member whose guard refused it sends
    specs = [make_spec(r, 3, "topk", contributes=r != 1) for r in range(3)]
    rounds = (await run_ring(xs, specs, GatherRound)).rounds
    want = sent_mean(xs, refused=frozenset({1}))
    assert all(torch.equal(r.acc, want) and r.contributors == 2 for r in rounds)


def test_only_sparse_codecs_among_several_members_gather() -> None:
    assert not gathers(make_spec(0, 2, "int4"))
    assert not gathers(make_spec(0, 1, "topk"))
    assert gathers(make_spec(0, 2, "topk"))
    for spec in (make_spec(0, 2, "int4"), make_spec(0, 1, "topk")):
        with pytest.raises(ValueError, match="a gathered round needs a sparse codec and 2 or more members"):
            GatherRound(spec, torch.zeros(BLOCK), MemoryLink())


def contribution(rnd: RingRound, origin: int, step: int = 0, **kw: object) -> Frame:
    """A frame of member ``origin``'s whole contribution (ones), arriving at ``rnd`` at ``step``."""
    spec = rnd.spec
    n = rnd.acc.numel()
    c = spec.codec
    payload = bytes(c.encode(torch.ones(n)).numpy())
    frame = Frame(
        round_id=spec.round_id,
        plan_version=spec.plan_version,
        group_id=spec.group_id,
        phase=Phase.ALL_GATHER,
        ring_step=step,
        segment_index=origin,
        chunk_offset=0,
        chunk_length=n,
        codec=c.wire_id,
        dtype=DType.FP32,
        element_count=n,
        checksum=checksum(payload),
        zstd=False,
        raw_length=0,
        payload=payload,
        sender=spec.predecessor,
    )
    return dataclasses.replace(frame, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("build", "detail"),
    [
        (lambda r: contribution(r, 0, phase=Phase.REDUCE_SCATTER), "REDUCE_SCATTER frame in a round whose topk"),
        (lambda r: contribution(r, 2), "segment 2 at ALL_GATHER step 0; expected segment 0"),
        (lambda r: contribution(r, 0, excluded=2), "excluded 2, but a gathered frame is one member's"),
        (lambda r: contribution(r, 0, ring_step=2), "ring_step 2 out of range for 3 peers"),
    ],
    ids=["reduce-scatter", "wrong-origin", "excluded-many", "step-beyond-ring"],
)
async def test_refused_frames_leave_a_gathered_round_untouched(
    build: Callable[[RingRound], Frame], detail: str
) -> None:
    out = MemoryLink()
    rnd = GatherRound(make_spec(1, 3, "topk"), torch.zeros(BLOCK), out)
    with pytest.raises(PeerError) as info:
        rnd.deliver(build(rnd))
    assert info.value.status == Status.BAD_FRAME
    assert detail in info.value.detail
    assert rnd.bytes_received == 0 and not out.sent and bool((rnd.acc == 0).all())
    # the right frame is still taken, and forwarded (member 0's contribution goes on to member 2)
    rnd.deliver(contribution(rnd, 0))
    assert [(f.segment_index, f.ring_step, f.sender) for f in out.sent] == [(0, 1, "p1")]


async def test_an_origin_cannot_change_its_mind_about_being_excluded() -> None:
    rnd = GatherRound(make_spec(1, 3, "topk", chunk_elems=BLOCK), torch.zeros(2 * BLOCK), MemoryLink())
    first = contribution(rnd, 0)
    half = BLOCK
    payload = bytes(get_codec("topk").encode(torch.ones(half)).numpy())

    def part(start: int, excluded: int) -> Frame:
        return dataclasses.replace(
            first, chunk_offset=start, chunk_length=half, payload=payload, checksum=checksum(payload), excluded=excluded
        )

    rnd.deliver(part(0, 1))
    with pytest.raises(PeerError, match="earlier chunks from member 0 said 1"):
        rnd.deliver(part(half, 0))


@pytest.mark.parametrize(
    ("codec", "world", "times"),
    [("int4", 3, 1.0), ("int2", 5, 1.0), ("topk", 1, 1.0), ("topk", 2, 1.0), ("topk", 3, 1.5), ("topk", 4, 2.0)],
)
def test_the_planner_prices_a_gathered_round_at_its_bytes(codec: str, world: int, times: float) -> None:
    """Priced as a ring (2(N-1)/N of the buffer) times ``times``: a gathered round sends N-1 buffers."""
    assert round_wire_ratio(codec, world) == pytest.approx(get_codec(codec).wire_ratio() * times)
