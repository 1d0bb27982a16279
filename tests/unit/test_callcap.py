"""The call policy (`dreamp2p.transport.callcap`): caps per connection, per member, the shared pool, the
members' reserved slots, and which connections may claim which member."""

from __future__ import annotations

from typing import Any

import pytest

from dreamp2p.config import TransportConfig
from dreamp2p.errors import PeerError, Status
from dreamp2p.transport.callcap import CallLimits, CallSlots, ConnectionBindings

LIMITS = CallLimits(shared=4, per_connection=3, per_member=5, reserved_per_member=2)


def test_limits_from_the_transport_config() -> None:
    t = TransportConfig(max_calls=10, max_calls_per_connection=4, max_calls_per_member=6, reserved_calls_per_member=3)
    assert CallLimits.of(t) == CallLimits(10, 4, 6, 3)
    d = CallLimits.of(TransportConfig())
    # one connection and one member are capped well below the server's total
    assert d.per_connection * 4 <= d.shared and d.reserved_per_member <= d.per_member < d.shared


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"max_calls": 0}, "transport.max_calls must be > 0"),
        ({"max_calls_per_connection": 0}, "transport.max_calls_per_connection must be > 0"),
        ({"max_calls_per_member": 0}, "transport.max_calls_per_member must be > 0"),
        ({"first_frame_timeout_s": 0}, "transport.first_frame_timeout_s must be > 0"),
        ({"reserved_calls_per_member": -1}, "transport.reserved_calls_per_member must be in 0..max_calls_per_member"),
        ({"max_calls_per_member": 4, "reserved_calls_per_member": 5}, "must be in 0..max_calls_per_member (4), got 5"),
    ],
)
def test_config_refuses_bad_caps(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        TransportConfig(**fields)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"shared": 0}, "shared must be > 0"),
        ({"per_connection": 0}, "per_connection must be > 0"),
        ({"reserved_per_member": 6}, "reserved_per_member must be in 0..5"),
    ],
)
def test_limits_refuse_bad_values(fields: dict[str, int], message: str) -> None:
    base = {"shared": 4, "per_connection": 3, "per_member": 5, "reserved_per_member": 2}
    with pytest.raises(ValueError, match=message):
        CallLimits(**{**base, **fields})


def _refusal(slots: CallSlots, connection: str, member: str | None) -> str:
    with pytest.raises(PeerError) as info:
        slots.acquire(connection, member)
    assert info.value.status == Status.OVERSIZE
    return info.value.detail


@pytest.mark.parametrize(
    ("taken", "connection", "member", "knob"),
    [
        # a fourth call on one connection, whoever it is
        ([("c1", None)] * 3, "c1", None, "max_calls_per_connection"),
        ([("m1", "p0")] * 3, "m1", "p0", "max_calls_per_connection"),
        # a member's sixth call across its connections
        ([("m1", "p0")] * 3 + [("m2", "p0")] * 2, "m3", "p0", "max_calls_per_member"),
        # strangers share the pool of four
        ([("c1", None)] * 2 + [("c2", None)] * 2, "c3", None, "max_calls"),
        # a member past its two reserved slots draws on the same pool
        ([("c1", None)] * 3 + [("m1", "p0")] * 3, "m2", "p0", "max_calls"),
    ],
)
def test_each_cap_refuses_with_its_knob(
    taken: list[tuple[str, str | None]], connection: str, member: str | None, knob: str
) -> None:
    slots = CallSlots(LIMITS)
    for c, m in taken:
        slots.acquire(c, m)
    assert f"(transport.{knob})" in _refusal(slots, connection, member)
    assert slots.refused == 1


def test_members_keep_their_reserved_slots_when_strangers_fill_the_pool() -> None:
    slots = CallSlots(LIMITS)
    strangers = [slots.acquire(f"c{i}", None) for i in range(4)]
    assert slots.shared == 4
    assert "(transport.max_calls)" in _refusal(slots, "c9", None)
    # each member still gets its two reserved calls, on any of its connections
    for member in ("p0", "p2"):
        mine = [slots.acquire(f"{member}-a", member), slots.acquire(f"{member}-b", member)]
        assert all(not t.shared for t in mine)
        assert "(transport.max_calls)" in _refusal(slots, f"{member}-a", member)
    assert slots.shared == 4 and slots.peak_shared == 4
    for t in strangers:
        slots.release(t)
    assert slots.acquire("p0-a", "p0").shared  # past its reservation: the pool again


def test_release_gives_every_count_back() -> None:
    slots = CallSlots(LIMITS)
    tickets = [slots.acquire("m1", "p0") for _ in range(3)] + [slots.acquire("c1", None)]
    assert [t.shared for t in tickets] == [False, False, True, True]
    assert (slots.running("m1"), slots.running_for("p0"), slots.shared) == (3, 3, 2)
    for t in tickets:
        slots.release(t)
    assert (slots.running("m1"), slots.running_for("p0"), slots.shared) == (0, 0, 0)
    assert slots.peak_per_connection == 3
    with pytest.raises(ValueError, match="not held"):
        slots.release(tickets[0])


def test_a_refused_call_counts_nothing() -> None:
    slots = CallSlots(CallLimits(shared=1, per_connection=1, per_member=1, reserved_per_member=0))
    slots.acquire("c1", None)
    _refusal(slots, "c2", None)
    _refusal(slots, "c1", "p0")
    assert (slots.running("c2"), slots.running_for("p0"), slots.shared) == (0, 0, 1)


def test_bindings_refuse_a_claim_from_another_connection() -> None:
    b = ConnectionBindings()
    assert b.refusal("p0", "ipv4:127.0.0.1:1", "a vote") is None  # nobody handshook as p0: the peer decides
    b.bind("p0", "ipv4:127.0.0.1:1")
    assert b.known("p0") and b.bound("p0", "ipv4:127.0.0.1:1")
    assert b.refusal("p0", "ipv4:127.0.0.1:1", "a vote") is None
    err = b.refusal("p0", "ipv4:127.0.0.1:2", "a vote")
    assert err is not None and err.status == Status.NEEDS_HANDSHAKE
    assert err.detail == "a vote claims node id 'p0', but connection ipv4:127.0.0.1:2 has not handshaken as it"


@pytest.mark.parametrize(
    ("binds", "connection", "member"),
    [
        ([], "c1", None),
        ([("p0", "c1")], "c1", "p0"),
        ([("p0", "c1"), ("p0", "c2")], "c2", "p0"),
        ([("p0", "c1"), ("p2", "c1")], "c1", None),  # several ids on one connection: none is its member
    ],
)
def test_member_of_a_connection(binds: list[tuple[str, str]], connection: str, member: str | None) -> None:
    b = ConnectionBindings()
    for m, c in binds:
        b.bind(m, c)
    assert b.member_of(connection) == member


def test_bindings_keep_the_newest_connections_of_a_member() -> None:
    b = ConnectionBindings(max_per_member=2)
    for c in ("c1", "c2", "c1", "c3"):  # c1 bound again: newer than c2
        b.bind("p0", c)
    assert [c for c in ("c1", "c2", "c3") if b.bound("p0", c)] == ["c1", "c3"]
    assert b.member_of("c2") is None
    with pytest.raises(ValueError):
        ConnectionBindings(max_per_member=0)
