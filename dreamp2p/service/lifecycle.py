"""A node's life around its training loop: stop signals, the resume agreement, draining, and checkpoints.

The daemon (`dreamp2p.service.daemon`) and library users share this code. :class:`Checkpointer` gives a
library training loop what the daemon does around its own:

    node = Node(config)
    with Checkpointer(node, "checkpoints", every_steps=100) as ckpt:  # SIGTERM/SIGINT now request a stop
        sync = ckpt.attach(model, optimizer, strategy="dreamddp")     # fresh, resumed, or joined
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(sync, T_max=total)
        ckpt.track(scheduler=sched)                                   # saved and restored with the state
        while sync.step_count < total and not ckpt.stop_requested:
            loss_fn(model(x), y).backward()
            sync.step(); sync.zero_grad(); sched.step()
            ckpt.maybe_save()                                         # every 100 steps, atomically
        ckpt.finish()                                                 # drain rounds, final checkpoint
    node.close()

Every member of a cluster that uses it resumes as the daemon's ``--resume`` does (:func:`agree_and_load`):
the members that hold the newest checkpoint of the restart wave resume from it and the others join them
by state transfer; a member that finds the cluster already training joins it. A checkpoint is the
daemon's format: ``{"sync": strategy state, name: tracked object's state_dict() ...}``.

A checkpoint the storage cannot take (a full disk, an I/O error) is, by default, one warning line
(:func:`save_or_warn`: the cause, the size needed, the free space, the checkpoint kept) and training goes
on, trying again at the next interval; ``on_write_error="stop"`` raises it instead.
"""

from __future__ import annotations

import copy
import errno
import logging
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final, Literal, Protocol

import torch
from torch import nn

from dreamp2p.config.daemon import ON_WRITE_ERROR
from dreamp2p.config.sync import SyncConfig
from dreamp2p.errors import PeerError, RoundFailed, Status
from dreamp2p.node import Node
from dreamp2p.service.checkpoint import (
    CheckpointWriteError,
    agree_resume_step,
    checkpoint_step,
    list_checkpoints,
    load_latest,
    load_step,
    save_checkpoint,
)
from dreamp2p.settings import resume_changes, resume_refusal
from dreamp2p.sync.strategies.base import Strategy, saved_settings
from dreamp2p.sync.strategies.registry import strategy_class

log = logging.getLogger(__name__)


class StopFlag:
    """Set by SIGTERM/SIGINT; the training loop checks it between steps."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.signal: str | None = None
        self._previous: dict[int, Any] = {}

    def install(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._previous[sig] = signal.signal(sig, self._handler)

    def uninstall(self) -> None:
        """Put back the handlers that :meth:`install` replaced."""
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()

    def request(self, why: str) -> None:
        """Stop as a signal would (``why`` is reported in its place)."""
        self.signal = why
        self.event.set()

    def _handler(self, signum: int, _frame: Any) -> None:
        self.request(signal.Signals(signum).name)


def abort_when_stuck(stop: StopFlag, done: threading.Event, grace: float, node: Node) -> None:
    """After a stop signal, give the current step ``grace`` seconds; then abort the rounds it waits on.

    A step blocks on rounds that need every peer; if the peers stopped too, they never complete.
    """
    while not done.is_set():
        if stop.event.wait(0.5):
            if not done.wait(grace):
                log.warning("step still blocked %.0f s after %s: aborting rounds in flight", grace, stop.signal)
                node.comm.abort_rounds("node stopping")
            return


def check_resume(directory: str | Path, sync: SyncConfig) -> None:
    """Refuse at once a resume under settings that the newest checkpoint of ``directory`` cannot take.

    Called before the node connects or waits for anyone. The settings the checkpoint was saved under are
    compared with ``sync``: a changed setting that a checkpoint resumes only under (the strategy, see
    `dreamp2p.settings`) raises PeerError(CONFIG_MISMATCH) naming it and both values. Every node holds the
    same config (the handshake compares them) and checkpoints of the same run, so every node refuses alike
    on its own, instead of one refusing and the others waiting for it until a timeout. Any other changed
    setting is adopted, and logged, when the state loads (`Strategy.load_state_dict`). Nothing to check
    without a checkpoint.
    """
    newest = load_latest(directory, mmap=True)  # the tensors stay on disk: only the settings are read
    if newest is None or not isinstance(newest[1].get("sync"), dict):
        return
    path, state = newest
    current = {**sync.shared_settings(), "sync.strategy": sync.strategy}
    changes = resume_changes(saved_settings(state["sync"]), current)
    refusal = resume_refusal(changes, strategy_class(sync.strategy).resume_fixed, where=str(path))
    if refusal is not None:
        raise PeerError(Status.CONFIG_MISMATCH, refusal)


# agree_and_load's answer when members are training: take their state (Node.join), not our checkpoint
JOIN: Final = "join"


def agree_and_load(directory: str | Path, node: Node) -> tuple[Path, dict[str, Any]] | Literal["join"] | None:
    """Decide with the other nodes where to resume from, then load that checkpoint of ``directory``.

    Publishes our checkpoint steps through the Status call, then asks every other member. As soon as one
    is training, the cluster went on without us: we join it (returns ``JOIN``; our checkpoint is older
    than its state). If all are resuming too, the nodes holding the newest checkpoint of the wave resume
    from it and the others join them (:func:`agree_resume_step`); None when nobody has one (fresh start).
    """
    mine = [checkpoint_step(p) for p in list_checkpoints(directory)]
    node.comm.set_resume_steps(mine)
    others: dict[str, list[int]] = {}
    deadline = time.monotonic() + node.config.transport.connect_timeout_s
    members = [n for n in node.comm.ring_ids if n != node.config.node_id]
    while len(others) < len(members):
        for member in members:
            if member in others:
                continue
            try:
                st = node.comm.member_status(member)
            except PeerError as exc:
                log.info("waiting for %s: %s", member, exc)
                continue
            steps = list(st.checkpoint_steps)
            # a resumed member that trained well past its checkpoints since is no longer in this restart wave
            if st.training is not None and (not st.resuming or st.training.step > max(steps, default=0) + 2):
                return JOIN
            if st.resuming:
                others[member] = steps
        if len(others) < len(members):
            if time.monotonic() > deadline:
                missing = sorted(set(members) - set(others))
                raise RuntimeError(f"resume: no answer from {', '.join(missing)} within the connect timeout")
            time.sleep(0.2)
    step = agree_resume_step(mine, list(others.values()))
    if step is not None:
        log.info("resuming from step %d (ours: %s)", step, mine)
        return load_step(directory, step)
    if any(others.values()):
        log.info("another node saved a newer state than ours (%s): joining it", mine)
        return JOIN
    log.info("no node has a checkpoint: starting fresh")
    return None


def drain(sync: Strategy, node: Node, grace: float) -> None:
    """Land rounds in flight; if peers are gone (they stopped too), abort them after ``grace`` seconds.

    An aborted round changes nothing here: the checkpoint holds this node's parameters without it.
    """
    log.info("draining rounds in flight at step %d", sync.step_count, extra={"event": "drain"})
    try:
        sync.close(timeout=grace)
    except RoundFailed as exc:
        log.warning("rounds in flight could not finish within %.0f s (%s); aborting them", grace, exc)
        node.comm.abort_rounds("node stopping")
        sync.abandon()


def save_or_warn(save: Callable[[], Path], on_write_error: str, next_step: int | None) -> Path | None:
    """``save()``'s checkpoint; when the storage fails it (:class:`CheckpointWriteError`) and
    ``on_write_error`` is "continue", one warning line instead and None: the error names the cause, the
    size needed, the free space and the checkpoint kept, and the caller trains on. ``next_step``: the step
    of the next try (None: there is none, the node is stopping). With "stop" the error is raised.
    """
    if on_write_error not in ON_WRITE_ERROR:
        raise ValueError(f"on_write_error must be one of {', '.join(ON_WRITE_ERROR)}; got {on_write_error!r}")
    try:
        return save()
    except CheckpointWriteError as exc:
        if on_write_error == "stop":
            raise
        then = f"training on, next try at step {next_step}" if next_step is not None else "stopping without it"
        fields = {
            "step": exc.step,
            "errno": errno.errorcode.get(exc.errno or 0, exc.errno),
            "needed_bytes": exc.needed_bytes,
            "free_bytes": exc.free_bytes,
            "kept": str(exc.kept) if exc.kept is not None else None,
        }
        log.warning("%s; %s", exc, then, extra={"event": "checkpoint_failed", **fields})
        return None


class Stateful(Protocol):
    """What :meth:`Checkpointer.track` keeps: LR schedulers, ``GradScaler``, a sampler with state, ..."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any], /) -> Any: ...


class Checkpointer:
    """Checkpoints every ``every_steps`` steps, resume, and a clean stop for a library loop (module docstring).

    ``signals``: install SIGTERM/SIGINT handlers that request a stop (only possible on the main thread;
    :meth:`close` puts the previous handlers back). ``stop_grace_s``: after a stop request, how long a
    step may stay blocked on rounds before they are aborted (peers that stopped too never finish them);
    :meth:`finish` waits as long for rounds in flight. ``on_write_error``: when the storage fails a
    checkpoint of :meth:`maybe_save` or :meth:`finish` (a full disk, an I/O error), "continue" logs one
    warning (cause, size needed, free space, the checkpoint kept) and trains on, trying again at the next
    interval; "stop" raises the :class:`~dreamp2p.service.checkpoint.CheckpointWriteError`.
    """

    def __init__(
        self,
        node: Node,
        directory: str | Path,
        every_steps: int,
        keep: int = 3,
        stop_grace_s: float = 30.0,
        signals: bool = True,
        on_write_error: Literal["continue", "stop"] = "continue",
    ) -> None:
        if every_steps < 1 or keep < 1:
            raise ValueError(f"every_steps and keep must be >= 1, got {every_steps} and {keep}")
        if on_write_error not in ON_WRITE_ERROR:
            raise ValueError(f"on_write_error must be one of {', '.join(ON_WRITE_ERROR)}; got {on_write_error!r}")
        self.node = node
        self.directory = Path(directory)
        self.every_steps = every_steps
        self.keep = keep
        self.on_write_error = on_write_error
        self.stop_grace_s = stop_grace_s
        self.stop = StopFlag()
        if signals:
            if threading.current_thread() is threading.main_thread():
                self.stop.install()
            else:
                log.warning("Checkpointer made off the main thread: SIGTERM/SIGINT handlers not installed")
        self.sync: Strategy | None = None
        self.resumed_from: Path | None = None  # the checkpoint attach resumed from (None: fresh or joined)
        self.joined = False  # attach took the state from the live members
        self._tracked: dict[str, Stateful] = {}
        self._saved: dict[str, Any] | None = None  # the restored checkpoint, for objects tracked later
        self._groups: list[dict[str, Any]] = []  # optimizer hyperparameters as attach left them
        self._last_saved = -1
        self._last_tried = -1  # the step of the last checkpoint tried, written or not
        self._done = threading.Event()
        self._watcher: threading.Thread | None = None

    @property
    def stop_requested(self) -> bool:
        """A stop signal (or :meth:`request_stop`) arrived: end the loop after this step, then :meth:`finish`."""
        return self.stop.event.is_set()

    @property
    def signal(self) -> str | None:
        """The signal's name that requested the stop (or the reason given to :meth:`request_stop`)."""
        return self.stop.signal

    def request_stop(self, why: str = "requested") -> None:
        self.stop.request(why)

    def attach(self, model: nn.Module, optimizer: torch.optim.Optimizer, **kwargs: Any) -> Strategy:
        """:meth:`Node.attach` after the daemon's resume agreement: resume from the newest checkpoint of the
        restart wave, join the members training without us, or start fresh (every directory empty).

        ``kwargs`` go to :meth:`Node.attach` (strategy, sync, overrides); ``broadcast`` and ``join`` are
        decided here. A strategy other than the newest checkpoint's is refused first, before any wait on
        the other members (:func:`check_resume`); other settings changed since are adopted when it loads.
        """
        for decided_here in ("broadcast", "join"):
            if decided_here in kwargs:
                raise ValueError(f"Checkpointer.attach decides {decided_here!r} from the resume agreement")
        check_resume(self.directory, Node.sync_config(**kwargs))  # before any wait on the other members
        if not self.node.connected:
            self.node.connect()
        decided = agree_and_load(self.directory, self.node)
        restored = None if decided == JOIN else decided
        if decided == JOIN:
            log.warning("members are training: joining them instead of resuming from our checkpoint")
            self.node.stand_aside()
        self.joined = decided == JOIN
        sync = self.node.attach(model, optimizer, broadcast=restored is None, join=self.joined, **kwargs)
        if restored is not None:
            self.resumed_from, self._saved = restored
            sync.load_state_dict(self._saved["sync"])
            self._last_saved = sync.step_count
            log.info("resumed from %s at step %d", self.resumed_from, sync.step_count)
        self._groups = [{k: copy.deepcopy(v) for k, v in g.items() if k != "params"} for g in sync.param_groups]
        self.sync = sync
        self._watcher = threading.Thread(
            target=abort_when_stuck,
            args=(self.stop, self._done, self.stop_grace_s, self.node),
            name="stop-watcher",
            daemon=True,
        )
        self._watcher.start()
        return sync

    def track(self, **objects: Stateful) -> None:
        """Save ``objects`` (by name) with every checkpoint, and restore them now if attach resumed.

        Make LR schedulers on the sync object after :meth:`attach`, then track them: the learning rates
        the resumed (or joined) optimizer held are put back over the ones a new scheduler set, as loading
        an optimizer after making its scheduler does; a scheduler of a joined node is moved to its step.
        """
        sync = self._strategy()
        for name, obj in objects.items():
            if name == "sync":
                raise ValueError("'sync' names the strategy's own state in a checkpoint")
            self._tracked[name] = obj
            if self._saved is not None and name in self._saved:
                obj.load_state_dict(self._saved[name])
            elif self.joined and isinstance(obj, torch.optim.lr_scheduler.LRScheduler):
                obj.last_epoch = sync.step_count
        if self._saved is not None or self.joined:
            for group, saved in zip(sync.param_groups, self._groups, strict=True):
                group.update(copy.deepcopy(saved))
            for obj in objects.values():
                if isinstance(obj, torch.optim.lr_scheduler.LRScheduler):
                    obj._last_lr = [g["lr"] for g in sync.param_groups]  # what get_last_lr() reports

    def maybe_save(self) -> Path | None:
        """After ``sync.step()``: a checkpoint when the step count is a multiple of ``every_steps``.

        None when none was due, or when the storage failed it under ``on_write_error="continue"`` (logged;
        the next multiple tries again).
        """
        step = self._strategy().step_count
        if step % self.every_steps or step in (self._last_saved, self._last_tried):
            return None
        self._last_tried = step
        return save_or_warn(self.save, self.on_write_error, step + self.every_steps)

    def save(self) -> Path:
        """Land rounds in flight (a consistent cut), then write a checkpoint of this step atomically.

        Raises :class:`~dreamp2p.service.checkpoint.CheckpointWriteError` when the storage fails the write,
        whatever ``on_write_error`` says (that applies to :meth:`maybe_save` and :meth:`finish`).
        """
        sync = self._strategy()
        sync.close()
        state: dict[str, Any] = {"sync": sync.state_dict()}
        state.update({name: obj.state_dict() for name, obj in self._tracked.items()})
        path = save_checkpoint(self.directory, sync.step_count, state, self.keep)
        self._last_saved = sync.step_count
        return path

    def abandon_step(self) -> None:
        """After a stop, a step whose round a departed peer can no longer finish (RoundFailed): forget it."""
        sync = self._strategy()
        sync.zero_grad()
        sync.abandon()

    def finish(self) -> Path | None:
        """The loop ended (done or stopping): health NOT_SERVING, drain rounds in flight, final checkpoint.

        Its path; None when the storage failed it under ``on_write_error="continue"`` (the warning names
        the checkpoint kept, the newest a resume finds).
        """
        sync = self._strategy()
        self.node.begin_drain()
        drain(sync, self.node, self.stop_grace_s)
        path: Path | None = self.directory / f"ckpt-{sync.step_count:010d}.pt"
        if self._last_saved != sync.step_count or path is None or not path.exists():
            path = save_or_warn(self.save, self.on_write_error, None)
        log.info("stopped at step %d (%s); checkpoint %s", sync.step_count, self.signal or "done", path)
        return path

    def close(self) -> None:
        """Stop the stuck-step watcher and put the previous signal handlers back (the node stays open)."""
        self._done.set()
        if self._watcher is not None:
            self._watcher.join(timeout=5)
        self.stop.uninstall()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def _strategy(self) -> Strategy:
        if self.sync is None:
            raise RuntimeError("call Checkpointer.attach(model, optimizer) first")
        return self.sync
