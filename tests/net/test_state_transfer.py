"""State transfer to joining members: pure encoding, the donor's thread hand-off, and real gRPC transfers.

Integration tests run real :class:`~dreamp2p.peer.Peer` servers on 127.0.0.1 (token-authenticated): donor
peers serve states through :class:`~dreamp2p.state.donor.StateDonor`, and a joiner peer that handshook
with them pulls the state with :func:`~dreamp2p.state.fetch.fetch_state`.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hashlib
import logging
import math
import struct
import threading
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

import grpc
import pytest
import torch
from grpc import aio
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from dreamp2p import statemeta as meta
from dreamp2p.config import PeerConfig, PeerInfo, TransportConfig
from dreamp2p.errors import PeerError, Status
from dreamp2p.peer import Peer
from dreamp2p.state.donor import KEEP_SNAPSHOTS, StateDonor
from dreamp2p.state.fetch import FetchedState, StateTransferError, fetch_state
from dreamp2p.state.snapshot import (
    DTYPES,
    ChecksumMismatch,
    StateManifest,
    TensorMeta,
    capture_snapshot,
    flatten_state,
    skeleton_tensor_names,
    tensor_from_bytes,
    tensor_to_bytes,
    unflatten_state,
)
from dreamp2p.transport import serde
from dreamp2p.transport.auth import token_metadata
from dreamp2p.transport.client import Link
from dreamp2p.v1 import peer_pb2 as pb

TOKEN = "state-secret"
MANIFEST = hashlib.sha256(b"test model").digest()
FAST = TransportConfig(probe_interval_s=60.0, heartbeat_s=0.0, rpc_deadline_s=5.0, connect_timeout_s=5.0)


# ---------------------------------------------------------------------------------------------- helpers


def same(a: Any, b: Any) -> bool:
    """Bitwise equality of two states: exact types, tensors byte for byte, floats bit for bit."""
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        if a.dtype != b.dtype or a.shape != b.shape:
            return False
        return torch.equal(_raw(a), _raw(b))
    if isinstance(a, float):
        return struct.pack(">d", a) == struct.pack(">d", b)
    if isinstance(a, dict):
        if getattr(a, "_metadata", None) != getattr(b, "_metadata", None):
            return False
        return (
            list(a) == list(b)
            and all(type(k) is type(k2) for k, k2 in zip(a, b, strict=True))
            and all(same(a[k], b[k]) for k in a)
        )
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def _raw(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


def model_state(seed: int, step: int, big: int = 0) -> dict[str, Any]:
    """A trainer's state: model, Adam state after one step, plan and data position; ``big`` adds 256 KiB tensors."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(5, 8)).pow(2).sum().backward()
    opt.step()
    g = torch.Generator().manual_seed(seed)
    return {
        "strategy": "dreamddp",
        "step": step,
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "extra": {
            "plan": {"format": "plan/1", "version": 3, "syncs": [{"iteration": 1, "layers": [0, 2]}], "bw": math.nan},
            "outer": {0: (torch.randn(4, generator=g), torch.zeros(4)), 2: (torch.randn(2, generator=g), None)},
            "changed": 1,
        },
        "data": {"epoch": 2, "offset": 12345 + seed, "seed": -1},
        "big": [torch.randn(64 << 10, generator=g) for _ in range(big)],
    }


def named(state: Any) -> dict[str, torch.Tensor]:
    return dict(flatten_state(state)[1])


def peer_config(node_id: str) -> PeerConfig:
    return PeerConfig(node_id=node_id, token=TOKEN, manifest_hash=MANIFEST, transport=FAST)


@contextlib.asynccontextmanager
async def cluster(donors: Sequence[tuple[str, Any]]) -> AsyncIterator[tuple[dict[str, Peer], Peer]]:
    """Donor peers (each with the given donor object, or None) and a joiner "j" handshaken with all of them."""
    peers = {name: Peer(peer_config(name)) for name, _ in donors}
    for (_, donor), peer in zip(donors, peers.values(), strict=True):
        peer.set_state_donor(donor)
        if isinstance(donor, DyingDonor):
            donor.peer = peer
    joiner = Peer(peer_config("j"))
    started: list[Peer] = []
    try:
        for p in [*peers.values(), joiner]:
            await p.start()
            started.append(p)
        ring = [PeerInfo(name, p.address) for name, p in peers.items()] + [PeerInfo("j", joiner.address)]
        await joiner.connect(ring, timeout=5.0)
        yield peers, joiner
    finally:
        await asyncio.gather(*(p.close(grace=0) for p in started), return_exceptions=True)


def links(joiner: Peer, *names: str) -> list[Link]:
    return [joiner.link(n) for n in names]


def static(state: Any, step: int) -> StateDonor:
    donor = StateDonor()
    donor.serve_static(state, step)
    return donor


class TamperingDonor(StateDonor):
    """Serves bytes that differ from the ones it hashed (one bit flipped in every piece)."""

    def chunks(
        self, snapshot_id: int, tensor: str, offset: int, length: int, chunk_bytes: int
    ) -> Iterator[tuple[int, memoryview]]:
        for at, data in super().chunks(snapshot_id, tensor, offset, length, chunk_bytes):
            bad = bytearray(data)
            bad[0] ^= 0x01
            yield at, memoryview(bytes(bad))


class DyingDonor(StateDonor):
    """Serves ``pieces`` pieces, then its whole peer shuts down (a donor process dying mid-transfer)."""

    def __init__(self, pieces: int) -> None:
        super().__init__()
        self.left = pieces
        self.peer: Peer | None = None
        self.killed: asyncio.Task[None] | None = None

    def chunks(
        self, snapshot_id: int, tensor: str, offset: int, length: int, chunk_bytes: int
    ) -> Iterator[tuple[int, memoryview]]:
        pieces = super().chunks(snapshot_id, tensor, offset, length, chunk_bytes)
        return self._until_dead(pieces)

    def _until_dead(self, pieces: Iterator[tuple[int, memoryview]]) -> Iterator[tuple[int, memoryview]]:
        for piece in pieces:
            if self.left <= 0:
                if self.killed is None and self.peer is not None:
                    self.killed = asyncio.ensure_future(self.peer.close(grace=0))
                return
            self.left -= 1
            yield piece


# ---------------------------------------------------------------------------------------------- encoding


ROUND_TRIPS: dict[str, Any] = {
    "trainer state": model_state(0, 7),
    "special floats": [
        math.nan,
        -math.nan,
        math.inf,
        -math.inf,
        -0.0,
        0.0,
        1e308,
        5e-324,
        struct.unpack(">d", bytes.fromhex("7ff8000000000123"))[0],
    ],
    "int and str keys": {0: "int zero", "0": "str zero", -5: None, "a/b%c": 1, "": 2, "\n": 3},
    "tuple vs list": ((1, [2, (3,)]), [(), []]),
    "empty containers": {"d": {}, "l": [], "t": ()},
    "root tensor": torch.arange(6, dtype=torch.int64).reshape(2, 3),
    "scalars": [True, False, None, 0, -(2**63), 2**64 + 1, "ünïcødé \ud800", ""],
    "all dtypes": {name: torch.arange(5).to(dtype) for name, dtype in DTYPES.items()},
    "odd shapes": [torch.zeros(0, 3), torch.tensor(2.5), torch.ones(1, 1, 1, dtype=torch.bfloat16)],
    "non-contiguous": {"t": torch.arange(12.0).reshape(3, 4).t(), "s": torch.arange(10)[::3]},
    "nan payload tensor": torch.tensor([math.nan, -math.inf]).view(torch.int32).add(1).view(torch.float32),
    "batchnorm state_dict": nn.BatchNorm1d(3).state_dict(),  # OrderedDict with per-module _metadata versions
    "plain OrderedDict": collections.OrderedDict([("b", 1), ("a", [collections.OrderedDict()])]),
}


@pytest.mark.parametrize("state", list(ROUND_TRIPS.values()), ids=list(ROUND_TRIPS))
def test_flatten_round_trip_is_exact(state: Any) -> None:
    skeleton, tensors = flatten_state(state)
    assert skeleton.isascii()
    assert skeleton_tensor_names(skeleton) == [n for n, _ in tensors]
    assert same(unflatten_state(skeleton, dict(tensors)), state)
    # and through raw bytes, as on the wire
    snap = capture_snapshot(state, 3, 99)
    rebuilt = {m.name: tensor_from_bytes(m, snap.data[m.name]) for m in snap.manifest.tensors}
    assert same(unflatten_state(snap.manifest.skeleton, rebuilt), state)


def test_tensor_names_are_paths_and_unique() -> None:
    _, tensors = flatten_state({"model": {"0.weight": torch.ones(1)}, 0: torch.ones(1), "0": torch.ones(1)})
    names = [n for n, _ in tensors]
    assert names[0] == "model/0.weight"
    assert len(set(names)) == 3
    _, tensors = flatten_state({"a/b": torch.ones(1), "a": {"b": torch.ones(1)}, "x" * 300: torch.ones(1)})
    names = [n for n, _ in tensors]
    assert names[:2] == ["a%2Fb", "a/b"] and names[2].startswith("tensor#")


def test_capture_copies_the_state() -> None:
    t = torch.zeros(4)
    snap = capture_snapshot({"t": t}, 1, 5)
    t.add_(1)  # the trainer keeps training after publishing
    assert bytes(snap.data["t"]) == bytes(16)
    assert snap.data["t"].readonly


json_leaf = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8),
)


@st.composite
def tensors(draw: st.DrawFn) -> torch.Tensor:
    dtype = draw(st.sampled_from(list(DTYPES.values())))
    shape = tuple(draw(st.lists(st.integers(0, 3), max_size=3)))
    numel = math.prod(shape)
    itemsize = torch.empty((), dtype=dtype).element_size()
    raw = draw(st.binary(min_size=numel * itemsize, max_size=numel * itemsize))
    if dtype == torch.bool:
        raw = bytes(b & 1 for b in raw)
    if not raw:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).reshape(shape)


states = st.recursive(
    st.one_of(json_leaf, tensors()),
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.lists(inner, max_size=4).map(tuple),
        st.dictionaries(st.one_of(st.text(max_size=6), st.integers(-3, 3)), inner, max_size=4),
    ),
    max_leaves=20,
)


@given(states)
@settings(max_examples=200, deadline=None)
def test_any_state_round_trips_bitwise(state: Any) -> None:
    snap = capture_snapshot(state, 1, 1)
    rebuilt = {m.name: tensor_from_bytes(m, snap.data[m.name]) for m in snap.manifest.tensors}
    assert same(unflatten_state(snap.manifest.skeleton, rebuilt), state)


@pytest.mark.parametrize(
    ("state", "match"),
    [
        ({"s": {1, 2}}, "value at s is a set"),
        ({1.5: 1}, "dict key 1.5"),
        ({True: 1}, "dict key True"),
        ([object()], "value at 0 is a object"),
        ({"c": torch.zeros(2, dtype=torch.complex64)}, "dtype torch.complex64"),
        ({"q": torch.zeros(2, dtype=torch.uint16)}, "dtype torch.uint16"),
        ({"sp": torch.eye(2).to_sparse()}, "sparse_coo tensors"),
    ],
)
def test_flatten_refuses_other_types(state: Any, match: str) -> None:
    with pytest.raises(TypeError, match=match):
        flatten_state(state)


def test_flatten_refuses_cycles_and_depth() -> None:
    loop: list[Any] = []
    loop.append(loop)
    with pytest.raises(ValueError, match="nests deeper"):
        flatten_state(loop)


def _skeleton(root: str) -> bytes:
    return ('{"format": "dreamp2p-state/1", "root": ' + root + "}").encode()


@pytest.mark.parametrize(
    ("skeleton", "supplied", "match"),
    [
        (_skeleton('{"tensor": "a"}'), {}, "tensor 'a', which was not supplied"),
        (_skeleton("[1]"), {"a": torch.ones(1)}, "not referenced by the skeleton: 'a'"),
        (_skeleton('[{"tensor": "a"}, {"tensor": "a"}]'), {"a": torch.ones(1)}, "tensor 'a' twice"),
        (b"\xff\xfe", {}, "not UTF-8"),
        (b"{", {}, "not valid JSON"),
        (_skeleton("NaN"), {}, "non-standard JSON constant NaN"),
        (_skeleton("1e999"), {}, "overflows a float"),
        (b'{"format": "other/9", "root": 1}', {}, "format 'other/9'"),
        (b'{"root": 1}', {}, "exactly the keys"),
        (b'{"format": "dreamp2p-state/1", "root": 1, "root": 2}', {}, "repeats key 'root'"),
        (_skeleton('{"set": [1]}'), {}, "tagged with one of"),
        (_skeleton('{"tensor": 5}'), {}, "not a string"),
        (_skeleton('{"float_bits": "3ff0000000000000"}'), {}, "finite number"),
        (_skeleton('{"float_bits": "xyz"}'), {}, "16 lowercase hex digits"),
        (_skeleton('{"dict": [[1]]}'), {}, "not a \\[key, value\\] pair"),
        (_skeleton('{"dict": [[1.5, 0]]}'), {}, "not a string or an integer"),
        (_skeleton('{"dict": [[1, 0], [1, 0]]}'), {}, "repeats key 1"),
        (_skeleton('{"tuple": 3}'), {}, "not a JSON array"),
        (_skeleton("[" * 100 + "]" * 100), {}, "deeper than 64"),
        (_skeleton("[" * 100_000 + "]" * 100_000), {}, "nests too deeply|deeper than 64"),
    ],
)
def test_unflatten_refuses_malformed_skeletons(skeleton: bytes, supplied: dict[str, torch.Tensor], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        unflatten_state(skeleton, supplied)


def test_dtype_table_matches_torch() -> None:
    assert set(meta.DTYPE_ITEMSIZE) == set(DTYPES)
    for name, dtype in DTYPES.items():
        assert torch.empty((), dtype=dtype).element_size() == meta.DTYPE_ITEMSIZE[name]


def _meta(**kw: Any) -> TensorMeta:
    m, _ = tensor_to_bytes("x", torch.arange(6, dtype=torch.float32).reshape(2, 3))
    return TensorMeta(**{**m.__dict__, **kw})


@pytest.mark.parametrize(
    ("bad", "match"),
    [
        (_meta(name=""), "name is empty"),
        (_meta(name="a\nb"), "control characters"),
        (_meta(name="n" * 300), "exceeds 256"),
        (_meta(dtype="complex64"), "dtype 'complex64' is not one of"),
        (_meta(shape=(3, 3)), "do not match shape"),
        (_meta(shape=(-2, -3)), "outside 0"),
        (_meta(shape=(1,) * 40), "40 dimensions"),
        (_meta(sha256=b"\x00" * 31), "31 bytes"),
    ],
)
def test_tensor_meta_is_validated(bad: TensorMeta, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        tensor_from_bytes(bad, bytes(24))


def test_tensor_from_bytes_checks_length_hash_and_bools() -> None:
    m, data = tensor_to_bytes("x", torch.arange(6, dtype=torch.float32))
    with pytest.raises(ValueError, match="got 23 bytes, expected 24"):
        tensor_from_bytes(m, bytes(data)[:-1])
    tampered = bytearray(data)
    tampered[5] ^= 0x10
    with pytest.raises(ChecksumMismatch, match="SHA-256"):
        tensor_from_bytes(m, tampered)
    forged = TensorMeta("b", "bool", (2,), 2, hashlib.sha256(b"\x01\x02").digest())
    with pytest.raises(ValueError, match="other than 0 and 1"):
        tensor_from_bytes(forged, b"\x01\x02")
    out = tensor_from_bytes(m, data)
    assert out.data_ptr() != torch.frombuffer(bytearray(data), dtype=torch.uint8).data_ptr()


# ---------------------------------------------------------------------------------------------- serde


def test_manifest_survives_the_proto_boundary() -> None:
    snap = capture_snapshot(model_state(1, 4), 4, 123)
    wire = serde.state_manifest_to_proto(snap.manifest, MANIFEST).SerializeToString()
    back = serde.state_manifest_from_proto(pb.StateManifest.FromString(wire))
    assert back == StateManifest(123, 4, snap.manifest.skeleton, snap.manifest.tensors, MANIFEST)


def _entry(**kw: Any) -> pb.TensorEntry:
    base: dict[str, Any] = {"name": "w", "dtype": "float32", "shape": [2], "nbytes": 8, "sha256": bytes(32)}
    return pb.TensorEntry(**{**base, **kw})


@pytest.mark.parametrize(
    ("message", "status", "match"),
    [
        (pb.StateManifest(status=pb.STATUS_OK, snapshot_id=0, skeleton=b"x"), Status.BAD_FRAME, "snapshot id 0"),
        (pb.StateManifest(status=pb.STATUS_OK, snapshot_id=1), Status.BAD_FRAME, "skeleton is empty"),
        (pb.StateManifest(status=pb.STATUS_NOT_FOUND, detail="gone"), Status.NOT_FOUND, "gone"),
        (pb.StateManifest(status=pb.STATUS_OK, snapshot_id=1, skeleton=bytes(17 << 20)), Status.OVERSIZE, "skeleton"),
        (
            pb.StateManifest(status=pb.STATUS_OK, snapshot_id=1, skeleton=b"x", manifest_hash=bytes(65)),
            Status.BAD_FRAME,
            "manifest hash",
        ),
        (
            pb.StateManifest(status=pb.STATUS_OK, snapshot_id=1, skeleton=b"x", tensors=[_entry(name="")]),
            Status.BAD_FRAME,
            "name is empty",
        ),
        (
            pb.StateManifest(status=pb.STATUS_OK, snapshot_id=1, skeleton=b"x", tensors=[_entry(dtype="object")]),
            Status.BAD_FRAME,
            "dtype 'object'",
        ),
        (
            pb.StateManifest(status=pb.STATUS_OK, snapshot_id=1, skeleton=b"x", tensors=[_entry(sha256=b"short")]),
            Status.BAD_FRAME,
            "sha256 has 5 bytes",
        ),
        (
            pb.StateManifest(status=pb.STATUS_OK, snapshot_id=1, skeleton=b"x", tensors=[_entry(nbytes=9)]),
            Status.BAD_FRAME,
            "do not match shape",
        ),
        (
            pb.StateManifest(
                status=pb.STATUS_OK, snapshot_id=1, skeleton=b"x", tensors=[_entry(shape=[2**63, 0], nbytes=0)]
            ),
            Status.BAD_FRAME,
            "outside 0",
        ),
        (
            pb.StateManifest(status=pb.STATUS_OK, snapshot_id=1, skeleton=b"x", tensors=[_entry(), _entry()]),
            Status.BAD_FRAME,
            "listed twice",
        ),
    ],
)
def test_malformed_manifests_are_refused(message: pb.StateManifest, status: Status, match: str) -> None:
    with pytest.raises(PeerError, match=match) as err:
        serde.state_manifest_from_proto(message)
    assert err.value.status == status


@pytest.mark.parametrize(
    ("request_kw", "status", "match"),
    [
        ({"snapshot_id": 1, "tensor": "w", "length": 1}, Status.BAD_FRAME, "without a sender"),
        ({"sender": "j", "tensor": "w", "length": 1}, Status.BAD_FRAME, "without a snapshot id"),
        ({"sender": "j", "snapshot_id": 1, "length": 1}, Status.BAD_FRAME, "name is empty"),
        ({"sender": "j", "snapshot_id": 1, "tensor": "w"}, Status.BAD_FRAME, "empty byte range"),
        ({"sender": "j", "snapshot_id": 1, "tensor": "w", "length": (64 << 20) + 1}, Status.OVERSIZE, "per call"),
        ({"sender": "j", "snapshot_id": 1, "tensor": "w", "length": 1, "offset": 2**63}, Status.BAD_FRAME, "beyond"),
        ({"sender": "x" * 300, "snapshot_id": 1, "tensor": "w", "length": 1}, Status.BAD_FRAME, "exceeds 256"),
    ],
)
def test_malformed_range_requests_are_refused(request_kw: dict[str, Any], status: Status, match: str) -> None:
    with pytest.raises(PeerError, match=match) as err:
        serde.state_range_from_proto(pb.StateChunkRequest(**request_kw))
    assert err.value.status == status


@given(st.integers(0, 2**64 - 1), st.binary(max_size=2000))
@settings(max_examples=200, deadline=None)
def test_hand_framed_chunks_are_the_protobuf_encoding(offset: int, data: bytes) -> None:
    wire = serde.state_chunk_to_wire(offset, memoryview(data))
    assert pb.StateChunk.FromString(wire) == pb.StateChunk(offset=offset, data=data)
    assert wire == pb.StateChunk(offset=offset, data=data).SerializeToString()


# ---------------------------------------------------------------------------------------------- donor


def test_chunks_are_precise_about_what_is_missing() -> None:
    donor = static({"w": torch.arange(10, dtype=torch.float32)}, 1)
    (sid,) = donor.snapshot_ids
    pieces = list(donor.chunks(sid, "w", 4, 30, chunk_bytes=8))
    assert [(at, len(mv)) for at, mv in pieces] == [(4, 8), (12, 8), (20, 8), (28, 6)]
    assert b"".join(bytes(mv) for _, mv in pieces) == torch.arange(10, dtype=torch.float32).numpy().tobytes()[4:34]
    cases = [
        ((sid ^ 1, "w", 0, 4), Status.NOT_FOUND, "not \\(or no longer\\) held"),
        ((sid, "v", 0, 4), Status.NOT_FOUND, "no tensor 'v'"),
        ((sid, "w", 38, 4), Status.BAD_FRAME, "outside tensor 'w' of 40 bytes"),
        ((sid, "w", 0, 0), Status.BAD_FRAME, "empty byte range"),
        ((sid, "w", 0, (64 << 20) + 1), Status.OVERSIZE, "exceeds"),
    ]
    for args, status, match in cases:
        with pytest.raises(PeerError, match=match) as err:
            donor.chunks(*args, chunk_bytes=8)
        assert err.value.status == status


def test_donor_keeps_the_newest_snapshots() -> None:
    donor = StateDonor()
    ids = [donor.publish({"s": i}, i).snapshot_id for i in range(KEEP_SNAPSHOTS + 2)]
    assert len(set(ids)) == len(ids) and all(0 < i < 2**63 for i in ids)
    assert donor.snapshot_ids == tuple(ids[-KEEP_SNAPSHOTS:])
    with pytest.raises(PeerError) as err:
        donor.chunks(ids[0], "x", 0, 1, 1)
    assert err.value.status == Status.NOT_FOUND


async def test_manifest_waits_for_a_publication_from_the_training_thread() -> None:
    donor = StateDonor()
    donor.publish({"old": 1}, 1)  # published before the request: too old to answer it
    assert not donor.wanted
    request = asyncio.ensure_future(donor.manifest(timeout=5.0))
    published = threading.Event()

    def trainer() -> None:  # checks `wanted` after every step, as Strategy.step does
        for step in range(2, 1000):
            time.sleep(0.005)
            if donor.wanted:
                donor.publish({"w": torch.full((3,), float(step))}, step)
                published.set()
                return

    thread = threading.Thread(target=trainer)
    thread.start()
    snap = await asyncio.wait_for(request, 5.0)
    thread.join(5.0)
    assert published.is_set() and snap.step > 1
    assert snap.manifest.tensors[0].name == "w"
    assert not donor.wanted  # served: the trainer is not asked again


async def test_manifest_times_out_when_nobody_publishes() -> None:
    donor = StateDonor()
    with pytest.raises(PeerError, match=r"published no state snapshot within 0\.2 s") as err:
        await donor.manifest(timeout=0.2)
    assert err.value.status == Status.TIMEOUT
    assert not donor.wanted  # nobody waits any more


async def test_recent_and_static_snapshots_answer_at_once() -> None:
    donor = StateDonor(max_age_s=60.0)
    snap = donor.publish({"a": 1}, 5)  # e.g. published at a checkpoint
    assert await asyncio.wait_for(donor.manifest(timeout=5.0), 1.0) is snap
    assert not donor.wanted
    fixed = static({"b": 2}, 9)
    assert (await asyncio.wait_for(fixed.manifest(timeout=5.0), 1.0)).step == 9


def test_unread_snapshots_expire() -> None:
    donor = StateDonor(expire_s=0.05)
    donor.publish({"w": torch.ones(2)}, 1)
    time.sleep(0.1)
    donor.publish({"w": torch.ones(2)}, 2)
    assert len(donor.snapshot_ids) == 1


# ---------------------------------------------------------------------------------------------- over gRPC


async def test_single_donor_round_trip_is_bitwise_exact() -> None:
    state = model_state(0, 42)
    async with cluster([("d0", static(state, 42))]) as (_, joiner):
        fetched = await fetch_state(links(joiner, "d0"), timeout=10.0, chunk_bytes=100)
    assert fetched.step == 42
    assert same(fetched.state(), state)
    assert fetched.donors_used == {"d0": fetched.bytes} and fetched.bytes == sum(
        t.nbytes for t in named(state).values()
    )
    # the fetched state loads into a fresh replica
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model.load_state_dict(fetched.state()["model"])
    opt.load_state_dict(fetched.state()["optimizer"])


async def test_several_donors_serve_at_once() -> None:
    states = {"d0": model_state(0, 10, big=3), "d1": model_state(1, 12, big=3), "d2": model_state(2, 11, big=3)}
    donors = [(n, static(s, s["step"])) for n, s in states.items()]
    async with cluster(donors) as (_, joiner):
        fetched = await fetch_state(links(joiner, *states), timeout=10.0, chunk_bytes=64 << 10)
    assert len(fetched.donors_used) >= 2, fetched.donors_used
    assert fetched.step == 12 and fetched.skeleton == flatten_state(states["d1"])[0]  # the most advanced donor
    for name, t in fetched.tensors.items():
        assert same(t, named(states[fetched.sources[name]])[name]), name  # exactly its donor's values


async def test_incompatible_and_foreign_donors_are_ignored() -> None:
    other = {"model": {"w": torch.ones(3, 3)}}
    async with cluster([("d0", static(model_state(0, 5), 5)), ("d1", static(other, 99))]) as (_, joiner):
        # d1 is further ahead but holds another layout: d1 is taken as the reference, d0 is dropped
        fetched = await fetch_state(links(joiner, "d0", "d1"), timeout=10.0)
        assert fetched.step == 99 and set(fetched.donors_used) == {"d1"}
        # a manifest hash that is not ours rules every donor out, precisely
        with pytest.raises(StateTransferError, match="is not ours") as err:
            await fetch_state(links(joiner, "d0", "d1"), timeout=10.0, manifest_hash=b"\x01" * 32)
    assert err.value.status == Status.MANIFEST_MISMATCH and set(err.value.failures) == {"d0", "d1"}


async def test_donor_dying_mid_transfer_is_replaced() -> None:
    states = {"d0": model_state(0, 3, big=6), "d1": model_state(1, 3, big=6)}
    dying = DyingDonor(pieces=5)
    dying.serve_static(states["d0"], 3)
    async with cluster([("d0", dying), ("d1", static(states["d1"], 3))]) as (_, joiner):
        fetched = await fetch_state(links(joiner, "d0", "d1"), timeout=15.0, chunk_bytes=32 << 10)
        assert dying.killed is not None
        await dying.killed
    # every tensor is exact and hash-verified; the dead donor's unfinished tensors came from d1, from scratch
    for name, t in fetched.tensors.items():
        assert same(t, named(states[fetched.sources[name]])[name]), name
    assert "d1" in fetched.sources.values()
    assert fetched.donors_used["d0"] > 0  # it did serve bytes before dying
    assert fetched.bytes > sum(t.nbytes for t in fetched.tensors.values())  # its partial tensor was refetched


async def test_transfer_resumes_on_a_donor_with_the_same_values(caplog: pytest.LogCaptureFixture) -> None:
    state = model_state(0, 3, big=2)
    dying = DyingDonor(pieces=3)
    dying.serve_static(state, 3)
    caplog.set_level(logging.INFO, logger="dreamp2p.state.fetch")
    async with cluster([("d0", dying), ("d1", static(state, 3))]) as (_, joiner):
        fetched = await fetch_state(links(joiner, "d0", "d1"), timeout=15.0, chunk_bytes=16 << 10)
    assert same(fetched.state(), state)
    assert "resuming big/" in caplog.text  # identical hash: the partial tensor continued where it stopped
    assert fetched.bytes == sum(t.nbytes for t in named(state).values())  # nothing fetched twice


async def test_corrupt_donor_is_detected_and_replaced() -> None:
    states = {"d0": model_state(0, 8, big=2), "d1": model_state(1, 8, big=2)}
    bad = TamperingDonor()
    bad.serve_static(states["d0"], 8)
    async with cluster([("d0", bad), ("d1", static(states["d1"], 8))]) as (_, joiner):
        fetched = await fetch_state(links(joiner, "d0", "d1"), timeout=10.0)
        assert set(fetched.sources.values()) == {"d1"}  # nothing d0 sent passed its hash
        assert same(fetched.state()["big"], states["d1"]["big"])
        # with only the corrupt donor, the error says so
        with pytest.raises(StateTransferError, match="SHA-256") as err:
            await fetch_state(links(joiner, "d0"), timeout=10.0)
    assert err.value.status == Status.CHECKSUM_MISMATCH


async def test_a_joiner_asks_again_while_every_donor_trainer_is_busy(caplog: pytest.LogCaptureFixture) -> None:
    """Trainers stuck in a long round publish no snapshot within a manifest call; the joiner asks again until
    one does (within its own deadline) instead of giving up on the first pass."""
    busy = StateDonor()
    state = {"w": torch.arange(6, dtype=torch.float32)}
    caplog.set_level(logging.INFO, logger="dreamp2p.state.fetch")

    def trainer_back_after_a_while() -> None:  # checks `wanted` after every step, as Strategy.step does
        time.sleep(1.5)  # several manifest calls of 0.3 s time out meanwhile
        while not busy.wanted:
            time.sleep(0.01)
        busy.publish(state, 77)

    async with cluster([("d0", busy)]) as (_, joiner):
        thread = threading.Thread(target=trainer_back_after_a_while)
        thread.start()
        fetched = await fetch_state(links(joiner, "d0"), timeout=10.0, rpc_timeout=0.3)
        thread.join(5.0)
        assert fetched.step == 77 and same(fetched.state(), state)
        assert "asking again" in caplog.text
        # the deadline still holds: a donor that never publishes fails the join with TIMEOUT, precisely
        with pytest.raises(StateTransferError, match="no donor offered its state") as err:
            await fetch_state(links(joiner, "d0"), timeout=1.5, rpc_timeout=0.3)
    assert err.value.status == Status.TIMEOUT


async def test_every_donor_failing_gives_a_precise_error() -> None:
    async with cluster([("d0", None), ("d1", StateDonor())]) as (peers, joiner):
        await peers["d1"].close(grace=0)
        with pytest.raises(StateTransferError, match="no donor offered its state") as err:
            await fetch_state(links(joiner, "d0", "d1"), timeout=10.0)
    assert err.value.failures["d0"].status == Status.NOT_FOUND
    assert "does not serve state" in err.value.failures["d0"].detail
    assert err.value.failures["d1"].status in (Status.UNSPECIFIED, Status.SHUTTING_DOWN)


async def test_bad_requests_get_precise_statuses() -> None:
    state = {"w": torch.arange(16, dtype=torch.float32)}
    async with cluster([("d0", static(state, 1)), ("d1", None)]) as (peers, joiner):
        link = joiner.link("d0")
        m = await link.state_manifest(5.0)
        assert m.manifest_hash == MANIFEST and [t.name for t in m.tensors] == ["w"]
        assert await link.fetch_state_range(m.snapshot_id, "w", 60, 4, 5.0) == state["w"].numpy().tobytes()[60:]
        cases = [
            ((m.snapshot_id ^ 1, "w", 0, 4), Status.NOT_FOUND, "NOT_FOUND"),
            ((m.snapshot_id, "v", 0, 4), Status.NOT_FOUND, "NOT_FOUND"),
            ((m.snapshot_id, "w", 60, 8), Status.BAD_FRAME, "INVALID_ARGUMENT"),
            ((m.snapshot_id, "w", 0, 0), Status.BAD_FRAME, "INVALID_ARGUMENT"),
            ((m.snapshot_id, "w", 0, 65 << 20), Status.OVERSIZE, "RESOURCE_EXHAUSTED"),
            ((0, "w", 0, 4), Status.BAD_FRAME, "INVALID_ARGUMENT"),
        ]
        for args, status, code in cases:
            with pytest.raises(PeerError) as err:
                await link.fetch_state_range(*args, timeout=5.0)
            assert err.value.status == status, (args, err.value)
            assert err.value.detail.startswith(code), err.value.detail
        # bytes that are no request at all
        channel = aio.insecure_channel(peers["d0"].address)
        try:
            for method in ("GetStateManifest", "FetchState"):
                call = getattr(channel, "unary_unary" if method == "GetStateManifest" else "unary_stream")
                rpc = call(f"/dreamp2p.v1.Peer/{method}", request_serializer=None, response_deserializer=None)
                with pytest.raises(aio.AioRpcError) as raw:
                    reply = rpc(b"\xff\xff", metadata=token_metadata(TOKEN), timeout=5.0)
                    await (reply if method == "GetStateManifest" else reply.read())
                assert raw.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert (raw.value.details() or "").startswith("BAD_FRAME: malformed State")
        finally:
            await channel.close()
        # a peer without a donor
        with pytest.raises(PeerError, match="does not serve state") as err:
            await joiner.link("d1").state_manifest(5.0)
        assert err.value.status == Status.NOT_FOUND
        # a peer that is joining itself says so at once (no wait for a snapshot it cannot have)
        peers["d0"].stand_aside()
        with pytest.raises(PeerError, match="no training state to give yet") as err:
            await link.state_manifest(5.0)
        assert err.value.status == Status.JOINING  # an answer, not the 5 s deadline (that would be TIMEOUT)
        peers["d0"].admit_from(0)
        # a caller that never handshook (right token, no admission)
        stranger = Link("stranger", PeerInfo("d0", peers["d0"].address), FAST, None, TOKEN)
        try:
            for call in (stranger.state_manifest(5.0), stranger.fetch_state_range(m.snapshot_id, "w", 0, 4, 5.0)):
                with pytest.raises(PeerError, match="has not completed a handshake") as err:
                    await call
                assert err.value.status == Status.UNKNOWN_PEER
        finally:
            await stranger.close()
        # a caller without the token is refused before anything else
        anonymous = Link("j", PeerInfo("d0", peers["d0"].address), FAST, None, None)
        try:
            with pytest.raises(PeerError) as err:
                await anonymous.state_manifest(5.0)
            assert err.value.status == Status.BAD_TOKEN
        finally:
            await anonymous.close()


async def test_fetch_from_a_training_donor() -> None:
    """The joiner's manifest request raises `wanted`; the trainer thread publishes between two steps."""
    donor = StateDonor()
    stop = threading.Event()
    steps: list[int] = []

    def trainer() -> None:
        step = 0
        while not stop.is_set():
            step += 1
            time.sleep(0.002)  # a training step
            if donor.wanted:
                donor.publish(model_state(0, step), step)
                steps.append(step)

    thread = threading.Thread(target=trainer, daemon=True)
    thread.start()
    try:
        async with cluster([("d0", donor)]) as (_, joiner):
            fetched = await fetch_state(links(joiner, "d0"), timeout=10.0)
    finally:
        stop.set()
        thread.join(5.0)
    assert steps == [fetched.step]  # published once, on demand
    assert same(fetched.state(), model_state(0, fetched.step))


async def test_trainer_that_never_publishes_times_out() -> None:
    async with cluster([("d0", StateDonor())]) as (_, joiner):
        with pytest.raises(StateTransferError) as err:
            await fetch_state(links(joiner, "d0"), timeout=10.0, rpc_timeout=0.5)
    assert err.value.status == Status.TIMEOUT
    assert err.value.failures["d0"].status == Status.TIMEOUT  # the donor's manifest call ran out of time


async def test_fetched_state_type() -> None:
    async with cluster([("d0", static({"n": 1}, 0))]) as (_, joiner):
        fetched = await fetch_state(links(joiner, "d0"), timeout=5.0)
    assert isinstance(fetched, FetchedState) and fetched.tensors == {} and fetched.state() == {"n": 1}
    assert fetched.bytes == 0 and fetched.donors_used == {}


async def test_strategy_step_publishes_only_when_wanted() -> None:
    """`Strategy.step` hands the trainer's state to a waiting request between two steps, and only then."""
    from dreamp2p.config.sync import SyncConfig
    from dreamp2p.sync.comm.inprocess import InProcessHub
    from dreamp2p.sync.strategies.baselines import NoSync

    donor = StateDonor()
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    strategy = NoSync(model, torch.optim.Adam(model.parameters()), InProcessHub(1).member(0), SyncConfig(), donor)

    def train(steps: int) -> None:
        for _ in range(steps):
            model(torch.randn(3, 4)).sum().backward()
            strategy.step()

    await asyncio.to_thread(train, 2)
    assert donor.publications == 0  # nobody asked
    request = asyncio.ensure_future(donor.manifest(timeout=5.0))
    await asyncio.sleep(0.01)
    assert donor.wanted
    await asyncio.to_thread(train, 3)
    snap = await asyncio.wait_for(request, 5.0)
    assert donor.publications == 1 and snap.step == 3  # captured after the first step that saw the request
    tensors = {m.name: tensor_from_bytes(m, snap.data[m.name]) for m in snap.manifest.tensors}
    state = unflatten_state(snap.manifest.skeleton, tensors)
    assert state["strategy"] == "none" and state["step"] == 3
    assert set(state["model"]) == {"weight", "bias"} and state["optimizer"]["state"][0]["step"].item() == 3
