"""The comm process itself: one Peer on one event loop, driven by its trainer over a local socket.

Started by `dreamp2p.sync.comm.process.CommProcess` as ``python -m dreamp2p.sync.comm.child FD`` (a fresh
interpreter: it imports nothing of the model or of the trainer's script). A reader thread turns the
trainer's messages (`dreamp2p.sync.comm.wire`) into work on the loop; every reply is sent from the loop.
Shared buffers arrive as file descriptors right behind their ShareBuffer message. When the trainer's end
of the socket closes (it exited or was killed) the peer is closed with grace and the process exits.
SIGINT and SIGTERM are ignored: only the trainer ends the comm process.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import pickle
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import torch

from dreamp2p.logformat import node_handler
from dreamp2p.peer import Peer
from dreamp2p.state.donor import StateDonor
from dreamp2p.state.fetch import fetch_state
from dreamp2p.state.snapshot import Snapshot
from dreamp2p.sync.comm.thread import _drain_loop
from dreamp2p.sync.comm.wire import (
    AllReduce,
    Call,
    Diverged,
    DonorClear,
    DonorSnapshot,
    DonorWanted,
    Failure,
    ForgetBuffer,
    Init,
    Leading,
    Reply,
    SetTrainingInfo,
    ShareBuffer,
    Started,
    encode_error,
)

log = logging.getLogger(__name__)


class _Child:
    """The peer, the buffers shared with the trainer and the donor serving its snapshots."""

    def __init__(self, conn: Connection, sock: socket.socket, peer: Peer, loop: asyncio.AbstractEventLoop) -> None:
        self.conn = conn
        self.sock = sock
        self.peer = peer
        self.loop = loop
        peer.on_diverged = lambda members: self.send(Diverged(members))
        peer.lead.on_change = lambda step: self.send(Leading(step))
        self.buffers: dict[int, torch.Tensor] = {}
        self.donor: StateDonor | None = None
        self._send_lock = threading.Lock()
        self.done = asyncio.Event()

    def send(self, msg: Any) -> None:
        data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        # the trainer may be gone: the reader then sees EOF and shuts us down
        with self._send_lock, contextlib.suppress(OSError):
            self.conn.send_bytes(data)

    # ------------------------------------------------------------------ reader thread

    def read(self) -> None:
        """Read messages until EOF; runs on its own thread, hands everything to the loop in order."""
        try:
            while True:
                try:
                    msg = pickle.loads(self.conn.recv_bytes())
                    if isinstance(msg, ShareBuffer):
                        tensor = _receive_buffer(self.sock, msg)
                        self.loop.call_soon_threadsafe(self.buffers.__setitem__, msg.buf_id, tensor)
                        continue
                except (EOFError, OSError):
                    log.info("the trainer closed its end: closing the peer")
                    self.loop.call_soon_threadsafe(self._close_soon)
                    return
                self.loop.call_soon_threadsafe(self.dispatch, msg)
        except RuntimeError:  # the loop is closed: we were closed already and are on our way out
            return

    def _close_soon(self) -> None:
        self._start(self._close(2.0, None))

    # ------------------------------------------------------------------ loop

    def _start(self, coro: Any) -> None:
        self.loop.create_task(coro)

    def dispatch(self, msg: Any) -> None:
        if isinstance(msg, AllReduce):
            self._start(self._answer(msg.req_id, self._allreduce(msg)))
        elif isinstance(msg, Call):
            if msg.op == "close":
                self._start(self._close(float(msg.args[0]), msg.req_id))
            else:
                self._start(self._answer(msg.req_id, self._call(msg.op, msg.args)))
        elif isinstance(msg, SetTrainingInfo):
            self.peer.set_training_info(msg.info)
        elif isinstance(msg, ForgetBuffer):
            self.buffers.pop(msg.buf_id, None)
        elif isinstance(msg, DonorSnapshot):
            if self.donor is not None:
                self.donor.install(Snapshot(msg.manifest, {k: memoryview(v) for k, v in msg.data.items()}), msg.static)
        elif isinstance(msg, DonorClear):
            if self.donor is not None:
                self.donor.clear()
        else:
            log.error("unknown message from the trainer: %s", type(msg).__name__)

    async def _answer(self, req_id: int, coro: Any) -> None:
        try:
            value = await coro
        except BaseException as exc:  # every failure goes back to the waiting future, typed
            self.send(Failure(req_id, encode_error(exc)))
            if not isinstance(exc, Exception):
                raise
            return
        self.send(Reply(req_id, value))

    async def _allreduce(self, msg: AllReduce) -> Any:
        source, out = self.buffers.get(msg.source), self.buffers.get(msg.out)
        if source is None or out is None:
            raise RuntimeError(f"round buffers {msg.source}/{msg.out} were never shared with the comm process")
        return await self.peer.allreduce(
            [source],
            msg.group_id,
            msg.codec,
            msg.plan_version,
            out=[out],
            round_id=msg.round_id,
            guard_norm=msg.guard_norm,
            error_feedback=msg.error_feedback,
        )

    async def _call(self, op: str, args: tuple[Any, ...]) -> Any:
        peer = self.peer
        simple: dict[str, Callable[..., Any]] = {
            "members": lambda: peer.view or tuple(p.node_id for p in peer.ring),
            "ring_ids": lambda: tuple(p.node_id for p in peer.ring),
            "address": lambda: peer.address,
            "links": peer.link_snapshots,
            "view_changes": lambda: peer.view_changes,
            "set_resume_steps": peer.set_resume_steps,
            "admit_from": peer.admit_from,
            "stand_aside": peer.stand_aside,
            "begin_drain": peer.begin_drain,
            "status": peer.status,
            "abort_rounds": peer.abort_rounds,
            "set_rate_limit": peer.set_rate_limit,
            "cpu_seconds": time.process_time,
            "set_state_donor": self._set_donor,
        }
        if op in simple:
            return simple[op](*args)
        if op == "connect":
            return await peer.connect(*args)
        if op == "agree":
            return await peer.agree(*args)
        if op == "ask_in":
            return await peer.ask_in(*args)
        if op == "member_status":
            return await peer.link(args[0]).status()
        if op == "fetch_state":
            donors, timeout, manifest_hash = args
            return await fetch_state([peer.link(n) for n in donors], timeout, manifest_hash=manifest_hash)
        raise ValueError(f"comm process: no handler for call {op!r}")

    def _set_donor(self, settings: tuple[float, float] | None) -> None:
        if settings is None:
            self.donor = None
        else:
            max_age_s, expire_s = settings
            self.donor = StateDonor(max_age_s, expire_s, on_wanted=lambda w: self.send(DonorWanted(w)))
        self.peer.set_state_donor(self.donor)

    async def _close(self, grace: float, req_id: int | None) -> None:
        if self.done.is_set():
            return
        try:
            await self.peer.close(grace)
        except Exception as exc:
            log.warning("closing the peer: %s", exc)
        if req_id is not None:
            self.send(Reply(req_id))
        self.done.set()


def _receive_buffer(sock: socket.socket, msg: ShareBuffer) -> torch.Tensor:
    """The shared fp32 buffer whose storage's descriptor follows ``msg`` on ``sock``."""
    _, fds, _, _ = socket.recv_fds(sock, 1, 1)
    if len(fds) != 1:
        raise OSError(f"buffer {msg.buf_id}: expected one file descriptor, got {len(fds)}")
    try:
        storage = torch.UntypedStorage._new_shared_fd_cpu(fds[0], msg.storage_bytes)  # type: ignore[attr-defined]
    finally:
        os.close(fds[0])  # the storage holds its own mapping
    t = torch.empty(0, dtype=torch.float32)
    t.set_(storage, msg.offset, (msg.numel,), (1,))
    return t


async def _serve(conn: Connection, sock: socket.socket, init: Init) -> None:
    loop = asyncio.get_running_loop()
    peer = Peer(init.config)
    peer.ready = peer.in_ring = init.ready  # before the server starts, as in CommThread
    try:
        port = await peer.start()
    except Exception as exc:
        conn.send_bytes(pickle.dumps(Failure(0, encode_error(exc))))
        raise
    child = _Child(conn, sock, peer, loop)
    child.send(Started(port, os.getpid()))
    threading.Thread(target=child.read, name="dreamp2p-comm-reader", daemon=True).start()
    await child.done.wait()
    await _drain_loop(2.0)


def main(fd: int) -> None:
    conn = Connection(fd)
    sock = socket.socket(fileno=os.dup(fd))
    init = pickle.loads(conn.recv_bytes())
    if not isinstance(init, Init):
        raise SystemExit(f"comm process: expected Init first, got {type(init).__name__}")
    if init.log_format is not None:  # the node's own format (JSON or text), stamped with its ids
        kind, node_id, cluster_id = init.log_format
        root = logging.getLogger()
        root.addHandler(node_handler(kind, node_id, cluster_id))
        root.setLevel(init.log_level)
    else:
        logging.basicConfig(
            level=init.log_level,
            format=f"%(asctime)s {init.config.node_id}/comm %(name)s %(levelname)s %(message)s",
        )
    torch.set_num_threads(1)  # the codecs' kernels must not take the trainer's cores
    # Ctrl-C and a process-group SIGTERM (systemd, a terminal) reach us too: the trainer decides when we
    # stop (it may still finish a round and checkpoint), and its death closes our socket anyway
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    asyncio.run(_serve(conn, sock, init))
    # like the node daemon: leave without interpreter teardown, where gRPC's poller threads could crash us
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main(int(sys.argv[1]))
