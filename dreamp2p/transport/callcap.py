"""Call admission policy: how many calls one connection, one member and everyone else may run here at once,
and which connections handshook as which member.

Pure accounting, no gRPC: the servicer (`transport.server`) names a call by its connection (gRPC's
``context.peer()``, e.g. ``ipv4:10.0.0.2:51234``) and by the member that connection handshook as, and asks
`CallSlots` for a slot before the handler runs. Every admitted member has ``reserved_per_member`` slots
that nothing else can take, so its own frames, votes and heartbeats get through while a hostile caller
(holding the token) fills the shared pool; one connection and one member are each capped well below the
server's total. `ConnectionBindings` remembers which connections handshook as which member, so a frame or
a vote counts only from a connection that introduced itself under the id it claims.
Used from the server's event loop only (no locking).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from dreamp2p.config import TransportConfig
from dreamp2p.errors import PeerError, Status

# Connections remembered per member (a member reconnects, or a restarted one comes back): oldest forgotten.
MAX_CONNECTIONS_PER_MEMBER = 16


@dataclass(frozen=True)
class CallLimits:
    """The caps `CallSlots` enforces; see the `transport.max_calls*` knobs in `TransportConfig`."""

    shared: int  # calls at once outside the members' reservations, all callers together
    per_connection: int  # calls at once from one connection
    per_member: int  # calls at once attributed to one member, across its connections
    reserved_per_member: int  # of those, how many only that member's own connections may use

    def __post_init__(self) -> None:
        for name in ("shared", "per_connection", "per_member"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if not 0 <= self.reserved_per_member <= self.per_member:
            raise ValueError(f"reserved_per_member must be in 0..{self.per_member}, got {self.reserved_per_member}")

    @staticmethod
    def of(t: TransportConfig) -> CallLimits:
        return CallLimits(t.max_calls, t.max_calls_per_connection, t.max_calls_per_member, t.reserved_calls_per_member)


@dataclass(frozen=True)
class Ticket:
    """One admitted call: where it came from and which pool it took its slot from."""

    connection: str
    member: str | None
    shared: bool


class CallSlots:
    """Counts running calls per connection, per member and in the shared pool; refuses beyond the limits."""

    def __init__(self, limits: CallLimits) -> None:
        self.limits = limits
        self._by_connection: dict[str, int] = {}
        self._by_member: dict[str, int] = {}
        self.shared = 0  # calls holding a shared slot now
        self.peak_shared = 0
        self.peak_per_connection = 0
        self.refused = 0

    def running(self, connection: str) -> int:
        return self._by_connection.get(connection, 0)

    def running_for(self, member: str) -> int:
        return self._by_member.get(member, 0)

    def acquire(self, connection: str, member: str | None) -> Ticket:
        """A slot for a call from ``connection`` (which handshook as ``member``, or None); OVERSIZE when full."""
        lim = self.limits
        conn = self._by_connection.get(connection, 0)
        if conn >= lim.per_connection:
            self.refused += 1
            raise PeerError(
                Status.OVERSIZE,
                f"connection {connection} already runs {conn} calls here, the most one connection may "
                f"(transport.max_calls_per_connection)",
            )
        mine = self._by_member.get(member, 0) if member is not None else 0
        if member is not None and mine >= lim.per_member:
            self.refused += 1
            raise PeerError(
                Status.OVERSIZE,
                f"member {member!r} already runs {mine} calls here, the most one member may "
                f"(transport.max_calls_per_member)",
            )
        shared = member is None or mine >= lim.reserved_per_member
        if shared and self.shared >= lim.shared:
            self.refused += 1
            raise PeerError(
                Status.OVERSIZE,
                f"this node already runs {self.shared} calls besides its members' reserved ones (transport.max_calls)",
            )
        self._by_connection[connection] = conn + 1
        self.peak_per_connection = max(self.peak_per_connection, conn + 1)
        if member is not None:
            self._by_member[member] = mine + 1
        if shared:
            self.shared += 1
            self.peak_shared = max(self.peak_shared, self.shared)
        return Ticket(connection, member, shared)

    def release(self, ticket: Ticket) -> None:
        """Give back the slot of an admitted call (once)."""
        _drop(self._by_connection, ticket.connection)
        if ticket.member is not None:
            _drop(self._by_member, ticket.member)
        if ticket.shared:
            if self.shared <= 0:
                raise ValueError("released a shared slot that was not held")
            self.shared -= 1


def _drop(counts: dict[str, int], key: str) -> None:
    left = counts.get(key, 0) - 1
    if left < 0:
        raise ValueError(f"released a slot of {key!r} that was not held")
    if left:
        counts[key] = left
    else:
        del counts[key]


class ConnectionBindings:
    """Which connections handshook as which member (a connection may carry several, as a test client does)."""

    def __init__(self, max_per_member: int = MAX_CONNECTIONS_PER_MEMBER) -> None:
        if max_per_member <= 0:
            raise ValueError(f"max_per_member must be > 0, got {max_per_member}")
        self.max_per_member = max_per_member
        self._of_member: dict[str, OrderedDict[str, None]] = {}
        self._of_connection: dict[str, set[str]] = {}

    def bind(self, member: str, connection: str) -> None:
        """``connection`` handshook as ``member`` (accepted): calls from it may claim that id."""
        conns = self._of_member.setdefault(member, OrderedDict())
        conns[connection] = None
        conns.move_to_end(connection)
        self._of_connection.setdefault(connection, set()).add(member)
        while len(conns) > self.max_per_member:
            old, _ = conns.popitem(last=False)
            members = self._of_connection.get(old, set())
            members.discard(member)
            if not members:
                self._of_connection.pop(old, None)

    def known(self, member: str) -> bool:
        """Whether some connection handshook as ``member`` here."""
        return member in self._of_member

    def bound(self, member: str, connection: str) -> bool:
        return connection in self._of_member.get(member, ())

    def member_of(self, connection: str) -> str | None:
        """The one member ``connection`` handshook as; None for none or several."""
        members = self._of_connection.get(connection)
        if members is None or len(members) != 1:
            return None
        return next(iter(members))

    def refusal(self, member: str, connection: str, what: str) -> PeerError | None:
        """Why ``what`` (a frame, a vote) claiming ``member`` may not count from ``connection`` (None: it may).

        A member no connection handshook as is not refused here: the peer refuses it for its admission.
        """
        if not self.known(member) or self.bound(member, connection):
            return None
        return PeerError(
            Status.NEEDS_HANDSHAKE,
            f"{what} claims node id {member!r}, but connection {connection} has not handshaken as it",
        )
