"""The messages between a trainer and its comm process, how errors cross, and the shared-buffer registry.

Pure parts of `dreamp2p.sync.comm.process` (no I/O). Messages are small frozen dataclasses pickled over a
local socket between our own two processes (never peer data). A round's tensors never travel in them:
flat group buffers live in shared memory and are named by a buffer id, each handed to the child once.
Exceptions are sent as :class:`ErrorInfo` and rebuilt as the same types (PeerError with its status,
RoundFailed with its key), because pickling them by their ``args`` would lose those fields.
"""

from __future__ import annotations

import collections
import functools
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch

from dreamp2p.collective.ring import RoundAborted
from dreamp2p.config import PeerConfig
from dreamp2p.errors import PeerError, RoundFailed, Status
from dreamp2p.messages import RingCodecPlan, TrainingInfo
from dreamp2p.state.fetch import StateTransferError
from dreamp2p.statemeta import StateManifest


class CommProcessError(RuntimeError):
    """The comm process is gone (crashed, killed or closed) or raised an error of no known type."""


# ---------------------------------------------------------------------------------------------- parent -> child


@dataclass(frozen=True)
class Init:
    """First message: the peer to start. ``ready=False`` for a joiner (see Peer.ready)."""

    config: PeerConfig
    ready: bool
    log_level: int
    # how the node's own log looks ("text" or "json", with its ids; `dreamp2p.logformat.root_format`): the
    # child writes the same; None: the node's logging is the library user's, the child keeps plain lines
    log_format: tuple[str, str, str] | None = None


@dataclass(frozen=True)
class ShareBuffer:
    """A flat fp32 buffer in shared memory; its storage's file descriptor follows on the socket."""

    buf_id: int
    storage_bytes: int
    offset: int  # in elements, within the storage
    numel: int


@dataclass(frozen=True)
class ForgetBuffer:
    buf_id: int


@dataclass(frozen=True)
class AllReduce:
    """Average buffer ``source`` into buffer ``out`` (see Peer.allreduce)."""

    req_id: int
    source: int
    out: int
    group_id: int
    codec: str | RingCodecPlan | None
    plan_version: int
    round_id: int | None
    guard_norm: bool
    error_feedback: bool


# What a Call may ask of the child's peer; anything else is refused there.
CALL_OPS = frozenset(
    {
        "connect",
        "agree",
        "members",
        "ring_ids",
        "address",
        "links",
        "view_changes",
        "set_state_donor",
        "set_resume_steps",
        "ask_in",
        "admit_from",
        "stand_aside",
        "begin_drain",
        "member_status",
        "fetch_state",
        "status",
        "abort_rounds",
        "set_rate_limit",
        "cpu_seconds",
        "close",
    }
)


@dataclass(frozen=True)
class Call:
    """One of :data:`CALL_OPS` with its arguments; answered by a Reply or a Failure of ``req_id``."""

    req_id: int
    op: str
    args: tuple[Any, ...] = ()

    def __post_init__(self) -> None:
        if self.op not in CALL_OPS:
            raise ValueError(f"unknown comm process call {self.op!r}; known: {', '.join(sorted(CALL_OPS))}")


@dataclass(frozen=True)
class SetTrainingInfo:
    """Fire and forget, once per step."""

    info: TrainingInfo


@dataclass(frozen=True)
class DonorSnapshot:
    """A state snapshot the trainer captured, for the child's donor to serve (only sent on joins)."""

    manifest: StateManifest
    data: dict[str, bytes]
    static: bool = False


@dataclass(frozen=True)
class DonorClear:
    pass


# ---------------------------------------------------------------------------------------------- child -> parent


@dataclass(frozen=True)
class Started:
    port: int
    pid: int


@dataclass(frozen=True)
class ErrorInfo:
    """An exception as data: its kind, message and the fields the kind carries."""

    kind: str
    message: str
    status: int = 0
    detail: str = ""
    grpc_code: str | None = None
    key: tuple[int, int] | None = None
    reason: str = ""
    failures: tuple[tuple[str, int, str], ...] = field(default=())


@dataclass(frozen=True)
class Reply:
    req_id: int
    value: Any = None


@dataclass(frozen=True)
class Failure:
    req_id: int
    error: ErrorInfo


@dataclass(frozen=True)
class DonorWanted:
    """The child's donor has (or no longer has) a joiner waiting for a snapshot."""

    wanted: bool


@dataclass(frozen=True)
class Leading:
    """The highest step a live member reported to the child's peer changed (`dreamp2p.peer.drift.LeadingStep`)."""

    step: int


@dataclass(frozen=True)
class Diverged:
    """The child's peer stands aside: these live members train with a plan it missed (see Peer.diverged)."""

    members: tuple[str, ...]


# Exceptions rebuilt from their message alone (builtins whose constructor takes it).
_PLAIN: dict[str, type[BaseException]] = {
    t.__name__: t for t in (ValueError, TypeError, RuntimeError, TimeoutError, KeyError, ConnectionError)
}


def encode_error(exc: BaseException) -> ErrorInfo:
    """``exc`` as data (most specific known type first)."""
    if isinstance(exc, StateTransferError):
        fails = tuple((n, int(e.status), e.detail) for n, e in exc.failures.items())
        return ErrorInfo("StateTransferError", str(exc), int(exc.status), exc.detail, exc.grpc_code, failures=fails)
    if isinstance(exc, PeerError):
        return ErrorInfo("PeerError", str(exc), int(exc.status), exc.detail, exc.grpc_code)
    if isinstance(exc, RoundFailed):
        return ErrorInfo("RoundFailed", str(exc), key=exc.key, reason=exc.reason)
    if isinstance(exc, RoundAborted):
        return ErrorInfo("RoundAborted", str(exc))
    kind = type(exc).__name__
    if type(exc) in _PLAIN.values():
        return ErrorInfo(kind, str(exc))
    return ErrorInfo(kind, f"{kind}: {exc}")


def decode_error(info: ErrorInfo) -> BaseException:
    """The exception :func:`encode_error` described; CommProcessError naming the type for unknown kinds."""
    if info.kind == "StateTransferError":
        failures = {n: PeerError(Status(s), d) for n, s, d in info.failures}
        # the detail already names every failure: rebuild without repeating them
        err = StateTransferError(Status(info.status), info.detail, {})
        err.failures = failures
        err.grpc_code = info.grpc_code
        return err
    if info.kind == "PeerError":
        return PeerError(Status(info.status), info.detail, info.grpc_code)
    if info.kind == "RoundFailed":
        return RoundFailed(info.key, info.reason)
    if info.kind == "RoundAborted":
        return RoundAborted(info.message)
    plain = _PLAIN.get(info.kind)
    if plain is not None:
        return plain(info.message)
    return CommProcessError(f"in the comm process: {info.message}")


# ---------------------------------------------------------------------------------------------- buffers


def check_shareable(t: torch.Tensor) -> None:
    """A round buffer must be a flat contiguous fp32 CPU tensor, not pinned (pinned memory cannot be shared)."""
    if t.device.type != "cpu" or t.dtype != torch.float32 or t.dim() != 1 or not t.is_contiguous():
        raise ValueError(
            f"comm = 'process' averages flat contiguous fp32 CPU buffers only, got {t.dtype} {tuple(t.shape)} "
            f"on {t.device}"
        )
    if t.is_pinned():
        raise ValueError("comm = 'process' cannot share pinned host memory (CUDA models): use comm = 'thread'")


class BufferRegistry:
    """Buffer ids of the tensors already handed to the child, by tensor identity.

    A tensor keeps its id while it lives; once it is garbage collected, its id is reported by
    :meth:`take_dead` so the child can drop its mapping (a new tensor at the same address gets a new id).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ids: dict[int, tuple[weakref.ref[torch.Tensor], int]] = {}
        self._next = 1
        # Filled by weakref callbacks, which run wherever the collector happens to run: inside any
        # allocation, on any thread, also in :meth:`lookup` while this thread holds ``_lock``. So they
        # take no lock (a deque's append is atomic); :meth:`take_dead` settles them under the lock.
        self._dead: collections.deque[tuple[int, int]] = collections.deque()

    def lookup(self, t: torch.Tensor) -> tuple[int, bool]:
        """(buffer id, True if the tensor is new and must be shared with the child first)."""
        with self._lock:
            known = self._ids.get(id(t))
            if known is not None and known[0]() is t:
                return known[1], False
            buf_id = self._next
            self._next += 1
            key = id(t)
            self._ids[key] = (weakref.ref(t, functools.partial(self._died, key, buf_id)), buf_id)
            return buf_id, True

    def _died(self, key: int, buf_id: int, _ref: object) -> None:
        self._dead.append((key, buf_id))

    def take_dead(self) -> list[int]:
        """Ids of buffers collected since the last call."""
        dead = []
        with self._lock:
            while self._dead:
                key, buf_id = self._dead.popleft()
                known = self._ids.get(key)
                if known is not None and known[1] == buf_id:
                    del self._ids[key]
                dead.append(buf_id)
        return dead

    def __len__(self) -> int:
        with self._lock:
            return len(self._ids)
