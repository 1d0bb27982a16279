"""Serves a live node's training state to joining members, from snapshots captured between training steps.

The donor is shared by two threads. The peer's asyncio loop answers requests: :meth:`StateDonor.manifest`
raises :attr:`StateDonor.wanted` and waits; the training thread checks ``wanted`` (a plain attribute
read, cheap enough for every step) and, between two steps, calls :meth:`StateDonor.publish`, which
copies, flattens and hashes the state there (where it is consistent) and hands the snapshot to the
waiting requests on their loop. Transfers then read the immutable snapshot by byte ranges
(:meth:`StateDonor.chunks`). At most :data:`KEEP_SNAPSHOTS` snapshots are held, newest last.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from dreamp2p.errors import PeerError, RoundFailed, Status
from dreamp2p.state.snapshot import Snapshot, capture_snapshot
from dreamp2p.statemeta import MAX_RANGE_BYTES

log = logging.getLogger(__name__)

# Snapshots held at once: a transfer still reading the previous one survives one new publication.
KEEP_SNAPSHOTS = 2


class _Held:
    """A snapshot with its bookkeeping (mutated under the donor's lock only)."""

    __slots__ = ("last_used", "published_at", "snapshot")

    def __init__(self, snapshot: Snapshot, now: float) -> None:
        self.snapshot = snapshot
        self.published_at = now
        self.last_used = now


class _Waiter:
    """A request waiting for the next publication, with the loop its future belongs to."""

    __slots__ = ("future", "loop")

    def __init__(self, future: asyncio.Future[Snapshot], loop: asyncio.AbstractEventLoop) -> None:
        self.future = future
        self.loop = loop


def _resolve(future: asyncio.Future[Snapshot], snapshot: Snapshot) -> None:
    if not future.done():  # the request may have timed out or been cancelled meanwhile
        future.set_result(snapshot)


class StateDonor:
    """Snapshots of this node's state, offered to joining members (see the module docstring).

    ``max_age_s`` lets a request be answered at once with a snapshot published that recently (e.g. one a
    daemon publishes at each checkpoint); 0 means every request waits for a publication made after it.
    Snapshots not read for ``expire_s`` seconds are dropped (checked on every call), except static ones.
    """

    def __init__(
        self, max_age_s: float = 0.0, expire_s: float = 600.0, on_wanted: Callable[[bool], None] | None = None
    ) -> None:
        if max_age_s < 0 or expire_s <= 0:
            raise ValueError(f"max_age_s must be >= 0 and expire_s > 0, got {max_age_s} and {expire_s}")
        self.max_age_s = max_age_s
        self.expire_s = expire_s
        self._lock = threading.Lock()
        self._held: collections.deque[_Held] = collections.deque(maxlen=KEEP_SNAPSHOTS)
        self._waiters: list[_Waiter] = []
        self.publications = 0
        self._static = False
        # read by the training thread every step without the lock: a bool assignment is atomic
        self._wanted = False
        # told every change of ``wanted`` (lock held; must not block): a comm process forwards it to the
        # trainer's process, whose training thread reads it there (see `dreamp2p.sync.comm.process`)
        self._on_wanted = on_wanted
        self.bytes_served = 0

    # ------------------------------------------------------------------ training thread

    @property
    def wanted(self) -> bool:
        """True while a request waits for a snapshot: the trainer should :meth:`publish` after this step."""
        return self._wanted

    def offer(self, state: Callable[[], Any], step: int) -> None:
        """Publish ``state()`` of ``step`` if a request waits for one, called between two training steps.

        A state the transfer cannot encode must not stop training: logged, and the joiner's request times
        out. A state with a round whose outcome is not known yet (held by a member that left it behind)
        cannot be captured now: the request stays wanted and a later step offers it.
        """
        if not self.wanted:
            return
        try:
            self.publish(state(), step)
        except (TypeError, ValueError):
            log.exception("cannot offer the training state of step %d to a joining member", step)
        except RoundFailed as exc:
            log.warning("cannot offer the training state of step %d yet: %s", step, exc)

    def publish(self, state: Any, step: int) -> Snapshot:
        """Capture ``state`` (copied, flattened, hashed here) as the newest snapshot and wake waiting requests.

        Safe to call from any thread, also when nobody asked (e.g. at checkpoints). The caller must not
        mutate ``state`` during the call; afterwards the snapshot shares no memory with it.
        """
        t0 = time.perf_counter()
        snapshot = capture_snapshot(state, step, _new_snapshot_id())
        self.install(snapshot)
        log.info(
            "published state snapshot %016x of step %d: %d tensors, %d bytes in %.3f s",
            snapshot.snapshot_id,
            step,
            len(snapshot.manifest.tensors),
            snapshot.manifest.nbytes,
            time.perf_counter() - t0,
        )
        return snapshot

    def install(self, snapshot: Snapshot, static: bool = False) -> None:
        """Hold an already captured ``snapshot`` as the newest and wake the waiting requests.

        :meth:`publish` captures then installs; a comm process installs what its trainer captured.
        ``static``: answer every later request with it at once (see :meth:`serve_static`).
        """
        with self._lock:
            now = time.monotonic()
            self._expire(now)
            self.publications += 1
            self._held.append(_Held(snapshot, now))
            waiters, self._waiters = self._waiters, []
            self._set_wanted(False)
            self._static = self._static or static
        for w in waiters:
            with contextlib.suppress(RuntimeError):  # that loop is closed: nobody is left to answer
                w.loop.call_soon_threadsafe(_resolve, w.future, snapshot)

    def serve_static(self, state: Any, step: int) -> Snapshot:
        """Publish ``state`` once and answer every request with it at once (a node that is not training)."""
        snapshot = self.publish(state, step)
        with self._lock:
            self._static = True
        return snapshot

    def _set_wanted(self, wanted: bool) -> None:
        """Set ``wanted`` (lock held) and tell ``on_wanted`` of a change."""
        if wanted != self._wanted:
            self._wanted = wanted
            if self._on_wanted is not None:
                self._on_wanted(wanted)

    # ------------------------------------------------------------------ event loop

    async def manifest(self, timeout: float) -> Snapshot:
        """The first snapshot published after this request (or one within ``max_age_s``; any, when static).

        A publication whose capture began just before the request also answers it: it is as recent.
        Raises PeerError(TIMEOUT) if the trainer publishes none within ``timeout`` seconds.
        """
        loop = asyncio.get_running_loop()
        now = time.monotonic()
        with self._lock:
            self._expire(now)
            ready = self._ready(now)
            if ready is not None:
                ready.last_used = now
                return ready.snapshot
            waiter = _Waiter(loop.create_future(), loop)
            self._waiters.append(waiter)
            self._set_wanted(True)
        try:
            return await asyncio.wait_for(waiter.future, max(0.0, timeout))
        except TimeoutError:
            raise PeerError(Status.TIMEOUT, f"the trainer published no state snapshot within {timeout:.1f} s") from None
        finally:
            with self._lock:
                if waiter in self._waiters:
                    self._waiters.remove(waiter)
                if not self._waiters:
                    self._set_wanted(False)  # nobody waits any more: spare the trainer a needless copy

    def _ready(self, now: float) -> _Held | None:
        """The newest snapshot that may answer a request made now (lock held)."""
        if not self._held:
            return None
        newest = self._held[-1]
        if self._static or (self.max_age_s > 0 and now - newest.published_at <= self.max_age_s):
            return newest
        return None

    def chunks(
        self, snapshot_id: int, tensor: str, offset: int, length: int, chunk_bytes: int
    ) -> Iterator[tuple[int, memoryview]]:
        """The bytes ``[offset, offset + length)`` of one tensor of one snapshot, as (offset, view) pieces.

        Validates at call time: PeerError NOT_FOUND for an unknown (or expired) snapshot or tensor,
        OVERSIZE for a range over MAX_RANGE_BYTES, BAD_FRAME for an empty or out-of-range request.
        """
        if chunk_bytes <= 0:
            raise ValueError(f"chunk_bytes must be > 0, got {chunk_bytes}")
        now = time.monotonic()
        with self._lock:
            self._expire(now)
            held = next((h for h in self._held if h.snapshot.snapshot_id == snapshot_id), None)
            if held is None:
                raise PeerError(Status.NOT_FOUND, f"state snapshot {snapshot_id:016x} is not (or no longer) held here")
            held.last_used = now
        data = held.snapshot.data.get(tensor)
        if data is None:
            raise PeerError(Status.NOT_FOUND, f"state snapshot {snapshot_id:016x} has no tensor {tensor!r}")
        if length == 0:
            raise PeerError(Status.BAD_FRAME, f"empty byte range requested of tensor {tensor!r}")
        if length > MAX_RANGE_BYTES:
            raise PeerError(Status.OVERSIZE, f"byte range of {length} bytes exceeds {MAX_RANGE_BYTES}")
        if offset + length > len(data):
            raise PeerError(
                Status.BAD_FRAME,
                f"byte range [{offset}, {offset + length}) lies outside tensor {tensor!r} of {len(data)} bytes",
            )
        return self._pieces(data, offset, length, chunk_bytes)

    def _pieces(self, data: memoryview, offset: int, length: int, chunk_bytes: int) -> Iterator[tuple[int, memoryview]]:
        end = offset + length
        while offset < end:
            n = min(chunk_bytes, end - offset)
            self.bytes_served += n
            yield offset, data[offset : offset + n]
            offset += n

    # ------------------------------------------------------------------ housekeeping

    def _expire(self, now: float) -> None:
        """Drop snapshots nobody read for ``expire_s`` (lock held): each one is a full copy of the state."""
        if self._static:
            return
        for held in [h for h in self._held if now - h.last_used > self.expire_s]:
            self._held.remove(held)
            log.info("dropping state snapshot %016x: unused for %.0f s", held.snapshot.snapshot_id, self.expire_s)

    def clear(self) -> None:
        """Drop every snapshot (their memory is freed once transfers still streaming them finish)."""
        with self._lock:
            self._held.clear()
            self._static = False

    @property
    def snapshot_ids(self) -> tuple[int, ...]:
        """Ids of the snapshots held, oldest first."""
        with self._lock:
            return tuple(h.snapshot.snapshot_id for h in self._held)


def _new_snapshot_id() -> int:
    """A random non-zero 63-bit id: unguessable, and fits a signed 64-bit integer too."""
    while True:
        value = secrets.randbits(63)
        if value:
            return value
