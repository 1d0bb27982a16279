"""The peer's event loop in a child process (``[node] comm = "process"``): a drop-in for CommThread.

The trainer's process keeps the model, the strategy, its flat group buffers and a reader thread; the
child (`dreamp2p.sync.comm.child`, a fresh interpreter that imports nothing of the model) runs the Peer,
its gRPC server and channels, heartbeats and every round. So the Python half of communication (framing,
codecs, asyncio) no longer takes the trainer's GIL. What crosses the local socket is small typed
messages (`dreamp2p.sync.comm.wire`, sent and answered through `dreamp2p.sync.comm.pipe`); a round's
tensors do not: each group buffer is moved into shared memory (``share_memory_()``, in place, so every
view of it stays valid) and its file descriptor is handed to the child once. ``prepare`` callbacks (a
Python closure, e.g. DreamDDP's pseudo-gradient) run here on a launcher thread, so the training thread
never waits for them. A joiner's request for our state reaches the trainer through :class:`RemoteDonor`;
the snapshot the trainer publishes is shipped to the child as bytes (joins only). A dead child fails
every pending future with CommProcessError at once.
"""

from __future__ import annotations

import concurrent.futures
import logging
import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch

from dreamp2p.config import PeerConfig, PeerInfo
from dreamp2p.logformat import root_format
from dreamp2p.messages import LinkSnapshot, PeerStatus, RingCodecPlan, RoundResult, TrainingInfo
from dreamp2p.state.donor import StateDonor
from dreamp2p.state.fetch import FetchedState
from dreamp2p.state.snapshot import Snapshot
from dreamp2p.sync.comm.pipe import ChildPipe, settle
from dreamp2p.sync.comm.wire import (
    AllReduce,
    BufferRegistry,
    Call,
    CommProcessError,
    Diverged,
    DonorClear,
    DonorSnapshot,
    DonorWanted,
    ForgetBuffer,
    Init,
    Leading,
    SetTrainingInfo,
    ShareBuffer,
    check_shareable,
)
from dreamp2p.sync.model.layers import FlatGroup

log = logging.getLogger(__name__)

CALL_TIMEOUT_S = 60.0  # a plain call the peer answers at once (members, status, ...)


class CommProcess:
    """A started Peer in a child process, with CommThread's methods (see the module docstring)."""

    def __init__(self, config: PeerConfig, ready: bool = True) -> None:
        if not sys.platform.startswith("linux"):
            # buffers travel as shared-memory file descriptors (torch's fd sharing, SCM_RIGHTS)
            raise ValueError(f"comm = 'process' needs Linux, this is {sys.platform}: use comm = 'thread'")
        self.config = config
        self.donor: RemoteDonor | None = None
        self._pipe = ChildPipe(config.node_id, self._event)
        self._closing = False
        self._buffers = BufferRegistry()
        self._diverged: tuple[str, ...] = ()  # set by the child's Diverged, cleared by admit_from
        self._leading = 0  # set by the child's Leading
        started = self._pipe.start(Init(config, ready, logging.getLogger().getEffectiveLevel(), root_format()))
        self.port = started.port
        self.pid = started.pid
        # one FIFO worker: rounds reach the child in launch order, prepare() runs off the training thread
        self._launcher = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix=f"dreamp2p-launch-{config.node_id}"
        )

    def _event(self, msg: Any) -> None:
        """A message of the child's own (on the reader thread)."""
        if isinstance(msg, DonorWanted) and self.donor is not None:
            self.donor._remote_wanted = msg.wanted
        elif isinstance(msg, Diverged):
            self._diverged = msg.members
        elif isinstance(msg, Leading):
            self._leading = msg.step

    def _call(self, op: str, *args: Any, timeout: float | None = CALL_TIMEOUT_S) -> Any:
        return self._pipe.request(lambda rid: Call(rid, op, args)).result(timeout)

    def _share(self, t: torch.Tensor) -> tuple[int, list[tuple[ShareBuffer, int]]]:
        """The buffer id of ``t``, with what to send first when the child does not know it yet."""
        for dead in self._buffers.take_dead():
            self._pipe.send(ForgetBuffer(dead))
        buf_id, new = self._buffers.lookup(t)
        if not new:
            return buf_id, []
        check_shareable(t)
        t.share_memory_()  # in place: views and the strategy's references stay valid
        storage = t.untyped_storage()
        fd, size = storage._share_fd_cpu_()
        return buf_id, [(ShareBuffer(buf_id, int(size), int(t.storage_offset()), t.numel()), int(fd))]

    # ------------------------------------------------------------------ the Collective protocol

    @property
    def node_id(self) -> str:
        return self.config.node_id

    @property
    def round_timeout_s(self) -> float:
        return self.config.transport.round_timeout_s

    @property
    def members(self) -> tuple[str, ...]:
        return tuple(self._call("members"))

    @property
    def world(self) -> int:
        return len(self.members)

    @property
    def rank(self) -> int:
        return self.members.index(self.config.node_id)

    @property
    def ring_ids(self) -> tuple[str, ...]:
        return tuple(self._call("ring_ids"))

    @property
    def address(self) -> str:
        return str(self._call("address"))

    def allreduce_group(
        self,
        group: FlatGroup,
        group_id: int,
        codec: str | RingCodecPlan | None = None,
        plan_version: int = 0,
        round_id: int | None = None,
        guard_norm: bool = True,
        prepare: Callable[[], None] | None = None,
        error_feedback: bool = False,
    ) -> concurrent.futures.Future[RoundResult]:
        """As CommThread.allreduce_group; ``prepare`` runs on the launcher thread of this process."""
        out: concurrent.futures.Future[RoundResult] = concurrent.futures.Future()

        def launch() -> None:
            group.ready()
            if prepare is not None:
                prepare()
            source = group.work if prepare is not None else group.snap
            src_id, shares = self._share(source)
            out_id, more = self._share(group.work)
            fut = self._pipe.request(
                lambda rid: AllReduce(
                    rid, src_id, out_id, group_id, codec, plan_version, round_id, guard_norm, error_feedback
                ),
                shares + more,
            )
            _chain(fut, out)

        try:
            self._launcher.submit(_guarded, launch, out)
        except RuntimeError as exc:  # the launcher is shut down: close() was called
            out.set_exception(CommProcessError(f"the comm process of {self.node_id} is closed ({exc})"))
        return out

    def links(self) -> list[LinkSnapshot]:
        return list(self._call("links"))

    def set_training_info(self, info: TrainingInfo) -> None:
        """Publish our strategy and step; never blocks the training thread (a lost child raises here)."""
        if self._closing:
            return
        if self._pipe.dead is not None:
            raise CommProcessError(self._pipe.dead)
        try:
            self._pipe.send(SetTrainingInfo(info))
        except (OSError, ValueError) as exc:
            raise CommProcessError(f"the comm process of {self.node_id} is gone ({exc})") from None

    def send_donor(self, snapshot: Snapshot | None, static: bool = False) -> None:
        """Hand the child's state donor a snapshot to serve (its bytes copied), or None to clear it."""
        if snapshot is None:
            self._pipe.send(DonorClear())
            return
        data = {name: bytes(view) for name, view in snapshot.data.items()}
        self._pipe.send(DonorSnapshot(snapshot.manifest, data, static))

    # ------------------------------------------------------------------ what Node and the daemon use

    def connect(
        self, ring: Sequence[PeerInfo] | None = None, timeout: float | None = None, require_all: bool = True
    ) -> None:
        self._call("connect", ring, timeout, require_all, timeout=None)

    def agree(self, settings: dict[str, str], timeout: float) -> None:
        self._call("agree", settings, timeout, timeout=timeout + 30)

    @property
    def view_changes(self) -> int:
        """How often the live view changed (see Peer.view_changes)."""
        return int(self._call("view_changes"))

    def set_state_donor(self, donor: StateDonor | None) -> None:
        """Serve our state through ``donor``, a :class:`RemoteDonor` of this CommProcess (or None: serve none)."""
        if donor is None:
            self.donor = None
            self._call("set_state_donor", None)
            return
        if not isinstance(donor, RemoteDonor) or donor.comm is not self:
            raise TypeError("comm = 'process' serves state through a RemoteDonor made for this CommProcess")
        self.donor = donor
        self._call("set_state_donor", (donor.max_age_s, donor.expire_s))

    def set_resume_steps(self, steps: Sequence[int]) -> None:
        self._call("set_resume_steps", tuple(steps))

    def ask_in(self, timeout: float) -> None:
        self._call("ask_in", timeout, timeout=timeout + 30)

    def admit_from(self, round_id: int) -> None:
        self._call("admit_from", round_id)
        self._diverged = ()

    @property
    def diverged_from(self) -> tuple[str, ...]:
        """Live members training with a plan we missed (see Peer.diverged), as the child last said."""
        return self._diverged

    @property
    def leading_step(self) -> int:
        """The highest step a live member reported (see `dreamp2p.peer.drift.LeadingStep`), as the child last said."""
        return self._leading

    def begin_drain(self) -> None:
        self._call("begin_drain")

    def stand_aside(self) -> None:
        self._call("stand_aside")

    def member_status(self, node_id: str, timeout: float | None = None) -> PeerStatus:
        status: PeerStatus = self._call("member_status", node_id, timeout=timeout)
        return status

    def fetch_state(self, donors: Sequence[str], timeout: float, manifest_hash: bytes | None = None) -> FetchedState:
        fetched: FetchedState = self._call("fetch_state", tuple(donors), timeout, manifest_hash, timeout=timeout + 30)
        return fetched

    def status(self) -> PeerStatus:
        status: PeerStatus = self._call("status")
        return status

    def abort_rounds(self, reason: str) -> None:
        self._call("abort_rounds", reason)

    def set_rate_limit(self, rate_Bps: float | None) -> None:
        self._call("set_rate_limit", rate_Bps)

    def cpu_seconds(self) -> float:
        """CPU time the comm process has used so far (user + system)."""
        return float(self._call("cpu_seconds"))

    def close(self, grace: float = 2.0) -> None:
        """Close the peer with ``grace`` in the child, let it exit, and reap it (killed past a deadline)."""
        if self._closing:
            return
        self._closing = True
        self._launcher.shutdown(wait=True, cancel_futures=True)
        try:
            if self._pipe.dead is None:
                self._pipe.closing = True
                self._call("close", grace, timeout=grace + 30)
        except (CommProcessError, TimeoutError) as exc:
            log.warning("closing the comm process of %s: %s", self.node_id, exc)
        finally:
            self._pipe.reap(grace + 10)


class RemoteDonor(StateDonor):
    """The trainer-side face of the comm process's state donor.

    ``wanted`` mirrors the child's donor (it tells every change); :meth:`publish` captures the state here,
    between two steps as always, and ships the snapshot's bytes to the child, which serves it.
    """

    def __init__(self, comm: CommProcess, max_age_s: float = 0.0, expire_s: float = 600.0) -> None:
        super().__init__(max_age_s, expire_s)
        self.comm = comm
        self._remote_wanted = False  # set by the comm reader thread: a bool assignment is atomic
        self._static_next = False

    @property
    def wanted(self) -> bool:
        return self._remote_wanted

    def install(self, snapshot: Snapshot, static: bool = False) -> None:
        self._remote_wanted = False
        self.publications += 1
        self.comm.send_donor(snapshot, static or self._static_next)

    def serve_static(self, state: Any, step: int) -> Snapshot:
        self._static_next = True
        try:
            return self.publish(state, step)  # captures, then ships through install()
        finally:
            self._static_next = False

    def clear(self) -> None:
        self.comm.send_donor(None)

    async def manifest(self, timeout: float) -> Snapshot:
        raise RuntimeError("a RemoteDonor's snapshots are served by the comm process")


def _guarded(fn: Callable[[], None], out: concurrent.futures.Future[Any]) -> None:
    """Run ``fn`` on the launcher; an exception it raises (prepare's, or a gone child's) fails ``out``."""
    try:
        fn()
    except BaseException as exc:
        settle(out, exc=exc)


def _chain(src: concurrent.futures.Future[Any], dst: concurrent.futures.Future[Any]) -> None:
    def copy(f: concurrent.futures.Future[Any]) -> None:
        exc = f.exception()
        settle(dst, None if exc is not None else f.result(), exc)

    src.add_done_callback(copy)
