"""Pulls a training state from live donors: every tensor hash-verified, several donors at once, failures retried.

:func:`fetch_state` asks every donor for its manifest, keeps the donors that agree with the one at the
highest step (same tensor names, dtypes and shapes, same model manifest) and takes the skeleton and step
from that one. Tensors are spread over the donors balanced by bytes and fetched concurrently in byte
ranges; an idle donor also takes queued work from a busier one. Each tensor is verified against the
SHA-256 announced by the donor it came from. Donors hold slightly different values (replicas drift
between syncs), which is fine for a joining replica, but it means a tensor whose donor failed restarts
from scratch on another donor unless that donor announced the very same hash (then it resumes where
the transfer stopped). Completed tensors are always kept. A donor that fails once (gone, refused,
corrupt bytes) gets no further work in this transfer.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from dreamp2p.errors import PeerError, Status
from dreamp2p.state.snapshot import ChecksumMismatch, skeleton_tensor_names, tensor_from_bytes, unflatten_state
from dreamp2p.statemeta import MAX_RANGE_BYTES, StateManifest, TensorMeta
from dreamp2p.transport.client import Link

log = logging.getLogger(__name__)

# Below this much time left, a join does not ask busy donors again (the answer could not arrive in time).
MIN_ASK_AGAIN_S = 2.0
ASK_AGAIN_PAUSE_S = 0.5

# Bytes asked for per FetchState call: large enough to amortize a WAN round trip, small enough to retry.
DEFAULT_RANGE_BYTES = 8 << 20
# Tensors in flight per donor: a second one hides the round trip between the ranges of the first.
TENSORS_PER_DONOR = 2
# How long cancelled transfers get to wind down once the fetch is over.
_CANCEL_GRACE_S = 5.0


@dataclass(frozen=True)
class FetchedState:
    """A state pulled from donors: skeleton and step of the most advanced donor, verified tensors."""

    step: int
    skeleton: bytes
    tensors: dict[str, torch.Tensor]  # in the manifest's order
    donors_used: dict[str, int]  # node id -> bytes received from it (partial tensors included)
    sources: dict[str, str]  # tensor name -> node id of the donor whose (verified) bytes it holds
    bytes: int  # bytes received in all

    def state(self) -> Any:
        """The nested state (as the donor's trainer published it)."""
        return unflatten_state(self.skeleton, self.tensors)


class StateTransferError(PeerError):
    """No state could be fetched; ``failures`` says what happened with each donor."""

    def __init__(self, status: Status, detail: str, failures: dict[str, PeerError]) -> None:
        reasons = "; ".join(f"{node}: {err}" for node, err in failures.items())
        super().__init__(status, f"{detail} ({reasons})" if reasons else detail)
        self.failures = dict(failures)


class _Donor:
    """One donor during one transfer (mutable bookkeeping of the scheduler)."""

    __slots__ = ("failed", "link", "manifest", "metas", "queue", "queued_bytes", "running")

    def __init__(self, link: Link, manifest: StateManifest) -> None:
        self.link = link
        self.manifest = manifest
        self.metas = {t.name: t for t in manifest.tensors}
        self.queue: collections.deque[str] = collections.deque()
        self.queued_bytes = 0
        self.running = 0
        self.failed = False

    @property
    def node_id(self) -> str:
        return self.link.dest.node_id


class _Partial:
    """Bytes of one tensor received so far, and the hash (hence the values) they belong to."""

    __slots__ = ("buf", "done", "sha256", "source")

    def __init__(self, meta: TensorMeta, source: str) -> None:
        self.sha256 = meta.sha256
        self.buf = bytearray(meta.nbytes)
        self.done = 0
        self.source = source


async def fetch_state(
    links: Sequence[Link],
    timeout: float,
    chunk_bytes: int = DEFAULT_RANGE_BYTES,
    *,
    rpc_timeout: float | None = None,
    manifest_hash: bytes | None = None,
    tensors_per_donor: int = TENSORS_PER_DONOR,
) -> FetchedState:
    """Fetch the training state from the peers behind ``links`` (handshaken links to live members).

    ``chunk_bytes`` is the byte range asked for per call. ``timeout`` bounds the whole transfer; each call
    is bounded by ``rpc_timeout`` too (default: the link's ``rpc_deadline_s``; a donor's manifest waits
    for its trainer to publish a snapshot). With ``manifest_hash``, donors of another model are ignored.
    Raises :class:`StateTransferError` when no donor answers, or some tensor could be fetched intact
    from none of them.
    """
    if not links:
        raise ValueError("no donors to fetch the state from")
    if not 0 < chunk_bytes <= MAX_RANGE_BYTES:
        raise ValueError(f"chunk_bytes must be in 1..{MAX_RANGE_BYTES}, got {chunk_bytes}")
    if tensors_per_donor < 1:
        raise ValueError(f"tensors_per_donor must be >= 1, got {tensors_per_donor}")
    loop = asyncio.get_running_loop()
    t0 = time.perf_counter()
    deadline = loop.time() + timeout
    failures: dict[str, PeerError] = {}
    donors = await _manifests(links, deadline, rpc_timeout, manifest_hash, failures)
    while not donors and _all_busy(failures) and deadline - loop.time() > MIN_ASK_AGAIN_S:
        # every trainer is inside a long step (a round that waits for its deadline, e.g. after a healed
        # partition): a snapshot comes once it ends, which may take up to a round's deadline
        log.info("no donor has published a state snapshot yet (their trainers are busy): asking again")
        failures.clear()
        await asyncio.sleep(ASK_AGAIN_PAUSE_S)
        donors = await _manifests(links, deadline, rpc_timeout, manifest_hash, failures)
    if not donors:
        raise StateTransferError(_common_status(failures), "no donor offered its state", failures)
    ref = max(donors, key=lambda d: d.manifest.step)  # the first of the most advanced donors
    live: list[_Donor] = []
    for d in donors:
        mismatch = _incompatibility(ref.manifest, d.manifest)
        if mismatch:
            log.warning("not fetching state from %s: %s than %s", d.node_id, mismatch, ref.node_id)
            failures[d.node_id] = PeerError(Status.MANIFEST_MISMATCH, f"{mismatch} than {ref.node_id}")
        else:
            live.append(d)
    transfer = _Transfer(live, ref, deadline, chunk_bytes, rpc_timeout, tensors_per_donor, failures)
    tensors = await transfer.run()
    received = {node: n for node, n in transfer.received.items() if n}
    total = sum(received.values())
    log.info(
        "fetched state of step %d: %d tensors, %d bytes from %s in %.2f s",
        ref.manifest.step,
        len(tensors),
        total,
        ", ".join(f"{node} ({n} B)" for node, n in received.items()) or "nobody (no tensor bytes)",
        time.perf_counter() - t0,
    )
    return FetchedState(
        step=ref.manifest.step,
        skeleton=ref.manifest.skeleton,
        tensors=tensors,
        donors_used=received,
        sources=transfer.sources,
        bytes=total,
    )


async def _manifests(
    links: Sequence[Link],
    deadline: float,
    rpc_timeout: float | None,
    manifest_hash: bytes | None,
    failures: dict[str, PeerError],
) -> list[_Donor]:
    """Every donor that answered with a usable manifest (the others are recorded in ``failures``)."""
    loop = asyncio.get_running_loop()

    async def ask(link: Link) -> StateManifest:
        limit = min(deadline - loop.time(), rpc_timeout if rpc_timeout is not None else link.cfg.rpc_deadline_s)
        if limit <= 0:
            raise PeerError(Status.TIMEOUT, "no time left to ask for the manifest")
        manifest = await asyncio.wait_for(link.state_manifest(limit), limit + 1.0)  # gRPC's deadline fires first
        if manifest_hash is not None and manifest.manifest_hash != manifest_hash:
            raise PeerError(
                Status.MANIFEST_MISMATCH,
                f"model manifest {manifest.manifest_hash.hex()[:16]} is not ours ({manifest_hash.hex()[:16]})",
            )
        try:
            names = skeleton_tensor_names(manifest.skeleton)
        except ValueError as exc:
            raise PeerError(Status.BAD_FRAME, f"malformed state skeleton: {exc}") from None
        if sorted(names) != sorted(t.name for t in manifest.tensors):
            raise PeerError(Status.BAD_FRAME, "the state skeleton and the manifest list different tensors")
        return manifest

    answers = await asyncio.gather(*(ask(link) for link in links), return_exceptions=True)
    donors = []
    for link, answer in zip(links, answers, strict=True):
        node = link.dest.node_id
        if isinstance(answer, StateManifest):
            donors.append(_Donor(link, answer))
            continue
        err = _as_peer_error(answer)
        log.warning("donor %s offers no state: %s", node, err)
        failures[node] = err
    return donors


def _incompatibility(ref: StateManifest, other: StateManifest) -> str:
    """Why ``other``'s tensors cannot stand in for ``ref``'s ('' when they can)."""
    if other.manifest_hash != ref.manifest_hash:
        return "another model manifest"
    if other.layout() != ref.layout():
        return "other tensor names, dtypes or shapes"
    return ""


class _Transfer:
    """The scheduler of one fetch: which donor fetches which tensor, retries, and the results."""

    def __init__(
        self,
        donors: list[_Donor],
        ref: _Donor,
        deadline: float,
        range_bytes: int,
        rpc_timeout: float | None,
        per_donor: int,
        failures: dict[str, PeerError],
    ) -> None:
        self.donors = donors
        self.ref_node = ref.node_id
        self.ref = ref.manifest
        self.deadline = deadline
        self.range_bytes = range_bytes
        self.rpc_timeout = rpc_timeout
        self.per_donor = per_donor
        self.failures = failures
        self.done: dict[str, torch.Tensor] = {}
        self.sources: dict[str, str] = {}
        self.received: dict[str, int] = {d.node_id: 0 for d in donors}
        self.tried: dict[str, set[str]] = {t.name: set() for t in self.ref.tensors}
        self.orphans: collections.deque[str] = collections.deque()  # tensors whose donor failed
        self.partial: dict[str, _Partial] = {}
        self.tasks: dict[asyncio.Task[torch.Tensor], tuple[_Donor, str]] = {}

    async def run(self) -> dict[str, torch.Tensor]:
        self._assign()
        loop = asyncio.get_running_loop()
        try:
            while len(self.done) < len(self.ref.tensors):
                self._start()
                if not self.tasks:
                    missing = [t.name for t in self.ref.tensors if t.name not in self.done]
                    raise StateTransferError(
                        _common_status(self.failures),
                        f"{len(missing)} tensor(s) could be fetched intact from no donor, e.g. {missing[0]!r}",
                        self.failures,
                    )
                left = self.deadline - loop.time()
                finished: set[asyncio.Task[torch.Tensor]] = set()
                if left > 0:
                    finished, _ = await asyncio.wait(self.tasks, timeout=left, return_when=asyncio.FIRST_COMPLETED)
                if not finished:
                    missing_n = len(self.ref.tensors) - len(self.done)
                    raise StateTransferError(
                        Status.TIMEOUT,
                        f"state transfer ran out of time with {missing_n} tensor(s) missing",
                        self.failures,
                    )
                for task in finished:
                    self._finished(task)
        finally:
            await self._cancel_all()
        return {t.name: self.done[t.name] for t in self.ref.tensors}

    def _assign(self) -> None:
        """Largest tensors first, each to the donor with the fewest bytes so far; empty ones need no call."""
        for meta in sorted(self.ref.tensors, key=lambda t: t.nbytes, reverse=True):
            if meta.nbytes == 0:
                try:
                    self.done[meta.name] = tensor_from_bytes(meta, b"")
                except ValueError as exc:
                    err = PeerError(Status.CHECKSUM_MISMATCH, str(exc))
                    raise StateTransferError(err.status, f"{self.ref_node} announced a bad empty tensor", {}) from None
                self.sources[meta.name] = self.ref_node
                continue
            d = min(self.donors, key=lambda x: x.queued_bytes)
            d.queue.append(meta.name)
            d.queued_bytes += meta.nbytes

    def _next_for(self, d: _Donor) -> str | None:
        """The tensor ``d`` should fetch next: its own queue, a failed donor's leftovers, or a busier donor's."""
        if d.queue:
            name = d.queue.popleft()
            d.queued_bytes -= d.metas[name].nbytes
            return name
        for name in self.orphans:
            if d.node_id not in self.tried[name]:
                self.orphans.remove(name)
                return name
        busiest = max(
            (o for o in self.donors if o is not d and not o.failed and o.queue),
            key=lambda o: o.queued_bytes,
            default=None,
        )
        if busiest is None:
            return None
        name = busiest.queue.pop()  # the smallest of its queue: a stolen tensor should not end last
        busiest.queued_bytes -= busiest.metas[name].nbytes
        return name

    def _start(self) -> None:
        for d in self.donors:
            while not d.failed and d.running < self.per_donor:
                name = self._next_for(d)
                if name is None:
                    break
                d.running += 1
                task = asyncio.ensure_future(self._fetch(d, d.metas[name]))
                self.tasks[task] = (d, name)

    def _finished(self, task: asyncio.Task[torch.Tensor]) -> None:
        d, name = self.tasks.pop(task)
        d.running -= 1
        exc = task.exception()
        if exc is None:
            self.done[name] = task.result()
            self.sources[name] = d.node_id
            self.partial.pop(name, None)
            return
        err = _as_peer_error(exc)
        self.tried[name].add(d.node_id)
        self.orphans.append(name)
        if not d.failed:
            log.warning("state donor %s failed (%s); moving its tensors to the other donors", d.node_id, err)
            d.failed = True
            self.failures[d.node_id] = err
            self.orphans.extend(d.queue)
            d.queue.clear()
            d.queued_bytes = 0

    async def _fetch(self, d: _Donor, meta: TensorMeta) -> torch.Tensor:
        """One tensor from one donor, range by range, verified against that donor's hash."""
        loop = asyncio.get_running_loop()
        part = self.partial.get(meta.name)
        if part is None or part.sha256 != meta.sha256:
            # the bytes we hold belong to other values: start over on this donor
            part = self.partial[meta.name] = _Partial(meta, d.node_id)
        elif part.done:
            log.info("resuming %s at byte %d on %s (same hash as %s)", meta.name, part.done, d.node_id, part.source)
        limit = self.rpc_timeout if self.rpc_timeout is not None else d.link.cfg.rpc_deadline_s
        while True:
            while part.done < meta.nbytes:
                left = self.deadline - loop.time()
                if left <= 0:
                    raise PeerError(Status.TIMEOUT, "state transfer ran out of time")
                n = min(self.range_bytes, meta.nbytes - part.done)
                call = d.link.fetch_state_range(d.manifest.snapshot_id, meta.name, part.done, n, min(left, limit))
                data = await asyncio.wait_for(call, min(left, limit) + 1.0)  # gRPC's deadline fires first
                part.buf[part.done : part.done + n] = data
                part.done += n
                self.received[d.node_id] += n
            try:
                return tensor_from_bytes(meta, part.buf)
            except ChecksumMismatch as exc:
                earlier = part.source
                part = self.partial[meta.name] = _Partial(meta, d.node_id)
                if earlier != d.node_id:  # the resumed bytes came from another donor: refetch all from this one
                    log.warning(
                        "%s resumed from %s failed its hash; refetching it from %s", meta.name, earlier, d.node_id
                    )
                    continue
                raise PeerError(Status.CHECKSUM_MISMATCH, f"{d.node_id}: {exc}") from None
            except ValueError as exc:
                raise PeerError(Status.BAD_FRAME, f"{d.node_id}: {exc}") from None

    async def _cancel_all(self) -> None:
        if not self.tasks:
            return
        for task in self.tasks:
            task.cancel()
        await asyncio.wait(self.tasks, timeout=_CANCEL_GRACE_S)
        for task in self.tasks:
            if task.done() and not task.cancelled():
                task.exception()  # seen: the transfer's outcome is already decided
        self.tasks.clear()


def _as_peer_error(exc: BaseException) -> PeerError:
    if isinstance(exc, PeerError):
        return exc
    if isinstance(exc, TimeoutError):
        return PeerError(Status.TIMEOUT, "no answer in time")
    return PeerError(Status.UNSPECIFIED, f"{type(exc).__name__}: {exc}")


def _all_busy(failures: dict[str, PeerError]) -> bool:
    """Whether every donor only ran out of time to answer (its trainer published no snapshot yet)."""
    return bool(failures) and all(err.status == Status.TIMEOUT for err in failures.values())


def _common_status(failures: dict[str, PeerError]) -> Status:
    """The status every donor failed with, if they agree; UNSPECIFIED otherwise (the details say more)."""
    statuses = {err.status for err in failures.values()}
    return statuses.pop() if len(statuses) == 1 else Status.UNSPECIFIED
