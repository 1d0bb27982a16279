"""The strategy interface every synchronization method implements, and per-step accounting.

The user's loop stays theirs: forward, ``loss.backward()``, then ``sync.step()`` in place of
``optimizer.step()``. A strategy decides what is averaged when, launches it on the comm thread, and
blocks only where its method requires; time spent blocked is the step's exposed wait.

One failure policy for every strategy: a round that fails (after the peer's retry) failed on every member
(rounds are all-or-none, see `dreamp2p.peer`), so it is skipped everywhere and training goes on; nobody
applied it, so the replicas stay consistent. Buffers (BatchNorm statistics) are synced alongside, see
`dreamp2p.sync.strategies.buffers`.
"""

from __future__ import annotations

import abc
import concurrent.futures
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from dreamp2p.config.sync import SyncConfig
from dreamp2p.errors import PeerError, RoundFailed, Status
from dreamp2p.messages import RoundResult, TrainingInfo
from dreamp2p.settings import FIXED_ON_RESUME, resume_changes, resume_refusal
from dreamp2p.state.donor import StateDonor
from dreamp2p.sync.comm.collective import Collective
from dreamp2p.sync.model.agreement import is_adaptive
from dreamp2p.sync.model.layers import Layer, discover_layers
from dreamp2p.sync.model.optim import OptimizerFacade
from dreamp2p.sync.model.shardlocal import load_model_state, load_optimizer_state, local_state
from dreamp2p.sync.strategies.buffers import BufferSync, model_buffers
from dreamp2p.sync.strategies.flush import ReplicaFlush
from dreamp2p.sync.strategies.pacing import StepWindow

log = logging.getLogger(__name__)

# seconds the trainer waits for a round beyond the peer's round deadline before it calls the round lost
ROUND_MARGIN_S = 30.0


@dataclass
class StepStats:
    step: int
    compute_s: float = 0.0  # forward + backward + optimizer time of this step
    exposed_s: float = 0.0  # time the training thread waited on communication
    comm_s: float = 0.0  # duration of the collectives that landed this step
    bytes_sent: int = 0
    syncs: int = 0
    plan_version: int = 0

    @property
    def hidden_fraction(self) -> float:
        """1 - exposed / comm: how much of the communication overlapped computation (1 when none)."""
        if self.comm_s <= 0:
            return 1.0
        return max(0.0, 1.0 - self.exposed_s / self.comm_s)


@dataclass
class Totals:
    steps: int = 0
    compute_s: float = 0.0
    exposed_s: float = 0.0
    comm_s: float = 0.0
    bytes_sent: int = 0
    history: list[StepStats] = field(default_factory=list)

    def add(self, s: StepStats) -> None:
        self.steps += 1
        self.compute_s += s.compute_s
        self.exposed_s += s.exposed_s
        self.comm_s += s.comm_s
        self.bytes_sent += s.bytes_sent
        self.history.append(s)
        if len(self.history) > 10_000:
            del self.history[: len(self.history) - 10_000]

    @property
    def hidden_fraction(self) -> float:
        return 1.0 if self.comm_s <= 0 else max(0.0, 1.0 - self.exposed_s / self.comm_s)


BUFFER_ROUNDS_WHY = "the model buffers (BatchNorm statistics) as sent, and their mean, for the buffers' own round"


@dataclass(frozen=True)
class Held:
    """One buffer a strategy keeps beyond the model, its gradients and the user's optimizer (`Strategy.held`)."""

    name: str  # what it holds, e.g. "global copy"
    why: str  # why the strategy needs it
    tensors: tuple[torch.Tensor, ...]


class Strategy(OptimizerFacade, abc.ABC):
    """Base of every synchronization strategy; subclasses implement :meth:`_step`.

    It is also a ``torch.optim.Optimizer`` over the user's optimizer (`dreamp2p.sync.model.optim`): LR schedulers
    and ``GradScaler`` take the strategy where they take an optimizer. Subclasses update the weights from
    local gradients with :meth:`_inner_step` (skipped on a ``GradScaler`` overflow), never
    ``self.optimizer.step()`` directly.
    """

    name = "base"
    # when buffers are synced: every step (ssgd, like DDP) or at the end of each period; a blocking
    # strategy lands them in the same step, the others one step later so the round hides behind compute
    buffers_every_step = False
    buffers_inline = True
    syncs_buffers = True
    # settings a checkpoint of this strategy resumes only under (see load_state_dict)
    resume_fixed: tuple[str, ...] = FIXED_ON_RESUME

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        comm: Collective,
        cfg: SyncConfig,
        donor: StateDonor | None = None,
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.comm = comm
        self.donor = donor  # serves our state to joining members, when the node offers it
        # a strategy built without Node.attach resolves its outer defaults here (a no-op after attach)
        self.cfg = cfg.with_outer_defaults(is_adaptive(optimizer))
        self.layers: list[Layer] = discover_layers(model)
        self.params: list[nn.Parameter] = [p for layer in self.layers for p in layer.params]
        self.step_count = 0
        self.rounds_skipped = 0
        self._last_members: tuple[str, ...] = ()  # who the newest landed round ran among (see flush)
        self.totals = Totals()
        self._last_end = time.perf_counter()
        self._stats = StepStats(0)
        self.pin = any(p.device.type == "cuda" for p in self.params)
        self._flusher = ReplicaFlush(comm, model, self.pin, self._wait)
        self.buffers = model_buffers(model) if self.syncs_buffers else []
        self._bufsync = BufferSync(comm, self.buffers, cfg.buffers, self.pin) if self.buffers else None
        self._resync: Callable[[tuple[str, ...]], None] | None = None
        # time-paced periods: which of the cluster's last steps we trained at (None: lockstep)
        self._clock = StepWindow(self.cfg.period) if self.cfg.timed_periods else None
        self.adopted: list[tuple[str, str, str]] = []  # settings the last load took from our config instead
        self._setup()

    # ------------------------------------------------------------------ user API

    def step(self, closure: Callable[[], Any] | None = None) -> StepStats:  # type: ignore[override]
        """Apply this step's local update and whatever synchronization the strategy schedules now. Called once
        per optimizer step, after every backward pass of the step (gradient accumulation: several
        ``backward()``, then one ``step()``); ``closure`` first, with gradients enabled. Returns statistics."""
        if closure is not None:
            with torch.enable_grad():
                closure()
        t0 = time.perf_counter()
        self._take_amp()  # unscale the gradients when GradScaler.step called us; note an overflow
        self._stats = StepStats(self.step_count, compute_s=t0 - self._last_end)
        self._land_buffers()  # launched at the end of an earlier period (not inline)
        if self._clock is not None:
            self._clock.record(trained=True)
        self._with_buffers(self._step)
        self.step_count += 1
        if self._clock is not None:
            self._follow()
        end = time.perf_counter()
        stats = self._stats
        # time inside step() that was not waiting on the network is local work (optimizer, merges)
        stats.compute_s += max(0.0, (end - t0) - stats.exposed_s)
        self.totals.add(stats)
        self._last_end = end
        self.publish_progress()
        if self.donor is not None:
            # a joining member may wait for our state: between two steps it is consistent
            self.donor.offer(self.state_dict, self.step_count)
        if ahead := self.comm.diverged_from:
            if self._resync is None:
                raise RuntimeError(
                    f"{', '.join(ahead)} train with a plan this node missed (after a partition?) and its peer "
                    "stands aside; a strategy attached through Node.attach takes their state by itself, this one cannot"
                )
            self._resync(ahead)
        return stats

    def _with_buffers(self, run: Callable[[], None]) -> None:
        """``run`` (this step's own schedule) with the buffers' round where one is due at this step."""
        due = self._bufsync is not None and (self.buffers_every_step or (self.step_count + 1) % self.cfg.period == 0)
        if due and self._bufsync is not None:
            # launched before the strategy's own round so that both travel at once
            self._bufsync.launch(self._round())
        run()
        if due and self.buffers_inline:
            self._land_buffers()

    def _follow(self) -> None:
        """Time-paced periods: move our step clock up to the step the cluster's leading member reported,
        running what is due at each step passed without a local update (`dreamp2p.sync.strategies.pacing`).

        At most one period per call: a member further ahead is a partition's other side or a joiner's
        donors, which the peer's drift rules handle, not a pace to follow.
        """
        lead = min(self.comm.leading_step, self.step_count + self.cfg.period)
        while self.step_count < lead and self._clock is not None:
            self._clock.record(trained=False)
            self._with_buffers(self._tick)
            self.step_count += 1

    def publish_progress(self) -> None:
        """Tell the peer our step and plan (its Status and heartbeat answers carry them)."""
        self.comm.set_training_info(self._training_info())

    def on_diverged(self, handler: Callable[[tuple[str, ...]], None]) -> None:
        """Who brings this node back when members ahead train with a plan it missed (`dreamp2p.peer.drift`).

        ``Node.attach`` sets it: the handler takes those members' state, as a joining node does.
        """
        self._resync = handler

    def _training_info(self) -> TrainingInfo:
        return TrainingInfo(self.name, self.step_count)

    @property
    def plan_version(self) -> int:
        """Version of the synchronization plan in force (only planned strategies have more than one)."""
        return self._training_info().plan_version

    def plan_report(self) -> dict[str, Any] | None:
        """The plan in force and the inputs it was made from, for ``plan.json`` (planned strategies only)."""
        return None

    def jump_to(self, step: int) -> None:
        """Continue at ``step`` (a node joining a running cluster starts where the others are)."""
        if step < self.step_count:
            raise ValueError(f"cannot jump back from step {self.step_count} to {step}")
        self.step_count = step
        self._rearm()

    def state_dict(self) -> dict[str, Any]:
        return {
            "strategy": self.name,
            "step": self.step_count,
            "model": local_state(self.model.state_dict()),  # under FSDP2, this rank's shards
            "optimizer": local_state(self.optimizer.state_dict()),
            "extra": self._extra_state(),
            # time-paced periods: the steps of the clock's window we trained at (our parameters hold them)
            "clock": self._clock.marks() if self._clock is not None else None,
            # what the state was made under: a resume compares them with its config (see load_state_dict)
            "settings": self.cfg.shared_settings(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state`` (a checkpoint, or the members' state for a joiner). Settings changed since
        it was saved (`dreamp2p.settings`): one of ``resume_fixed`` raises PeerError(CONFIG_MISMATCH) before
        anything loads; any other is logged and ours holds from here (:meth:`_adopt_settings`, ``adopted``).
        """
        # the strategy is the one this object runs (a strategy made by hand may hold a config naming another)
        changes = resume_changes(saved_settings(state), {**self.cfg.shared_settings(), "sync.strategy": self.name})
        refusal = resume_refusal(changes, self.resume_fixed)
        if refusal is not None:
            raise PeerError(Status.CONFIG_MISMATCH, refusal)
        load_model_state(self.model, state["model"])
        load_optimizer_state(self.optimizer, state["optimizer"])
        self.step_count = int(state["step"])
        self._load_extra_state(state.get("extra", {}))
        if self._clock is not None:
            self._clock = StepWindow(self.cfg.period, state.get("clock") or ())
        for name, old, new in changes:
            log.info("resume: %s %s -> %s (config changed since the checkpoint)", name, old, new)
        self.adopted = changes
        if changes:
            self._adopt_settings(changes)

    def close(self, timeout: float | None = None) -> None:
        """Wait for collectives still in flight (they are collective: peers expect us to finish them).

        Rounds that failed are skipped (as everywhere else). With ``timeout``, raises RoundFailed if they
        cannot finish in time (peers gone): call :meth:`abandon` then.
        """
        self._finish(timeout)
        self._land_buffers(timeout)

    def abandon(self) -> None:
        """Forget collectives in flight without applying them (after the peer aborted its rounds)."""
        self._drop()
        if self._bufsync is not None:
            self._bufsync.take()

    def flush(self) -> str:
        """Average every parameter (trainable or frozen) and every buffer once now, blocking: every member of
        the flush ends bit-identical. Checked first, through the strategy's compressed path where it has one
        (`_flush_params`), else in fp32; the rounds, retries (RoundFailed when none completes), FlushIncomplete
        (fewer members than our newest round or the view held) and the path it returns (how the trainable
        parameters became identical) are `dreamp2p.sync.strategies.flush`'s."""
        self.close()
        expected = set(self._last_members) | set(self.comm.members)
        return self._flusher.run(self.step_count, self.cfg.codec, expected, self._flush_params)

    def held(self) -> list[Held]:
        """The memory kept between steps beyond the model, its gradients and the user's optimizer: one entry
        per buffer that grows with the model, with why (`bench memory`; count each storage once). Not here:
        a step's temporaries, a round's own copy, and rounds of a fixed few elements."""
        held = self._held()
        if self._bufsync is not None:
            held.append(Held("buffer rounds", BUFFER_ROUNDS_WHY, self._bufsync.buffers))
        return held

    def outer_shards(self) -> dict[str, list[torch.Tensor]]:
        """Per kind of outer state, its memory as one view per parameter of ``params`` shaped as this rank's shard:
        what a sharded checkpoint reshards (`dreamp2p.service.dcp`). None without outer state."""
        return {}

    # ------------------------------------------------------------------ for subclasses

    def _held(self) -> list[Held]:  # strategies without state of their own keep nothing
        """The strategy's own buffers (see :meth:`held`)."""
        return []

    def _flush_params(self, round_id: int) -> RoundResult | None:  # no compressed path by default
        """Make the trainable parameters identical on every member by the strategy's own (compressed) path;
        the completed round, or None to leave them to flush()'s checked fp32 average."""
        return None

    def _setup(self) -> None:  # strategies without state of their own need nothing
        """Build strategy state once the base attributes exist (instead of overriding __init__)."""

    def _finish(self, timeout: float | None) -> None:  # nothing in flight by default
        """Land the strategy's own rounds still in flight (see :meth:`close`)."""

    def _drop(self) -> None:  # nothing in flight by default
        """Forget the strategy's own rounds in flight (see :meth:`abandon`)."""

    @abc.abstractmethod
    def _step(self) -> None: ...

    def _tick(self) -> None:
        """What is due at step ``step_count`` besides the local update (launches, landings), for a step of
        the cluster's clock this member passes without training (time-paced periods only)."""
        raise NotImplementedError(f"{self.name} does not follow the cluster's step clock (sync.periods = 'steps')")

    def _rearm(self) -> None:  # strategies without per-step schedule state need nothing
        """Prepare the schedule of ``step_count`` again after it changed from outside."""

    def _extra_state(self) -> dict[str, Any]:
        return {}

    def _load_extra_state(self, state: dict[str, Any]) -> None:
        return None

    def _adopt_settings(self, changes: list[tuple[str, str, str]]) -> None:
        """After a load whose state was saved under other settings (``changes``: name, saved, ours), make
        the loaded state follow ours. Nothing by default: the schedule reads ``self.cfg`` at every step."""

    @property
    def round_limit_s(self) -> float:
        """How long the trainer waits for a round's result: the peer's round deadline plus a margin, since
        a round can start on the comm side later than it was launched (queued behind others)."""
        return self.comm.round_timeout_s + ROUND_MARGIN_S

    def _round(self) -> int:
        """Round id for a collective launched during this step: the same on every peer, also after a resume."""
        return self.step_count + 1

    def _wait(self, fut: concurrent.futures.Future[RoundResult], timeout: float | None = None) -> RoundResult | None:
        """Block on a collective, charging the blocked time to exposed wait; None if the round failed.

        Rounds are all-or-none across the members (see `dreamp2p.peer`), so a failed round was applied
        nowhere and skipping it keeps every replica consistent. A round still without a result after
        ``timeout`` (default: the peer's round timeout plus a margin) is still in flight, so that raises
        RoundFailed: the caller must abort it (see :meth:`abandon`).
        """
        t0 = time.perf_counter()
        limit = timeout if timeout is not None else self.round_limit_s
        try:
            res = fut.result(timeout=limit)
        except concurrent.futures.TimeoutError:
            raise RoundFailed(None, f"no result from the comm thread within {limit:.0f} s") from None
        except RoundFailed as exc:
            self._stats.exposed_s += time.perf_counter() - t0
            self.rounds_skipped += 1
            log.warning("step %d: %s; skipped on every member, training goes on", self.step_count, exc)
            return None
        self._stats.exposed_s += time.perf_counter() - t0
        self._landed(res)
        return res

    def _land_buffers(self, timeout: float | None = None) -> None:
        fut = self._bufsync.take() if self._bufsync is not None else None
        if fut is not None and self._wait(fut, timeout) is not None and self._bufsync is not None:
            self._bufsync.apply()

    def _landed(self, res: RoundResult) -> None:
        if res.members:
            self._last_members = res.members
        self._stats.comm_s += res.seconds
        self._stats.bytes_sent += res.bytes_sent
        self._stats.syncs += 1


def saved_settings(state: Mapping[str, Any]) -> dict[str, str]:
    """The settings a strategy's state was saved under (its ``settings``, see `Strategy.state_dict`).

    A state saved before they were recorded still tells its strategy and, for a planned strategy, its
    plan's period; nothing else of it can be compared.
    """
    out = {str(k): str(v) for k, v in (state.get("settings") or {}).items()}
    out["sync.strategy"] = str(state.get("strategy"))  # the strategy that saved it, whatever its config said
    extra = state.get("extra")
    plan = extra.get("plan") if isinstance(extra, Mapping) else None
    if isinstance(plan, Mapping) and "period" in plan:
        out.setdefault("sync.period", str(plan["period"]))
    return out


def settled(fut: concurrent.futures.Future[RoundResult], timeout: float) -> bool:
    """Wait for a round whose result a checkpoint must record: True when it completed, False when it failed
    (everywhere: nobody applies it); RoundFailed when it is still in flight after ``timeout``, since its
    outcome, and so a consistent state, is not known yet."""
    try:
        fut.result(timeout)
    except RoundFailed:
        return False
    except concurrent.futures.TimeoutError:
        raise RoundFailed(None, f"still in flight after {timeout:.0f} s: its outcome cannot be recorded") from None
    return True


def landed(elements: int) -> concurrent.futures.Future[RoundResult]:
    """A round that already finished elsewhere, its result restored from saved state into a group's work."""
    done: concurrent.futures.Future[RoundResult] = concurrent.futures.Future()
    done.set_result(RoundResult(0, 0, 0.0, 0, 0, elements, "fp32", 0))
    return done
