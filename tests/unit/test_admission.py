"""Admission's pure decision (`refusal`) and what `Admission` remembers about refused members."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from dreamp2p.errors import PeerError, Status
from dreamp2p.messages import PROTOCOL_VERSION, Hello
from dreamp2p.peer.admission import Admission, refusal

MINE = Hello("c", PROTOCOL_VERSION, "a", b"\x01" * 32, (1, 2, 3), settings=(("period", "10"),))
MEMBERS = {"a", "b"}


def theirs(**changes: Any) -> Hello:
    return dataclasses.replace(MINE, **{"node_id": "b", **changes})


@pytest.mark.parametrize(
    ("hello", "status", "words"),
    [
        (theirs(cluster_id="other"), Status.CLUSTER_MISMATCH, "cluster 'other'"),
        (theirs(protocol_version=PROTOCOL_VERSION + 1), Status.VERSION_MISMATCH, "protocol version"),
        (theirs(manifest_hash=b"\x02" * 32), Status.MANIFEST_MISMATCH, "b's model manifest 0202"),
        (theirs(node_id="x"), Status.UNKNOWN_PEER, "'x' is not a member"),
        (theirs(codecs=(1, 3)), Status.UNKNOWN_CODEC, "cannot decode codec int8"),
        (theirs(settings=(("period", "5"),)), Status.CONFIG_MISMATCH, "period"),
        # the first difference is named: the cluster before the model
        (theirs(cluster_id="other", manifest_hash=b"\x02" * 32), Status.CLUSTER_MISMATCH, "cluster"),
    ],
)
def test_each_difference_is_refused_with_its_status_and_words(hello: Hello, status: Status, words: str) -> None:
    err = refusal(hello, MINE, MEMBERS, 2, "int8")
    assert err is not None and err.status == status and words in err.detail


@pytest.mark.parametrize(
    "hello",
    [theirs(), theirs(settings=()), theirs(advertise_address="10.0.0.2:7000")],  # undeclared settings: not yet
)
def test_a_matching_member_is_accepted(hello: Hello) -> None:
    assert refusal(hello, MINE, MEMBERS, 2, "int8") is None
    assert refusal(hello, MINE, set(), 2, "int8") is None  # no ring configured: any member of the cluster


def test_lasting_refusals_are_remembered_until_the_member_comes_back_matching() -> None:
    adm = Admission()
    with pytest.raises(PeerError) as err:
        adm.admit(theirs(manifest_hash=b"\x02" * 32), MINE, MEMBERS, 2, "int8")
    assert adm.conflict_with("b") is err.value and not adm.is_admitted("b")
    with pytest.raises(PeerError):
        adm.admit(theirs(cluster_id="other"), MINE, MEMBERS, 2, "int8")
    assert adm.conflict_with("b") is err.value  # a wrong cluster is not about this member's model
    adm.admit(theirs(), MINE, MEMBERS, 2, "int8")
    assert adm.conflict_with("b") is None and adm.is_admitted("b") and set(adm.admitted()) == {"b"}
