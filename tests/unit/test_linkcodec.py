"""Bandwidth-aware codec per link: the pure policy, and real RingRounds wired in memory with mixed codecs."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dreamp2p.collective.partition import (
    all_gather_send,
    reduce_scatter_recv,
    reduce_scatter_send,
    split_chunks,
    split_segments,
)
from dreamp2p.collective.ring import RingRound, RoundSpec, checksum, round_block
from dreamp2p.compression import Codec, UnknownCodecError, ZstdStage, get_codec
from dreamp2p.errors import PeerError, Status
from dreamp2p.messages import DType, Frame, Phase
from dreamp2p.schedule.linkcodec import (
    choose_link_codecs,
    gather_codec,
    plan_ring_codecs,
    usable_codecs,
    wire_ratio,
)

CANDIDATES = ("fp32", "bf16", "int8", "int4")
NAN = math.nan
MB = 1e6

# ---------------------------------------------------------------------------------------------- policy


@pytest.mark.parametrize(
    ("base", "bandwidths", "tolerance", "expect"),
    [
        ("fp32", [], 0.25, []),
        ("fp32", [50 * MB] * 4, 0.25, ["fp32"] * 4),  # equal links: nobody straggles
        # 1/2 the bandwidth needs <= 0.625 of the bytes: bf16; 1/4 needs <= 0.3125: int8; 1/8: int4
        ("fp32", [100 * MB, 50 * MB, 25 * MB, 12.5 * MB], 0.25, ["fp32", "bf16", "int8", "int4"]),
        # within the tolerance a link keeps the base codec
        ("fp32", [100 * MB, 81 * MB], 0.25, ["fp32", "fp32"]),
        ("fp32", [100 * MB, 99 * MB], 0.0, ["fp32", "bf16"]),
        # too slow for any codec: the one sending the fewest bytes
        ("fp32", [100 * MB, 1 * MB], 0.25, ["fp32", "int4"]),
        # unknown links (NaN, 0) keep the base codec and are not "the fastest"
        ("fp32", [NAN, 40 * MB, 0.0, 10 * MB], 0.25, ["fp32", "fp32", "fp32", "int8"]),
        ("fp32", [NAN, 0.0], 0.25, ["fp32", "fp32"]),
        # never less lossy than the base codec, even where the link could afford it
        ("int8", [100 * MB, 60 * MB, 30 * MB], 0.25, ["int8", "int4", "int4"]),
        ("int8", [100 * MB, 100 * MB], 10.0, ["int8", "int8"]),
        ("bf16", [100 * MB, 50 * MB], 0.25, ["bf16", "int8"]),
    ],
)
def test_choose_link_codecs_cases(base: str, bandwidths: list[float], tolerance: float, expect: list[str]) -> None:
    assert list(choose_link_codecs(base, CANDIDATES, bandwidths, tolerance)) == expect


def test_codec_names_are_canonical() -> None:
    assert choose_link_codecs("FP32", ["fp32", " INT8 "], [10 * MB, 2 * MB]) == ("fp32", "int8")


@pytest.mark.parametrize(
    ("base", "candidates", "tolerance", "match"),
    [
        ("fp16", CANDIDATES, 0.25, "not among the candidates"),
        ("fp32", ("fp32", "int8", "fp32"), 0.25, "repeat"),
        ("fp32", ("fp32", "int8", "bf16"), 0.25, "least to most lossy"),
        ("fp32", CANDIDATES, -0.1, "tolerance"),
        ("fp32", CANDIDATES, NAN, "tolerance"),
        ("fp32", CANDIDATES, math.inf, "tolerance"),
    ],
)
def test_policy_rejects(base: str, candidates: Sequence[str], tolerance: float, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        choose_link_codecs(base, candidates, [1 * MB], tolerance)


def test_unknown_codec_name_is_refused() -> None:
    with pytest.raises(UnknownCodecError):
        choose_link_codecs("fp32", ("fp32", "zip9"), [1 * MB])


def test_gather_codec_is_the_most_lossy_choice() -> None:
    assert gather_codec("fp32", CANDIDATES, ["fp32", "int8", "bf16"]) == "int8"
    assert gather_codec("fp32", CANDIDATES, []) == "fp32"
    with pytest.raises(ValueError, match="not a usable codec"):
        gather_codec("int8", CANDIDATES, ["fp32"])


def test_plan_allowed_set_does_not_depend_on_measurements() -> None:
    slow = plan_ring_codecs("fp32", CANDIDATES, [100 * MB, 100 * MB, 10 * MB])
    unknown = plan_ring_codecs("fp32", CANDIDATES, [NAN, NAN, NAN])
    assert slow.send == ("fp32", "fp32", "int4") and slow.gather == "int4"
    assert unknown.send == ("fp32",) * 3 and unknown.gather == "fp32"
    # members that measured differently still agree on what may arrive, hence on the segment layout
    assert slow.allowed == unknown.allowed == CANDIDATES
    assert plan_ring_codecs("int8", CANDIDATES, [1 * MB]).allowed == ("int8", "int4")


bandwidth = st.one_of(st.floats(1e3, 1e11), st.sampled_from([NAN, 0.0]))
bases = st.sampled_from(CANDIDATES)
tolerances = st.floats(0.0, 3.0)


def _fits(codec: str, base: str, bw: float, fastest: float, tol: float) -> bool:
    # time = ratio / bw, compared with a whisker of slack for the float rounding of the policy's product
    return wire_ratio(codec) / bw <= (1 + tol) * wire_ratio(base) / fastest * (1 + 1e-12)


@given(base=bases, bws=st.lists(bandwidth, max_size=12), tol=tolerances)
@settings(max_examples=300, deadline=None)
def test_choice_is_within_bounds_and_least_lossy(base: str, bws: list[float], tol: float) -> None:
    usable = usable_codecs(base, CANDIDATES)
    fewest = min(usable, key=wire_ratio)
    out = choose_link_codecs(base, CANDIDATES, bws, tol)
    assert len(out) == len(bws)
    known = [b for b in bws if b > 0]
    for b, c in zip(bws, out, strict=True):
        assert c in usable
        if not b > 0:
            assert c == base
            continue
        fastest = max(known)
        # the link finishes within the budget, or it sends as few bytes as any codec can
        assert _fits(c, base, b, fastest, tol) or c == fewest
        # and no less lossy usable codec would have fit
        i = usable.index(c)
        if i > 0:
            assert not wire_ratio(usable[i - 1]) / b <= (1 + tol) * wire_ratio(base) / fastest * (1 - 1e-12)


@given(base=bases, bws=st.lists(bandwidth, min_size=2, max_size=12), tol=tolerances)
@settings(max_examples=300, deadline=None)
def test_slower_link_never_gets_a_less_compressive_codec(base: str, bws: list[float], tol: float) -> None:
    out = choose_link_codecs(base, CANDIDATES, bws, tol)
    order = usable_codecs(base, CANDIDATES)
    links = sorted((b, order.index(c)) for b, c in zip(bws, out, strict=True) if b > 0)
    for (_, slower), (_, faster) in itertools.pairwise(links):
        assert slower >= faster
    # the all-gather codec is the slowest known link's choice
    if links:
        assert gather_codec(base, CANDIDATES, out) == order[links[0][1]]


@given(base=bases, bw=st.floats(1e3, 1e11), n=st.integers(1, 8), tol=tolerances)
def test_equal_links_keep_the_base_codec(base: str, bw: float, n: int, tol: float) -> None:
    assert choose_link_codecs(base, CANDIDATES, [bw] * n, tol) == (base,) * n


# ------------------------------------------------------------------------------------ in-memory ring


@dataclass
class MemoryLink:
    """An :class:`~dreamp2p.collective.ring.OutStream` that hands frames to the successor's round in order.

    Frames go through a queue drained by a task, as on a real stream: a frame's reduction never runs
    inside the sender's own ``deliver`` call.
    """

    queue: asyncio.Queue[Frame] = field(default_factory=asyncio.Queue)
    sent: list[Frame] = field(default_factory=list)
    target: RingRound | None = None
    aborted: str | None = None

    def forward(self, frame: Frame) -> None:
        self.sent.append(frame)
        self.queue.put_nowait(frame)

    async def put(self, frame: Frame) -> None:
        self.forward(frame)

    async def close(self) -> None:
        return None

    def abort(self, reason: str) -> None:
        self.aborted = reason

    async def pump(self) -> None:
        assert self.target is not None
        while True:
            frame = await self.queue.get()
            try:
                self.target.deliver(frame)
            except PeerError as exc:
                self.target.fail(str(exc))
                return


def make_spec(rank: int, world: int, codec: str = "fp32", **kw: object) -> RoundSpec:
    return RoundSpec(
        group_id=7,
        round_id=1,
        plan_version=0,
        rank=rank,
        world=world,
        node_id=f"p{rank}",
        predecessor=f"p{(rank - 1) % world}",
        codec=get_codec(codec),
        **kw,  # type: ignore[arg-type]
    )


@dataclass
class RingRun:
    results: list[torch.Tensor]
    rounds: list[RingRound]
    links: list[MemoryLink]  # links[r]: from rank r to rank r + 1


async def run_ring(
    inputs: Sequence[torch.Tensor], specs: Sequence[RoundSpec], kind: type[RingRound] = RingRound
) -> RingRun:
    """Rounds of ``kind`` (a RingRound, or a subclass such as the gathered round) over ``inputs``, wired in memory."""
    world = len(specs)
    bufs = [x.clone() for x in inputs]
    links = [MemoryLink() for _ in range(world)]
    rounds = [kind(spec, buf, link) for spec, buf, link in zip(specs, bufs, links, strict=True)]
    for r, link in enumerate(links):
        link.target = rounds[(r + 1) % world]
    pumps = [asyncio.ensure_future(link.pump()) for link in links]
    try:
        await asyncio.wait_for(asyncio.gather(*(r.start() for r in rounds)), 30)
        await asyncio.wait_for(asyncio.gather(*(r.done for r in rounds)), 30)
    finally:
        for p in pumps:
            p.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)
    return RingRun(bufs, rounds, links)


def mixed_specs(
    world: int, base: str, plan_send: Sequence[str], gather: str, allowed: Sequence[str], **kw: object
) -> list[RoundSpec]:
    ids = tuple(get_codec(c).wire_id for c in allowed)
    return [
        make_spec(
            r,
            world,
            base,
            send_codec=get_codec(plan_send[r]),
            gather_codec=get_codec(gather),
            allowed_codecs=ids,
            **kw,
        )
        for r in range(world)
    ]


# Worst-case error of one quantization, relative to the largest magnitude in its block.
QUANT_STEP = {"fp32": 0.0, "fp16": 2.0**-11, "bf16": 2.0**-8, "int8": 1 / 254, "int4": 1 / 14, "e3m0": 1 / 3}


def mean_error_bound(world: int, q: float) -> float:
    """Bound on |result - exact mean| / max|input| when every encoding has relative step ``q``.

    Reduce-scatter hop k sends a partial sum of k contributions plus the error e so far (magnitude at
    most k + e), and its encoding adds at most q (k + e); the owner divides by N and encodes the mean
    (magnitude at most 1 + e / N) once more. A little slack covers fp32 accumulation rounding.
    """
    e = 0.0
    for k in range(1, world):
        e += q * (k + e)
    mean_err = e / world
    return mean_err + q * (1 + mean_err) + 1e-6


def expected_bytes_sent(rank: int, world: int, n: int, chunk_elems: int, block: int, rs: Codec, ag: Codec) -> int:
    segs = split_segments(n, world, block)
    total = 0
    for step in range(world - 1):
        for c in split_chunks(segs[reduce_scatter_send(rank, world, step)], chunk_elems, block):
            total += rs.encoded_nbytes(c.length)
        for c in split_chunks(segs[all_gather_send(rank, world, step)], chunk_elems, block):
            total += ag.encoded_nbytes(c.length)
    return total


def seeded_inputs(world: int, n: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    # one outlier block per rank, so blockwise scales differ between blocks
    out = []
    for _ in range(world):
        x = torch.randn(n, generator=g)
        if n > 100:
            x[50:60] *= 20
        out.append(x)
    return out


# ring position i -> bandwidth of the link from member i to member i + 1
RING_BANDWIDTHS = {
    2: [100 * MB, 30 * MB],
    3: [100 * MB, 50 * MB, 12 * MB],
    4: [100 * MB, 60 * MB, 30 * MB, 12 * MB],
}
TOLERANCE = 0.25


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("n", [1, 13, 1000, 100_003])
async def test_mixed_link_codecs(world: int, n: int) -> None:
    bws = RING_BANDWIDTHS[world]
    plan = plan_ring_codecs("fp32", CANDIDATES, bws, TOLERANCE)
    assert len(set(plan.send)) > 1, "the test needs links with different codecs"
    chunk = 4096
    inputs = seeded_inputs(world, n, seed=world)
    run = await run_ring(inputs, mixed_specs(world, "fp32", plan.send, plan.gather, plan.allowed, chunk_elems=chunk))

    # every peer ends with bit-identical values
    first = run.results[0]
    for res in run.results[1:]:
        assert torch.equal(res.view(torch.int32), first.view(torch.int32))
    assert bool(torch.isfinite(first).all())

    # the mean is within the bound of the coarsest codec used on any hop
    coarsest = max((*plan.send, plan.gather), key=lambda c: QUANT_STEP[c])
    exact = torch.stack([x.double() for x in inputs]).mean(0)
    scale = max(float(x.abs().max()) for x in inputs)
    err = float((first.double() - exact).abs().max()) / scale
    assert err <= mean_error_bound(world, QUANT_STEP[coarsest]), f"{coarsest}: {err:.3g}"

    # each link carries its own codec on reduce-scatter, the slowest link's codec on all-gather
    block = round_block(get_codec("fp32"), tuple(get_codec(c).wire_id for c in plan.allowed))
    assert block == 64
    for r, link in enumerate(run.links):
        rs = {get_codec(f.codec).name for f in link.sent if f.phase == Phase.REDUCE_SCATTER}
        ag = {get_codec(f.codec).name for f in link.sent if f.phase == Phase.ALL_GATHER}
        assert rs <= {plan.send[r]} and ag <= {plan.gather}
        want = expected_bytes_sent(r, world, n, chunk, block, get_codec(plan.send[r]), get_codec(plan.gather))
        assert run.rounds[r].bytes_sent == sum(len(f.payload) for f in link.sent) == want
        assert run.rounds[(r + 1) % world].bytes_received == want

    if n < 100_000:
        return
    # same round, every link at the base codec: what the slow links would have sent without the policy
    base = await run_ring(inputs, mixed_specs(world, "fp32", ["fp32"] * world, "fp32", plan.allowed, chunk_elems=chunk))
    slow = min(range(world), key=lambda r: bws[r])
    ratio = run.rounds[slow].bytes_sent / base.rounds[slow].bytes_sent
    assert ratio == pytest.approx(wire_ratio(plan.send[slow]), rel=0.01)
    # every link finishes its part within the tolerance of the fastest link's time with the base codec
    fast = max(range(world), key=lambda r: bws[r])
    budget = (1 + TOLERANCE) * base.rounds[fast].bytes_sent / bws[fast]
    for r in range(world):
        assert run.rounds[r].bytes_sent / bws[r] <= budget * 1.01, f"link {r} straggles"
        assert run.rounds[r].bytes_sent <= base.rounds[r].bytes_sent


@pytest.mark.parametrize("world", [2, 3, 4])
async def test_mixed_link_codecs_through_zstd(world: int) -> None:
    plan = plan_ring_codecs("fp32", CANDIDATES, RING_BANDWIDTHS[world], TOLERANCE)
    inputs = seeded_inputs(world, 5000, seed=1)
    # sparse inputs make zstd pay off, so both compressed and raw frames occur
    for x in inputs:
        x[::3] = 0.0
    specs = mixed_specs(world, "fp32", plan.send, plan.gather, plan.allowed, chunk_elems=1024, zstd=ZstdStage())
    run = await run_ring(inputs, specs)
    assert all(torch.equal(res, run.results[0]) for res in run.results)
    assert any(f.zstd for link in run.links for f in link.sent)


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("codec", ["fp32", "int8"])
async def test_defaults_keep_todays_wire_bytes(world: int, codec: str) -> None:
    """No per-link choice: same layout, same codec and byte-identical frames as a round without the fields."""
    inputs = seeded_inputs(world, 3001, seed=2)
    plain = await run_ring(inputs, [make_spec(r, world, codec, chunk_elems=500) for r in range(world)])
    c = get_codec(codec)
    explicit = await run_ring(
        inputs,
        [
            make_spec(r, world, codec, chunk_elems=500, send_codec=c, gather_codec=c, allowed_codecs=(c.wire_id,))
            for r in range(world)
        ],
    )
    assert make_spec(0, world, codec).block == c.block
    for a, b in zip(plain.links, explicit.links, strict=True):
        assert [dataclasses.astuple(f) for f in a.sent] == [dataclasses.astuple(f) for f in b.sent]
        assert all(f.codec == c.wire_id for f in a.sent)
    for a, b in zip(plain.results, explicit.results, strict=True):
        assert torch.equal(a, b)


async def test_wider_allowed_set_alone_is_still_exact() -> None:
    """Accepting more codecs changes the alignment (block 64) but not the fp32 result."""
    world = 3
    inputs = seeded_inputs(world, 1001, seed=3)
    ids = tuple(get_codec(c).wire_id for c in CANDIDATES)
    run = await run_ring(inputs, [make_spec(r, world, allowed_codecs=ids, chunk_elems=100) for r in range(world)])
    exact = torch.stack([x.double() for x in inputs]).mean(0)
    assert all(torch.equal(res, run.results[0]) for res in run.results)
    assert float((run.results[0].double() - exact).abs().max()) < 1e-5
    # chunks fall on the 64-element grid even though fp32 itself has block 1
    segs = split_segments(1001, world, 64)
    for link in run.links:
        for f in link.sent:
            assert (f.chunk_offset - segs[f.segment_index].start) % 64 == 0


# --------------------------------------------------------------------------------------- refusals

INT8_ROUND = (get_codec("fp32").wire_id, get_codec("int8").wire_id)


def test_spec_refuses_a_send_codec_outside_the_allowed_set() -> None:
    with pytest.raises(ValueError, match="send_codec int8"):
        make_spec(0, 2, send_codec=get_codec("int8"))
    with pytest.raises(ValueError, match="gather_codec int4"):
        make_spec(0, 2, gather_codec=get_codec("int4"), allowed_codecs=INT8_ROUND)
    with pytest.raises(UnknownCodecError):
        make_spec(0, 2, allowed_codecs=(99,))


def frame_for(
    rnd: RingRound, codec: str, start: int | None = None, length: int | None = None, wire_id: int | None = None
) -> Frame:
    """A reduce-scatter step-0 frame from the predecessor, encoded by ``codec`` and labelled ``wire_id``.

    By default it covers the whole segment and is labelled with the codec that encoded it.
    """
    spec = rnd.spec
    seg = rnd.segments[reduce_scatter_recv(spec.rank, spec.world, 0)]
    start = seg.start if start is None else start
    length = seg.length if length is None else length
    c = get_codec(codec)
    payload = bytes(c.encode(torch.ones(length)).numpy())
    f = Frame(
        round_id=spec.round_id,
        plan_version=spec.plan_version,
        group_id=spec.group_id,
        phase=Phase.REDUCE_SCATTER,
        ring_step=0,
        segment_index=seg.index,
        chunk_offset=start,
        chunk_length=length,
        codec=c.wire_id if wire_id is None else wire_id,
        dtype=DType.FP32,
        element_count=rnd.acc.numel(),
        checksum=checksum(payload),
        zstd=False,
        raw_length=0,
        payload=payload,
        sender=spec.predecessor,
    )
    return f


@pytest.mark.parametrize(
    ("build", "status", "detail"),
    [
        (
            lambda r: frame_for(r, "fp16"),
            Status.BAD_FRAME,
            "codec fp16 but round uses fp32 and accepts only fp32, int8",
        ),
        (lambda r: frame_for(r, "fp32", wire_id=99), Status.UNKNOWN_CODEC, "unknown codec id 99"),
        # an accepted codec, but the payload is sized for another one
        (
            lambda r: frame_for(r, "fp32", wire_id=get_codec("int8").wire_id),
            Status.BAD_FRAME,
            "for 128 int8 elements; expected 136",
        ),
        # fp32 has block 1, but the round's grid is 64 for every frame
        (lambda r: frame_for(r, "fp32", start=1, length=64), Status.BAD_FRAME, "codec block of 64"),
    ],
    ids=["codec-not-allowed", "unknown-codec", "size-of-other-codec", "misaligned"],
)
async def test_refused_frames_leave_the_round_untouched(
    build: Callable[[RingRound], Frame], status: Status, detail: str
) -> None:
    out = MemoryLink()
    rnd = RingRound(make_spec(1, 2, allowed_codecs=INT8_ROUND), torch.zeros(256), out)
    assert [s.length for s in rnd.segments] == [128, 128]
    with pytest.raises(PeerError) as info:
        rnd.deliver(build(rnd))
    assert info.value.status == status
    assert detail in info.value.detail
    assert rnd.bytes_received == 0 and not out.sent and bool((rnd.acc == 0).all())
    # the same chunk in an accepted codec is still welcome
    rnd.deliver(frame_for(rnd, "int8"))
    # the last reduce-scatter step: ones plus our zeros, averaged over both peers
    assert bool((rnd.acc[:128] == 0.5).all()) and out.sent[0].phase == Phase.ALL_GATHER


async def test_default_round_keeps_its_old_refusal() -> None:
    rnd = RingRound(make_spec(1, 2), torch.zeros(256), MemoryLink())
    with pytest.raises(PeerError) as info:
        rnd.deliver(frame_for(rnd, "int8"))
    assert info.value.status == Status.BAD_FRAME
    assert info.value.detail == "codec int8 but round uses fp32"


@pytest.mark.parametrize(
    ("bandwidths", "want"),
    [
        ([100e6, 100e6, 100e6], 100e6),  # equal links keep the base codec: the measured bandwidth itself
        ([math.nan, math.nan], math.nan),  # nothing measured
    ],
)
def test_effective_bandwidth_of_uniform_rings(bandwidths: list[float], want: float) -> None:
    from dreamp2p.schedule.linkcodec import effective_bandwidth

    plan = plan_ring_codecs("fp32", ["fp32", "bf16", "int8"], bandwidths)
    got = effective_bandwidth(plan, bandwidths)
    assert (math.isnan(got) and math.isnan(want)) or got == pytest.approx(want)


def test_effective_bandwidth_beats_the_slowest_link_when_it_compresses() -> None:
    from dreamp2p.schedule.linkcodec import effective_bandwidth, wire_ratio

    bws = [100e6, 100e6, 10e6]  # one link 10x slower
    plan = plan_ring_codecs("fp32", ["fp32", "bf16", "int8", "int4"], bws)
    assert plan.send[2] != "fp32" and plan.gather == plan.send[2]
    eff = effective_bandwidth(plan, bws)
    # faster than a ring of base-codec frames paced by the slow link, slower than the fast links
    assert 10e6 < eff < 100e6
    # and exactly the pace of its slowest hop in each phase
    rs = max(wire_ratio(c) / b for c, b in zip(plan.send, bws, strict=True))
    ag = wire_ratio(plan.gather) / min(bws)
    assert eff == pytest.approx(2 * wire_ratio("fp32") / (rs + ag))
