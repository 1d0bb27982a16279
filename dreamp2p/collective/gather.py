"""The mean of sparse contributions: every member's encoded buffer travels the whole ring unchanged.

SparseLoCo (Sarfi et al., arXiv 2508.15706) all-gathers the members' compressed pseudo-gradients and
averages them after decoding instead of reducing them on the way: a top-k codec cannot re-encode a sum of
top-k vectors without dropping what the sum adds (two members' 2% of a block is up to 4% of it), and the
ring's reduce-scatter (`collective.ring`) re-encodes at every hop and again at each segment's owner, where
nothing keeps what those encodes drop. Here each member encodes its own buffer once; its frames cross
N - 1 hops as the ring's all-gather frames do (the exact bytes, forwarded), and every member sums the N
decoded contributions in rank order, so all end bit-identical, with the mean of exactly what each member
sent. Each member sends N - 1 times its encoded buffer against the ring's 2(N - 1)/N: the same for two
members, 1.5 times for three, at a codec's 0.026 bytes per element. It holds the N encoded buffers until
the last arrives (N times that: a few % of the group's fp32 size) and decodes them into the group's buffer.

Frames are ALL_GATHER frames whose segment index is their origin's rank and whose ``excluded`` (0 or 1)
says the origin's guard refused its contribution (zeros in its place, left out of the mean); no
reduce-scatter frame is taken. Protocol only, as `collective.ring`.
"""

from __future__ import annotations

import dataclasses

import torch

from dreamp2p.collective.feedback import REDUCE, RoundFeedback
from dreamp2p.collective.partition import Segment, split_chunks
from dreamp2p.collective.ring import OutStream, RingRound, RoundSpec
from dreamp2p.compression import Codec
from dreamp2p.errors import PeerError, Status
from dreamp2p.messages import Frame, Phase


def gathers(spec: RoundSpec) -> bool:
    """Whether a round of ``spec`` gathers contributions (a sparse codec) instead of reducing them in a ring."""
    return spec.codec.sparse and spec.world > 1


class GatherRound(RingRound):
    """One gathered round at one member: the interface of :class:`RingRound`, another way to the mean."""

    def __init__(
        self, spec: RoundSpec, buffer: torch.Tensor, out: OutStream | None, feedback: RoundFeedback | None = None
    ) -> None:
        if not gathers(spec):
            raise ValueError(
                f"a gathered round needs a sparse codec and 2 or more members, not {spec.codec.name} among {spec.world}"
            )
        super().__init__(spec, buffer, out, feedback)
        self._whole = Segment(0, 0, buffer.numel())
        self._expected = (spec.world - 1) * buffer.numel()
        # origin rank -> (start, length, encoded bytes): a few % of the decoded values' memory, decoded at the end
        self._parts: dict[int, list[tuple[int, int, bytes]]] = {}
        self._excluded: dict[int, int] = {}  # origin rank -> its frames' ``excluded``
        self._own_sent = False

    async def start(self) -> None:
        """Encode our buffer once and send it; what the others decode of it is what we keep of it."""
        spec = self.spec
        assert self.out is not None  # RingRound requires one for more than one member
        codec = spec.codec
        # a refused contribution is zeros marked excluded: nothing of ours, residual included, goes out
        fb = self._feedback if not codec.lossless and spec.contributes else None
        for chunk in split_chunks(self._whole, spec.chunk_elems, self._block):
            if self.done.done():
                return
            values = self.acc[chunk.start : chunk.stop]
            if fb is not None:
                values = fb.compensate(REDUCE, chunk.start, values)
            raw = bytes(codec.encode(values).numpy())
            if fb is not None:
                fb.keep(REDUCE, chunk.start, values, codec.decode(raw, chunk.length))
            self._parts.setdefault(spec.rank, []).append((chunk.start, chunk.length, raw))
            frame = self._frame(
                Phase.ALL_GATHER, 0, spec.rank, chunk.start, chunk.length, raw, codec, self._own_excluded
            )
            self.bytes_sent += len(frame.payload)
            await self.out.put(frame)
        self._excluded[spec.rank] = self._own_excluded
        self._own_sent = True
        self._maybe_finish()

    def _expected_segment(self, phase: Phase, step: int) -> tuple[int, Segment]:
        # the contribution of the member ``step + 1`` hops before us, any chunk of the whole buffer
        return (self.spec.rank - 1 - step) % self.spec.world, self._whole

    def _validate(self, f: Frame) -> tuple[bytes | memoryview, int, int, Codec]:
        if f.phase != Phase.ALL_GATHER:
            raise PeerError(
                Status.BAD_FRAME,
                f"{f.phase.name} frame in a round whose {self.spec.codec.name} contributions are gathered",
            )
        if f.excluded > 1:
            raise PeerError(
                Status.BAD_FRAME, f"excluded {f.excluded}, but a gathered frame is one member's contribution"
            )
        seen = self._excluded.get(f.segment_index)
        if seen is not None and seen != f.excluded:
            raise PeerError(
                Status.BAD_FRAME, f"excluded {f.excluded}, but earlier chunks from member {f.segment_index} said {seen}"
            )
        return super()._validate(f)

    def _apply(self, frame: Frame, raw: bytes | memoryview, decoded: torch.Tensor, start: int, length: int) -> None:
        origin = frame.segment_index
        self._excluded[origin] = frame.excluded
        self._parts.setdefault(origin, []).append((start, length, bytes(raw)))  # decoded again at the end
        if frame.ring_step < self.spec.world - 2:
            # forward the origin's exact bytes: every member decodes the same values
            self._forward(dataclasses.replace(frame, ring_step=frame.ring_step + 1, sender=self.spec.node_id))

    def _maybe_finish(self) -> None:
        if self.done.done() or not self._own_sent or self._received < self._expected:
            return
        world = self.spec.world
        contributors = world - sum(self._excluded.values())
        if contributors < 1:
            self.fail("every peer's contribution was refused at its source")
            return
        total, codec = self.acc, self.spec.codec
        total.zero_()
        for origin in range(world):  # rank order: the same sums, bit for bit, at every member
            for start, length, raw in self._parts.get(origin, ()):
                total[start : start + length].add_(self._decode(codec, raw, length))
        total.div_(contributors)
        self._parts.clear()
        if not bool(torch.isfinite(total).all()):
            self.fail("reduction became non-finite")
            return
        self.contributors = contributors
        self.done.set_result(None)
