"""Who is alive: failure detection over the configured members and the view rounds run among.

Pure bookkeeping, no I/O: the peer reports every successful contact (heartbeat answered, frame or vote
received) and every failed one; a member is counted dead after ``misses`` consecutive failed heartbeats
or no contact for ``dead_after_s``, and alive again at its next successful contact. A failed heartbeat the
caller does not count (one sent while this node's own uplink was saturated, see `peer.liveness`) only
checks the ``dead_after_s`` bound, which therefore limits how long any silent member stays in the view.
The view is the live members in configured ring order; rounds carry its :func:`view_id`, so members that
disagree about who is alive find out on the first frame (VIEW_MISMATCH) instead of waiting on a peer that
is gone.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass


def view_id(members: Sequence[str]) -> int:
    """Stable 63-bit id of an ordered member list (0 is reserved for "not checked")."""
    digest = hashlib.sha256("\x00".join(members).encode()).digest()
    return (int.from_bytes(digest[:8], "big") >> 1) or 1


@dataclass
class _State:
    last_ok: float
    misses: int = 0
    dead: bool = False


class Membership:
    """Liveness of the configured members as seen from ``me``."""

    def __init__(self, me: str, members: Sequence[str], *, misses: int = 3, dead_after_s: float = 10.0) -> None:
        if me not in members:
            raise ValueError(f"{me!r} is not one of the members {list(members)}")
        if len(set(members)) != len(members):
            raise ValueError(f"members listed twice: {list(members)}")
        if misses < 1 or dead_after_s <= 0:
            raise ValueError(f"need misses >= 1 and dead_after_s > 0, got {misses}, {dead_after_s}")
        self.me = me
        self.members = tuple(members)
        self.misses = misses
        self.dead_after_s = dead_after_s
        self._state = {m: _State(last_ok=0.0) for m in members if m != me}
        self.changes = 0  # bumped whenever the view changes

    def start(self, now: float) -> None:
        """Everyone is presumed alive at start (the handshake just succeeded)."""
        for st in self._state.values():
            st.last_ok, st.misses, st.dead = now, 0, False

    def heard(self, member: str, now: float, *, revive: bool = True) -> bool:
        """A successful contact. Returns True if this brought the member back to life.

        Contacts the member started (its frames, votes, heartbeats) pass ``revive=False``: they show it
        runs, not that we can reach it, and a ring needs our own calls to it to work; only our heartbeat
        getting through revives a dead member (else one-way reachability makes the view flap).
        """
        st = self._state.get(member)
        if st is None:
            return False
        if st.dead and not revive:
            return False
        st.last_ok = max(st.last_ok, now)
        st.misses = 0
        if st.dead:
            st.dead = False
            self.changes += 1
            return True
        return False

    def missed(self, member: str, now: float, *, fatal: bool = False, counted: bool = True) -> bool:
        """A failed contact (``fatal``: the member is certainly gone, e.g. it refused the connection).

        ``counted`` False: the failure is no evidence (our own link was saturated): it adds no miss, and the
        member dies only if it has been silent for ``dead_after_s``. Returns True if this made the member dead.
        """
        st = self._state.get(member)
        if st is None or st.dead:
            return False
        if counted or fatal:
            st.misses += 1
        if fatal or st.misses >= self.misses or now - st.last_ok >= self.dead_after_s:
            st.dead = True
            self.changes += 1
            return True
        return False

    def is_alive(self, member: str) -> bool:
        if member == self.me:
            return True
        st = self._state.get(member)
        return st is not None and not st.dead

    def view(self) -> tuple[str, ...]:
        """Live members in configured order (always includes ``me``)."""
        return tuple(m for m in self.members if self.is_alive(m))

    def dead(self) -> tuple[str, ...]:
        return tuple(m for m in self.members if not self.is_alive(m))
