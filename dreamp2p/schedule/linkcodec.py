"""Bandwidth-aware codec choice per ring link, so that a slow link does not stall the round.

Bandwidth-aware compression (arXiv 2408.14736) sets each client's compression ratio
from its own bandwidth so that all uploads finish at about the same time: fast links send more, slow
links send less instead of straggling. Here the "clients" are the links of a ring all-reduce: link
``i`` carries what ring member ``i`` sends to member ``i + 1``. Every link gets the least lossy codec
whose transfer time (wire bytes / bandwidth) stays within ``1 + tolerance`` of the fastest link's time
with the base codec, so every peer finishes its part at about the same time.

The base codec is the accuracy the run asked for, so a link is never given a less lossy codec than
the base: the policy only ever removes bytes from a link, it never makes a round longer. All-gather
bytes are forwarded unchanged around the whole ring (that is what keeps every peer bit-identical), so
they cross the slowest link too: their codec is the slowest link's choice.

Pure: no I/O, no clock. Every peer that feeds in the same bandwidths (from the DreamDDP control round)
derives the same plan.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

from dreamp2p.compression import get_codec
from dreamp2p.messages import RingCodecPlan


def wire_ratio(codec: str) -> float:
    """Wire bytes per fp32 byte of ``codec`` on a long buffer (fp32 1.0, bf16 0.5, int8 ~0.266)."""
    return get_codec(codec).wire_ratio()


def round_wire_ratio(codec: str, world: int) -> float:
    """`wire_ratio` as the planner's ring pricing (2(N-1)/N of the buffer) should see it for a round of ``world``.

    A sparse codec's rounds gather every member's encoded buffer instead of reducing it in a ring
    (`collective.gather`): each member sends N-1 buffers, N/2 times the ring's share.
    """
    c = get_codec(codec)
    return c.wire_ratio() * (world / 2 if c.sparse and world > 1 else 1.0)


def _known(bandwidth: float) -> bool:
    """A usable measurement: finite and positive (NaN and 0 mean "not measured yet")."""
    return isinstance(bandwidth, int | float) and not isinstance(bandwidth, bool) and 0 < bandwidth < math.inf


def usable_codecs(base: str, candidates: Sequence[str]) -> tuple[str, ...]:
    """The candidates a link may use: ``base`` and those after it (more lossy), canonical names.

    Raises ValueError when ``base`` is not a candidate, a name repeats, or the wire ratio grows along the
    order (candidates must go from least to most lossy, i.e. never send more bytes than the one before).
    """
    names = [get_codec(c).name for c in candidates]
    base_name = get_codec(base).name
    if len(set(names)) != len(names):
        raise ValueError(f"candidate codecs repeat: {list(candidates)}")
    if base_name not in names:
        raise ValueError(f"base codec {base_name} is not among the candidates {names}")
    ratios = [wire_ratio(n) for n in names]
    for (a, ra), (b, rb) in itertools.pairwise(zip(names, ratios, strict=True)):
        if rb > ra:
            # first-fit below relies on this order: it is what makes slower links never get more bytes
            raise ValueError(f"candidates must be ordered least to most lossy: {b} sends more bytes than {a}")
    return tuple(names[names.index(base_name) :])


def choose_link_codecs(
    base: str,
    candidates: Sequence[str],
    bandwidths: Sequence[float],
    tolerance: float = 0.25,
) -> tuple[str, ...]:
    """Codec name per link for links of ``bandwidths`` bytes/s (NaN or 0: unknown).

    A link of bandwidth ``b`` gets the least lossy usable codec ``c`` with
    ``ratio(c) / b <= (1 + tolerance) * ratio(base) / b_max`` (``b_max``: the fastest known link), or,
    when none fits, the one sending the fewest bytes (least lossy among equals). Unknown links keep the
    base codec, as does every link when none is known: without a measurement there is nothing to
    equalize against.
    """
    if isinstance(tolerance, bool) or not isinstance(tolerance, int | float) or not 0 <= tolerance < math.inf:
        raise ValueError(f"tolerance must be finite and >= 0, got {tolerance!r}")
    usable = usable_codecs(base, candidates)
    ratios = [wire_ratio(c) for c in usable]
    known = [b for b in bandwidths if _known(b)]
    if not known:
        return tuple(usable[0] for _ in bandwidths)
    fastest = max(known)
    fewest = ratios.index(min(ratios))
    # ratio(c) / b <= (1 + tol) * ratio(base) / fastest, multiplied out so that a link as fast as the
    # fastest compares the base codec against itself and always keeps it.
    budget = (1.0 + tolerance) * ratios[0]
    out = []
    for b in bandwidths:
        if not _known(b):
            out.append(usable[0])
            continue
        pick = next((i for i, r in enumerate(ratios) if r * fastest <= budget * b), fewest)
        out.append(usable[pick])
    return tuple(out)


def gather_codec(base: str, candidates: Sequence[str], choices: Sequence[str]) -> str:
    """The ring-wide all-gather codec: the most lossy of the per-link ``choices`` (``base`` when empty).

    All-gather bytes cross every link of the ring, so they must fit the slowest one; by monotonicity of
    :func:`choose_link_codecs` the most lossy choice is the slowest known link's.
    """
    usable = usable_codecs(base, candidates)
    picked = [get_codec(c).name for c in choices]
    for name in picked:
        if name not in usable:
            raise ValueError(f"choice {name} is not a usable codec {list(usable)}")
    return max(picked, key=usable.index, default=usable[0])


def plan_ring_codecs(
    base: str,
    candidates: Sequence[str],
    bandwidths: Sequence[float],
    tolerance: float = 0.25,
) -> RingCodecPlan:
    """Per-link reduce-scatter codecs, the all-gather codec and the accepted set for one ring.

    ``bandwidths[i]`` is the measured goodput of the link from ring member ``i`` to member ``i + 1``.
    """
    send = choose_link_codecs(base, candidates, bandwidths, tolerance)
    return RingCodecPlan(
        send=send, gather=gather_codec(base, candidates, send), allowed=usable_codecs(base, candidates)
    )


def effective_bandwidth(plan: RingCodecPlan, bandwidths: Sequence[float]) -> float:
    """The bandwidth at which a ring using only the base codec would take as long as one using ``plan``.

    A ring all-reduce is paced by its slowest hop: reduce-scatter by the largest ``ratio(send[i]) / b[i]``,
    all-gather by ``ratio(gather) / min(b)``, each carrying (N-1)/N of the buffer. The planner's link model
    (one bandwidth, the base codec's ratio) then predicts the per-link round's time. NaN when no link is
    measured.
    """
    known = [(c, b) for c, b in zip(plan.send, bandwidths, strict=True) if _known(b)]
    if not known:
        return math.nan
    rs_pace = max(wire_ratio(c) / b for c, b in known)
    ag_pace = wire_ratio(plan.gather) / min(b for _, b in known)
    return 2.0 * wire_ratio(plan.allowed[0]) / (rs_pace + ag_pace)
