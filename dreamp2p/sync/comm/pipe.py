"""The trainer's end of its comm process: start it, send typed messages, resolve replies, notice its death.

`dreamp2p.sync.comm.process.CommProcess` talks through a :class:`ChildPipe`. The child is a fresh interpreter
(``python -m dreamp2p.sync.comm.child FD``) joined by a ``socketpair``: messages are pickled dataclasses
(`dreamp2p.sync.comm.wire`; both ends are our own code), a shared buffer's file descriptor follows its
message as SCM_RIGHTS ancillary data. A reader thread resolves each request's Future; when the socket
closes it fails every pending one, and every later one, with CommProcessError naming the pid and exit
code.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import itertools
import logging
import os
import pickle
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from dreamp2p.sync.comm.wire import CommProcessError, Failure, Init, Reply, ShareBuffer, Started, decode_error

log = logging.getLogger(__name__)

START_TIMEOUT_S = 120.0  # a fresh interpreter importing torch and grpc on a loaded host


class ChildPipe:
    """One comm process and the socket to it; ``on_event`` gets the child's unsolicited messages."""

    def __init__(self, node_id: str, on_event: Callable[[Any], None]) -> None:
        self.node_id = node_id
        self._on_event = on_event
        ours, theirs = socket.socketpair()
        pkg_root = str(Path(__file__).resolve().parents[2])  # the folder holding the dreamp2p package
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [pkg_root, os.environ.get("PYTHONPATH")]))}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "dreamp2p.sync.comm.child", str(theirs.fileno())],
            pass_fds=[theirs.fileno()],
            env=env,
        )
        theirs.close()
        fd = ours.detach()
        self._conn = Connection(fd)
        self._sock = socket.socket(fileno=os.dup(fd))  # the same stream, for passing file descriptors
        self._send_lock = threading.Lock()
        self._pending: dict[int, concurrent.futures.Future[Any]] = {}
        self._pending_lock = threading.Lock()
        self._ids = itertools.count(1)
        self.dead: str | None = None  # why the child is gone, once it is
        self.closing = False
        self._reader = threading.Thread(target=self._read, name=f"dreamp2p-comm-{node_id}", daemon=True)

    def start(self, init: Init) -> Started:
        """Send ``init`` and wait for the child's Started; then start reading replies."""
        self.send(init)
        if not self._conn.poll(START_TIMEOUT_S):
            self.kill()
            raise CommProcessError(f"the comm process of {self.node_id} did not start within {START_TIMEOUT_S:.0f} s")
        try:
            msg = pickle.loads(self._conn.recv_bytes())
        except (EOFError, OSError):
            code = self.proc.wait(10)
            raise CommProcessError(f"the comm process of {self.node_id} exited at start (code {code})") from None
        if isinstance(msg, Failure):
            self.proc.wait(10)
            raise decode_error(msg.error)
        if not isinstance(msg, Started):
            self.kill()
            raise CommProcessError(f"comm process: expected Started, got {type(msg).__name__}")
        self._reader.start()
        return msg

    def send(self, msg: Any, fd: int | None = None) -> None:
        data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        with self._send_lock:
            self._conn.send_bytes(data)
            if fd is not None:  # right behind its message: the child's reader takes it next
                socket.send_fds(self._sock, [b"F"], [fd])

    def request(
        self, make: Callable[[int], Any], fds: Sequence[tuple[ShareBuffer, int]] = ()
    ) -> concurrent.futures.Future[Any]:
        """Send the message ``make(req_id)`` (after any buffers to share) and return its future."""
        fut: concurrent.futures.Future[Any] = concurrent.futures.Future()
        req_id = next(self._ids)
        with self._pending_lock:
            if self.dead is not None:
                fut.set_exception(CommProcessError(self.dead))
                return fut
            self._pending[req_id] = fut
        try:
            for share, fd in fds:
                self.send(share, fd)
            self.send(make(req_id))
        except (OSError, ValueError) as exc:  # the socket is closed: the child is gone
            # say how it went (its exit code), as the reader would on EOF, whichever of the two notices first
            self._fail_all(f"{self._gone()} ({exc})")
        return fut

    def _read(self) -> None:
        """Resolve futures from the child's replies until EOF; then fail every pending one."""
        while True:
            try:
                msg = pickle.loads(self._conn.recv_bytes())
            except (EOFError, OSError):
                break
            if not isinstance(msg, Reply | Failure):
                self._on_event(msg)
                continue
            with self._pending_lock:
                fut = self._pending.pop(msg.req_id, None)
            if fut is None:
                continue
            if isinstance(msg, Reply):
                settle(fut, msg.value)
            else:
                settle(fut, exc=decode_error(msg.error))
        reason = self._gone()
        self._fail_all(reason)
        if not self.closing:
            log.error("%s: every round in flight fails", reason)

    def _gone(self) -> str:
        """Why the child no longer answers: closed by us, its exit code, or a closed socket (it still runs)."""
        try:
            code: int | None = self.proc.wait(5)
        except subprocess.TimeoutExpired:
            code = None
        what = "closed" if self.closing else f"exited (code {code})" if code is not None else "closed its socket"
        return f"the comm process (pid {self.proc.pid}) of {self.node_id} {what}"

    def _fail_all(self, reason: str) -> None:
        with self._pending_lock:
            if self.dead is None:
                self.dead = reason
            pending, self._pending = self._pending, {}
        for fut in pending.values():
            settle(fut, exc=CommProcessError(reason))

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def reap(self, deadline_s: float) -> None:
        """Wait up to ``deadline_s`` for the child to exit, kill it past that, and close our end."""
        self.closing = True
        try:
            self.proc.wait(deadline_s)
        except subprocess.TimeoutExpired:
            log.warning("the comm process (pid %d) did not exit: killing it", self.proc.pid)
            self.kill()
        self._conn.close()
        self._sock.close()
        if self._reader.is_alive():
            self._reader.join(10)


def settle(fut: concurrent.futures.Future[Any], value: Any = None, exc: BaseException | None = None) -> None:
    """Resolve ``fut`` unless its owner cancelled it meanwhile (the reader thread must not die of that)."""
    with contextlib.suppress(concurrent.futures.InvalidStateError):
        if exc is not None:
            fut.set_exception(exc)
        else:
            fut.set_result(value)
