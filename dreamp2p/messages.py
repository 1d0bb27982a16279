"""Wire-agnostic message types that the collective and peer layers exchange with the transport.

`dreamp2p.transport.serde` is the only place that turns these into protobuf and back; code above the
transport never sees a generated class.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

# The wire protocol's version, sent in every handshake: peers that differ refuse each other
# (VERSION_MISMATCH). Raised only when a change of meaning cannot be expressed by new proto fields.
# 2: plan group ids span 2 * MAX_PLAN_SYNCS per version (was 1000); 3: anchors get group ids of their own;
# 4: DreamDDP control rounds space out while the link holds steady (sync.control_backoff); 5: DreamDDP's
# every anchor_every-th period checks its pseudo-gradients instead of averaging parameters (anchors only
# in the first period and where a check found the outer weights different); 6: DreamDDP's first period
# sends checked pseudo-gradients too (theta starts at attach), and plans are priced at delta_codec's size;
# 7: heartbeat answers name the members' synchronization memory beside the plan (schedule_step/_digest), and
# a member whose memory parted from the others' (a partition) yields as for a plan it missed; 8: DiLoCo,
# Streaming DiLoCo and CO2 check their members' outer state every anchor_every-th period and average it
# where it differs (rounds of their own, which an older peer would never join)
PROTOCOL_VERSION = 8


class Phase(enum.IntEnum):
    REDUCE_SCATTER = 1
    ALL_GATHER = 2


class DType(enum.IntEnum):
    FP32 = 1
    FP16 = 2
    BF16 = 3


@dataclass(frozen=True, slots=True)
class Frame:
    """One chunk of one segment of one group's flat buffer, as sent on a Push stream."""

    round_id: int
    plan_version: int
    group_id: int
    phase: Phase
    ring_step: int
    segment_index: int
    chunk_offset: int
    chunk_length: int
    codec: int  # wire id, see dreamp2p.compression
    dtype: DType
    element_count: int
    checksum: int
    zstd: bool
    raw_length: int
    payload: bytes | memoryview  # a received payload is a view into the message buffer
    sender: str
    excluded: int = 0  # reduce-scatter: refused contributions inside this partial sum
    view_id: int = 0  # hash of the members the round runs among (0: not checked)


@dataclass(frozen=True)
class RoundEvidence:
    """What a member measured of its own part in a round, sent on its commit vote (see `peer.straggler`).

    Zeros mean "not measured" (a member that measured nothing, or an older one): it is not judged.
    """

    sent_bytes: int = 0  # bytes it sent in the round
    link_Bps: float = 0.0  # its measured outbound link rate (goodput to its successor), bytes/s
    part_s: float = 0.0  # seconds from opening the round to finishing its part


@dataclass(frozen=True)
class Vote:
    """A member's outcome of one round: committed (its part finished) or failed (nobody may apply it)."""

    sender: str
    group_id: int
    round_id: int
    view_id: int
    commit: bool
    evidence: RoundEvidence = RoundEvidence()


@dataclass(frozen=True)
class Hello:
    """Handshake contents: who is calling and whether it speaks our protocol for the same model."""

    cluster_id: str
    protocol_version: int
    node_id: str
    manifest_hash: bytes
    codecs: tuple[int, ...]
    advertise_address: str = ""
    # training settings every member must share, sorted (name, value) pairs; empty before attach
    settings: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class LinkSnapshot:
    peer: str
    rtt_s: float
    goodput_Bps: float
    bytes_sent: int
    bytes_received: int
    samples: int
    chunk_bytes: int
    # the goodput is only a floor: every sample was a burst sent beside other traffic on the link
    goodput_is_floor: bool = False


@dataclass(frozen=True)
class PeerStatus:
    node_id: str
    cluster_id: str
    protocol_version: int
    ring: tuple[str, ...]
    links: tuple[LinkSnapshot, ...]
    rounds_completed: int
    rounds_failed: int
    frames_rejected: int
    codecs: tuple[int, ...] = field(default_factory=tuple)
    uptime_s: float = 0.0
    training: TrainingInfo | None = None
    resuming: bool = False
    checkpoint_steps: tuple[int, ...] = ()
    contributions_refused: int = 0
    live: tuple[str, ...] = ()  # members counted alive now: the ring the next rounds run among
    view_id: int = 0
    excluded: tuple[str, ...] = ()  # live members left out of the rounds as stragglers (see peer.straggler)
    straggler_evictions: int = 0  # times a member was excluded as a straggler, as this node judged it
    straggler_returns: int = 0  # times an excluded member took part again after its probation


@dataclass(frozen=True)
class TrainingInfo:
    """What the attached trainer reports through the peer's Status call."""

    strategy: str
    step: int
    plan_version: int = 0
    plan_effective_step: int = 0
    plan_summary: str = ""
    # in a region of many ranks (dreamp2p.sync.comm.sharded): this peer's local rank and the region's rank count
    region_rank: int = 0
    region_ranks: int = 0  # 0: not a region of many ranks
    plan_digest: int = 0  # Plan.digest of the plan in force (0: no plan)
    # the synchronization memory besides the plan that every member must hold alike (DreamDDP: its control
    # schedule and re-planning memory), as a digest, and the step it last changed at (0: none)
    schedule_step: int = 0
    schedule_digest: int = 0
    # the most steps this member can trail another of the same ring (0: no bound): further behind, it
    # takes the state of those ahead (see dreamp2p.peer.drift); local to the node, not on the wire
    lag_steps: int = 0

    def progress(self) -> MemberProgress:
        return MemberProgress(
            self.step,
            self.plan_version,
            self.plan_effective_step,
            self.plan_digest,
            self.schedule_step,
            self.schedule_digest,
        )


@dataclass(frozen=True)
class MemberProgress:
    """Where a member's training is, as its heartbeat answers say: its step and the plan in force.

    A plan is named by its version, the step it took effect at and its digest: two sides of a partition
    may each decide a plan of the same version, and those differ (see `dreamp2p.peer.drift`). The sides may
    also keep one plan and still part in the rest of what every member must hold alike (DreamDDP's control
    schedule): ``schedule_step`` and ``schedule_digest`` name that, and :attr:`plan` covers both.
    """

    step: int
    plan_version: int = 0
    plan_effective_step: int = 0
    plan_digest: int = 0
    schedule_step: int = 0
    schedule_digest: int = 0

    @property
    def since(self) -> int:
        """The step from which every member in step with this one holds the same :attr:`plan` name."""
        return max(self.plan_effective_step, self.schedule_step)

    @property
    def plan(self) -> tuple[int, int, int, int, int]:
        """The name two members compare: equal on members in step, ordered so that the newer one is greater.

        Each part's step comes before its digest, so a member's name only grows as it trains: a member a
        step behind reports the name it held before that step, which orders below ours. Ordered by
        :attr:`since` and then the digests instead, a plan that took effect at the step a control round
        landed (both steps 10) left the digests to order a name one step old against ours, and about every
        other time the member ahead yielded to the one behind (a resync with no cause).
        """
        return (self.plan_version, self.plan_effective_step, self.plan_digest, self.schedule_step, self.schedule_digest)


@dataclass(frozen=True)
class RoundResult:
    group_id: int
    round_id: int
    seconds: float
    bytes_sent: int
    bytes_received: int
    elements: int
    codec: str
    chunk_bytes: int
    contributors: int = 0  # fewest peers whose values entered a segment's mean (refused ones excluded)
    contributed: bool = True
    # the node ids the round ran among, in ring order (empty: not known); a retry of a first run this member
    # gave up after voting commit adds that run's members, who may have applied it (`peer.commit.Undecided`)
    members: tuple[str, ...] = ()


@dataclass(frozen=True)
class RingCodecPlan:
    """Codecs of one ring all-reduce, the same at every member that saw the same bandwidths.

    ``send[i]``: reduce-scatter codec of ring member ``i`` (its link to member ``i + 1``).
    ``gather``: all-gather codec of every segment owner. ``allowed``: every codec a member may receive,
    the base codec first; it depends only on the configuration, not on measurements, so members whose
    measurements differ still agree on it (and on the segment layout derived from its blocks).
    """

    send: tuple[str, ...]
    gather: str
    allowed: tuple[str, ...]
