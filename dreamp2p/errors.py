"""Application status codes and the exceptions that carry them across layers.

`Status` mirrors `dreamp2p.v1.StatusCode` value for value; the transport maps each one to a gRPC status
code (see `dreamp2p.transport.serde`), so a caller always gets both a standard code and a precise reason.
"""

from __future__ import annotations

import enum


class Status(enum.IntEnum):
    UNSPECIFIED = 0
    OK = 1
    BAD_FRAME = 2
    UNKNOWN_CODEC = 3
    STALE_ROUND = 4
    OVERSIZE = 5
    NON_FINITE = 6
    CHECKSUM_MISMATCH = 7
    BAD_TOKEN = 8
    CLUSTER_MISMATCH = 9
    VERSION_MISMATCH = 10
    MANIFEST_MISMATCH = 11
    UNKNOWN_PEER = 12
    TIMEOUT = 13
    SHUTTING_DOWN = 14
    DUPLICATE_CHUNK = 15
    NEEDS_HANDSHAKE = 16
    VIEW_MISMATCH = 17
    NOT_FOUND = 18
    JOINING = 19
    CONFIG_MISMATCH = 20
    IDENTITY_MISMATCH = 21
    ROUND_COMPLETED = 22


class Connection(enum.Enum):
    """What became of the connection under a call that found none (set by the transport, from gRPC's words).

    ``REFUSED``: the member's host answered that nothing listens at its address: its process is gone.
    ``BROKEN``: an established connection ended under the call: reset or closed by the other end (a process
    that died, or one whose kernel gave the connection up), or given up by our own kernel (a connection
    whose segments could not leave for seconds on a saturated link: TCP's probe limit or TCP_USER_TIMEOUT).
    A broken connection alone says nothing about the member's life; the next call, on a new connection, does.
    """

    REFUSED = "refused"
    BROKEN = "broken"


class PeerError(Exception):
    """A refusal with a status: raised where input is rejected, turned into a gRPC error at the edge."""

    def __init__(
        self, status: Status, detail: str, grpc_code: str | None = None, connection: Connection | None = None
    ) -> None:
        # UNSPECIFIED (no application status: the call failed in gRPC, or locally) is no news: the detail alone
        super().__init__(detail if status == Status.UNSPECIFIED else f"{status.name}: {detail}")
        self.status = status
        self.detail = detail
        # the gRPC status code's name when the refusal came back from a call (e.g. "UNAVAILABLE": no
        # connection carried it), so callers branch on a field, never on the message text
        self.grpc_code = grpc_code
        # what became of the connection under an UNAVAILABLE call (see Connection; the transport reads it
        # from gRPC's words); None otherwise, or when the words name neither
        self.connection = connection


class RoundFailed(RuntimeError):
    """An averaging round did not complete; the caller's tensors were left untouched."""

    def __init__(self, key: tuple[int, int] | None, reason: str, status: Status | None = None) -> None:
        where = f"round (group={key[0]}, round={key[1]})" if key is not None else "a round"
        super().__init__(f"{where} failed: {reason}")
        self.key = key  # (group id, round id); None where the caller does not know them
        self.reason = reason
        self.status = status  # a member's refusal that failed it, when one did


class FlushIncomplete(RuntimeError):
    """``flush()`` averaged among fewer members than had trained with us: their replicas differ from ours.

    The members named in ``averaged`` hold identical state (the round completed among them, all-or-none);
    those in ``missing`` left before the flush (closed early, died, or were cut off) and kept their own.
    """

    def __init__(self, averaged: tuple[str, ...], missing: tuple[str, ...]) -> None:
        super().__init__(
            f"flush averaged among {', '.join(averaged)} only; {', '.join(missing)} trained with us but were not in "
            "the flush (left, died or cut off before it): their replicas differ from these"
        )
        self.averaged = averaged
        self.missing = missing
