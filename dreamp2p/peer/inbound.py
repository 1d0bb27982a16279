"""What members send us: handshakes, data frames, commit votes, probes and broken streams, checked and routed.

The servicer (`transport.server`) calls the `Peer`, which hands each call here. A frame is refused
while the peer shuts down or joins (the gate, `gate`), and from a sender whose handshake this process did not
accept; anything admitted counts as a sign of life (`peer.liveness`), frames go to their round
(`peer.rounds`; one that would wait for its round is first checked by `collective.framecheck`) and
votes to the commit (`peer.commit`). Runs on the peer's event loop only.
"""

from __future__ import annotations

from collections.abc import Callable

from dreamp2p.collective.framecheck import check_early_frame
from dreamp2p.compression import get_codec
from dreamp2p.config import PeerConfig
from dreamp2p.errors import PeerError, Status
from dreamp2p.messages import Frame, Hello, Vote
from dreamp2p.peer.admission import Admission
from dreamp2p.peer.commit import CommitVotes
from dreamp2p.peer.links import RingLinks
from dreamp2p.peer.liveness import Liveness
from dreamp2p.peer.rounds import RoundRegistry

JOINING = "joining: no training state yet, so no part in rounds"


def gate(closing: bool, ready: bool) -> PeerError | None:
    """Why a peer takes no frames now: it shuts down (``closing``), or joins (not ``ready``); None: it does."""
    if closing:
        return PeerError(Status.SHUTTING_DOWN, "peer shutting down")
    return None if ready else PeerError(Status.JOINING, JOINING)


class Inbound:
    """Checks and routes the calls members make on this peer; counts the frames refused."""

    def __init__(
        self,
        config: PeerConfig,
        admission: Admission,
        links: RingLinks,
        live: Liveness,
        rounds: RoundRegistry,
        commits: CommitVotes,
        gate: Callable[[], PeerError | None],
        max_payload: int,
    ) -> None:
        self.config = config
        self.rejected = 0  # frames and calls the servicer refused
        self._admission = admission
        self._links = links
        self._live = live
        self._rounds = rounds
        self._commits = commits
        self._gate = gate  # why this peer takes no frames now (shutting down, joining), or None
        self._max_payload = max_payload  # bytes of one frame's payload, before and after zstd

    def admit(self, hello: Hello, mine: Hello) -> Hello:
        """Accept a member's handshake (PeerError saying why not) and answer with ``mine``."""
        members = {p.node_id for p in (self._links.ring or self.config.ring)}
        self._admission.admit(hello, mine, members, get_codec(self.config.codec).wire_id, self.config.codec)
        self._live.welcome(hello.node_id)  # a restarted member is back in the view within a round trip
        return mine

    async def accept_frame(self, frame: Frame) -> None:
        refused = self._gate()
        if refused is not None:
            raise refused
        self._require_admitted(frame.sender)
        self._live.heard(frame.sender, (frame.group_id, frame.round_id))
        # a frame that would wait for its round is checked as far as it can be without the round's layout
        rnd = await self._rounds.round_for(frame, self._check_early)
        # a frame from another view is refused (VIEW_MISMATCH) without touching the round: its sender's
        # round fails there and that sender's "failed" vote ends ours (a forged frame cannot)
        rnd.deliver(frame)
        self._links.note_received(frame.sender, len(frame.payload))

    def _require_admitted(self, sender: str) -> None:
        """Refuse a frame or vote from a sender whose handshake this process has not accepted."""
        if self._admission.is_admitted(sender):
            return
        if any(p.node_id == sender for p in self._links.ring):
            # a member that handshook with this node's previous process, or not yet with this one: it must
            # introduce itself again (it does so and resends, for frames and votes alike; a vote refused as
            # an unknown sender was lost, and its round waited for it until the deadline)
            raise PeerError(Status.NEEDS_HANDSHAKE, f"ring member {sender!r} has not handshaken with this process")
        raise PeerError(Status.UNKNOWN_PEER, f"sender {sender!r} has not completed a handshake")

    def _check_early(self, frame: Frame) -> None:
        check_early_frame(frame, len(self._links.ring or self.config.ring), self._max_payload)

    def stream_broken(self, sender: str, keys: set[tuple[int, int]], reason: str) -> None:
        """``sender``'s stream of frames broke: its rounds on it fail, and we check at once that it lives."""
        self._rounds.fail_open(f"{sender}: {reason}", lambda key, rnd: key in keys and rnd.spec.predecessor == sender)
        if self._admission.is_admitted(sender):
            self._live.check(sender)

    def vote(self, v: Vote) -> None:
        """A member's outcome of a round: recorded, and a failure ends ours (see `peer.commit`)."""
        self._require_admitted(v.sender)
        key = (v.group_id, v.round_id)
        self._live.heard(v.sender)
        if not v.commit:
            rnd = self._rounds.get(key)
            # whatever view it ran in, a member of ours that gave the round up will not help finish it
            if rnd is not None and v.sender in self._rounds.members_of(key):
                rnd.fail(f"{v.sender} reports the round failed there")
        self._commits.record(v)

    def note_rejected(self, err: PeerError) -> None:
        self.rejected += 1

    def note_probe(self, sender: str, nbytes: int) -> None:
        if self._admission.is_admitted(sender):
            self._live.heard(sender)
        self._links.note_received(sender, nbytes)
