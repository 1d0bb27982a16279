"""The comm process's pure parts: message checks, errors across the process boundary, the buffer registry."""

from __future__ import annotations

import gc
import pickle
import threading

import pytest
import torch

from dreamp2p.collective.ring import RoundAborted
from dreamp2p.config import PeerConfig
from dreamp2p.errors import PeerError, RoundFailed, Status
from dreamp2p.state.fetch import StateTransferError
from dreamp2p.sync.comm.wire import (
    CALL_OPS,
    BufferRegistry,
    Call,
    CommProcessError,
    check_shareable,
    decode_error,
    encode_error,
)


def crossed(exc: BaseException) -> BaseException:
    """``exc`` as the trainer's process gets it: encoded, pickled, unpickled, decoded."""
    return decode_error(pickle.loads(pickle.dumps(encode_error(exc))))


def test_call_refuses_an_unknown_op() -> None:
    with pytest.raises(ValueError, match="unknown comm process call 'exec'"):
        Call(1, "exec", ())
    assert Call(2, "status").op in CALL_OPS


def test_peer_error_keeps_status_detail_and_grpc_code() -> None:
    got = crossed(PeerError(Status.CONFIG_MISMATCH, "period: 5 here, 6 at n1", grpc_code="FAILED_PRECONDITION"))
    assert type(got) is PeerError
    assert isinstance(got, PeerError)
    assert (got.status, got.detail, got.grpc_code) == (
        Status.CONFIG_MISMATCH,
        "period: 5 here, 6 at n1",
        "FAILED_PRECONDITION",
    )
    assert str(got) == "CONFIG_MISMATCH: period: 5 here, 6 at n1"


@pytest.mark.parametrize("key", [(3, 17), None])
def test_round_failed_keeps_key_and_reason(key: tuple[int, int] | None) -> None:
    original = RoundFailed(key, "n2 is not answering")
    got = crossed(original)
    assert type(got) is RoundFailed
    assert isinstance(got, RoundFailed)
    assert (got.key, got.reason, str(got)) == (key, "n2 is not answering", str(original))


def test_state_transfer_error_keeps_each_donors_failure() -> None:
    original = StateTransferError(Status.TIMEOUT, "no donor answered", {"n0": PeerError(Status.JOINING, "joining")})
    got = crossed(original)
    assert isinstance(got, StateTransferError)
    assert got.status == Status.TIMEOUT and str(got) == str(original)
    assert {n: (e.status, e.detail) for n, e in got.failures.items()} == {"n0": (Status.JOINING, "joining")}


@pytest.mark.parametrize("exc", [ValueError("bad"), TimeoutError("late"), RuntimeError("boom"), TypeError("t")])
def test_builtin_errors_keep_type_and_message(exc: BaseException) -> None:
    got = crossed(exc)
    assert type(got) is type(exc) and str(got) == str(exc)


def test_round_aborted_and_unknown_types() -> None:
    assert type(crossed(RoundAborted("cancelled"))) is RoundAborted

    class Odd(Exception):
        pass

    got = crossed(Odd("strange"))
    assert type(got) is CommProcessError
    assert str(got) == "in the comm process: Odd: strange"


def test_registry_gives_a_tensor_one_id_while_it_lives() -> None:
    reg = BufferRegistry()
    a, b = torch.zeros(4), torch.zeros(4)
    id_a, new_a = reg.lookup(a)
    assert new_a and reg.lookup(a) == (id_a, False)
    id_b, new_b = reg.lookup(b)
    assert new_b and id_b != id_a
    assert len(reg) == 2 and reg.take_dead() == []


def test_registry_reports_collected_buffers_once() -> None:
    reg = BufferRegistry()
    keep = torch.zeros(3)
    reg.lookup(keep)
    gone = torch.zeros(3)
    gone_id, _ = reg.lookup(gone)
    del gone
    gc.collect()
    assert reg.take_dead() == [gone_id]
    assert reg.take_dead() == []
    assert len(reg) == 1
    # a new tensor never inherits a dead one's id, even at the same address
    fresh_id, new = reg.lookup(torch.zeros(3))
    assert new and fresh_id != gone_id


@pytest.mark.parametrize(
    ("tensor", "why"),
    [
        (torch.zeros(4, dtype=torch.float64), "fp32"),
        (torch.zeros(2, 2), "flat"),
        (torch.zeros(8)[::2], "contiguous"),
    ],
)
def test_only_flat_fp32_cpu_buffers_are_shared(tensor: torch.Tensor, why: str) -> None:
    with pytest.raises(ValueError, match="flat contiguous fp32 CPU"):
        check_shareable(tensor)


def test_comm_knob_is_validated() -> None:
    assert PeerConfig(node_id="a").comm == "thread"
    assert PeerConfig(node_id="a", comm="process").comm == "process"
    with pytest.raises(ValueError, match="comm must be one of thread, process; got 'proc'"):
        PeerConfig(node_id="a", comm="proc")
    with pytest.raises(ValueError, match="comm must be one of"):
        PeerConfig.from_dict({"node_id": "a", "comm": "fork"})


@pytest.mark.timeout(120)
def test_a_buffer_collected_during_lookup_does_not_deadlock_it() -> None:
    # The cyclic collector may run inside lookup's own allocations (here it runs on nearly every one) and
    # call the weakref callback of a buffer it frees there, on the thread that holds the registry's lock.
    # A launcher thread once hung forever that way, and its trainer with it.
    reg = BufferRegistry()

    class Holder:
        def __init__(self) -> None:
            self.me = self  # a reference cycle: only the collector frees it
            self.t = torch.zeros(2)

    registered: list[int] = []

    def churn() -> None:
        for _ in range(300):
            h = Holder()
            registered.append(reg.lookup(h.t)[0])
            del h

    old = gc.get_threshold()
    gc.set_threshold(1)
    try:
        # on a daemon thread, so a deadlock fails this test (its timeout marker) instead of the whole run
        worker = threading.Thread(target=churn, daemon=True)
        worker.start()
        worker.join()
    finally:
        gc.set_threshold(*old)
    gc.collect()
    assert sorted(reg.take_dead()) == registered
    assert len(reg) == 0
