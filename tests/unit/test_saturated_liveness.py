"""The rules that keep a member in the view through a saturated link, and still drop a gone one (no sockets).

What became of a failed call's connection (`transport.rpcerror.connection_fate`, from gRPC's words as
measured: a refusal, a broken connection, a connection never made), a link's backlog of unacknowledged
round bytes in seconds of goodput (`transport.linkrate.backlog.Backlog`), when our uplink counts as
saturated (`peer.heartbeat.uplink_saturated`), and the membership's rule for a failure it does not count
(`Membership.missed(counted=False)`: only the dead_after_s bound on silence applies).
"""

from __future__ import annotations

import math

import grpc
import pytest
from grpc import aio

from dreamp2p.errors import Connection
from dreamp2p.peer.heartbeat import uplink_saturated
from dreamp2p.peer.membership import Membership
from dreamp2p.transport.linkrate.backlog import Backlog
from dreamp2p.transport.rpcerror import connection_fate, rpc_error

REFUSED = (
    "failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:50777: "
    "Failed to connect to remote host: Connection refused"
)


@pytest.mark.parametrize(
    ("code", "details", "fate"),
    [
        # a killed process: the call in flight, the next one on the stale connection, then the refusal
        (grpc.StatusCode.UNAVAILABLE, "Stream removed (Socket closed)", Connection.BROKEN),
        (grpc.StatusCode.UNAVAILABLE, "Stream removed (sendmsg: Broken pipe (32))", Connection.BROKEN),
        (grpc.StatusCode.UNAVAILABLE, REFUSED, Connection.REFUSED),
        # a live member's control connection starved on a saturated 2 Mbit/s link: our kernel gave it up,
        # or the member's did and answered our next segment with a reset
        (grpc.StatusCode.UNAVAILABLE, "Stream removed (recvmsg:Connection timed out (110))", Connection.BROKEN),
        (grpc.StatusCode.UNAVAILABLE, "Stream removed (sendmsg: Connection timed out (110))", Connection.BROKEN),
        (grpc.StatusCode.UNAVAILABLE, "Stream removed (recvmsg:Connection reset by peer (104))", Connection.BROKEN),
        (grpc.StatusCode.UNAVAILABLE, "GOAWAY received; Error code: 2", Connection.BROKEN),
        # no connection was made: silence, for the heartbeat ticks to count
        (
            grpc.StatusCode.UNAVAILABLE,
            "failed to connect to all addresses; last error: UNKNOWN: ipv4:10.206.9.2:37265: "
            "connection attempt timed out before receiving SETTINGS frame",
            None,
        ),
        (grpc.StatusCode.UNAVAILABLE, "failed to connect to all addresses; No route to host", None),
        # only UNAVAILABLE calls have a fate: a refusal by the member's application is an answer
        (grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded", None),
        (grpc.StatusCode.INVALID_ARGUMENT, "BAD_FRAME: connection refused in the payload", None),
    ],
)
def test_the_fate_of_a_failed_calls_connection(code: grpc.StatusCode, details: str, fate: Connection | None) -> None:
    assert connection_fate(code, details) is fate
    err = rpc_error(aio.AioRpcError(code, aio.Metadata(), aio.Metadata(), details=details))
    assert err.connection is fate and err.grpc_code == code.name


@pytest.mark.parametrize(
    ("adds", "settles", "rate", "seconds"),
    [
        ([], [], 250e3, 0.0),
        ([500_000], [], 250e3, 2.0),  # 0.5 MB on a 2 Mbit/s link
        ([500_000, 250_000], [], 250e3, 3.0),  # two streams on one link
        ([500_000, 250_000], [500_000], 250e3, 1.0),  # one of them acknowledged
        ([500_000], [500_000], math.nan, 0.0),  # nothing pending: no rate needed
        ([500_000], [], math.nan, math.inf),  # bytes wait, the link not measured yet
        ([500_000], [], 0.0, math.inf),
        ([500_000], [900_000], 250e3, 0.0),  # never below empty
        ([64_000_000], [], 12.5e6, 5.12),  # a big round on a 100 Mbit/s link
        ([4_000_000], [], 125e6, 0.032),  # a round on a 1 Gbit/s link: no saturation at any heartbeat
    ],
)
def test_a_backlog_is_its_unacknowledged_bytes_in_seconds_of_goodput(
    adds: list[int], settles: list[int], rate: float, seconds: float
) -> None:
    b = Backlog()
    for n in adds:
        b.add(n)
    for n in settles:
        b.settle(n)
    assert b.seconds(rate) == pytest.approx(seconds)


@pytest.mark.parametrize(
    ("backlogs", "heartbeat_s", "saturated"),
    [
        ([], 1.0, False),  # no links
        ([0.0, 0.0], 1.0, False),
        ([0.2, 0.9], 1.0, False),  # less than an interval on every link
        ([0.2, 1.0], 1.0, True),
        ([0.0, 32.0], 0.25, True),
        ([math.inf], 1.0, True),  # bytes waiting on a link not measured yet
        ([0.1], 0.05, True),
    ],
)
def test_the_uplink_is_saturated_while_a_link_holds_an_interval_of_round_bytes(
    backlogs: list[float], heartbeat_s: float, saturated: bool
) -> None:
    assert uplink_saturated(backlogs, heartbeat_s) is saturated


@pytest.mark.parametrize(
    ("misses", "dead_after_s", "silent_ticks_at", "dead_at"),
    [
        # ticks (at these times) whose failures are not counted: only silence of dead_after_s kills
        (3, 15.0, [1.0, 2.0, 3.0, 4.0, 14.0], None),
        (3, 15.0, [1.0, 2.0, 3.0, 14.9, 15.0], 15.0),
        (1, 4.0, [0.5, 3.9, 4.0], 4.0),
        (3, 2.0, [0.25 * k for k in range(1, 20)], 2.0),
    ],
)
def test_uncounted_failures_only_check_the_bound_on_silence(
    misses: int, dead_after_s: float, silent_ticks_at: list[float], dead_at: float | None
) -> None:
    m = Membership("a", ["a", "b"], misses=misses, dead_after_s=dead_after_s)
    m.start(0.0)
    died = None
    for now in silent_ticks_at:
        if m.missed("b", now, counted=False):
            died = now
    assert died == dead_at
    assert m.is_alive("b") is (dead_at is None)


def test_counted_misses_resume_where_they_were_after_saturation() -> None:
    m = Membership("a", ["a", "b"], misses=3, dead_after_s=100.0)
    m.start(0.0)
    assert not m.missed("b", 1.0)  # one counted miss before the link filled up
    for now in (2.0, 3.0, 4.0, 5.0):
        assert not m.missed("b", now, counted=False)
    assert not m.missed("b", 6.0)  # two
    assert m.missed("b", 7.0)  # three: dead


def test_a_fatal_failure_kills_even_when_not_counted() -> None:
    m = Membership("a", ["a", "b"], misses=3, dead_after_s=100.0)
    m.start(0.0)
    assert m.missed("b", 0.5, fatal=True, counted=False)
    assert m.view() == ("a",)
