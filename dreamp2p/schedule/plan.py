"""The DreamDDP plan as data: which layer groups each iteration of the period syncs, validated on construction.

A :class:`Plan` is what the planner (``schedule.dreamddp``) produces, what every peer must agree on
(:meth:`Plan.digest` names its rounds) and what the runtime (``sync.strategies.dreamddp``) executes; it round-trips
through plain dicts for reports and the wire. Pure: no I/O.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

PLAN_FORMAT = "dreamp2p.plan/1"


def is_int(value: object) -> bool:
    """An int that is not a bool (JSON and TOML hand both to a field typed int)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _check_time(name: str, value: float) -> None:
    if not _is_real(value) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")


@dataclass(frozen=True)
class GroupSync:
    """One ring all-reduce of a group of layers, launched in one iteration of the period."""

    iteration: int  # 0..H-1: iteration of the period that launches this sync
    layers: tuple[int, ...]  # indices into the FORWARD-order layer list, sorted ascending
    delay: int  # 0 = lands in the same iteration; d > 0 = lands d iterations later (WAN extension)
    start_s: float  # predicted start on the link, relative to the start of its iteration's backward
    comm_s: float  # predicted comm time (ring_comm_time of the group's bytes)
    repeat: bool = False  # True for bubble-filling extra syncs of layers already synced in the period

    def __post_init__(self) -> None:
        if not is_int(self.iteration) or self.iteration < 0:
            raise ValueError(f"sync iteration must be an int >= 0, got {self.iteration!r}")
        if not isinstance(self.layers, tuple) or not self.layers:
            raise ValueError(f"sync layers must be a non-empty tuple, got {self.layers!r}")
        if not all(is_int(x) and x >= 0 for x in self.layers):
            raise ValueError(f"sync layers must be ints >= 0, got {self.layers!r}")
        if any(a >= b for a, b in itertools.pairwise(self.layers)):
            raise ValueError(f"sync layers must be strictly ascending, got {self.layers!r}")
        if not is_int(self.delay) or self.delay < 0:
            raise ValueError(f"sync delay must be an int >= 0, got {self.delay!r}")
        _check_time("sync start_s", self.start_s)
        _check_time("sync comm_s", self.comm_s)
        if not isinstance(self.repeat, bool):
            raise ValueError(f"sync repeat must be a bool, got {self.repeat!r}")

    def to_dict(self) -> dict[str, Any]:
        return {
            "iteration": self.iteration,
            "layers": list(self.layers),
            "delay": self.delay,
            "start_s": float(self.start_s),
            "comm_s": float(self.comm_s),
            "repeat": self.repeat,
        }


@dataclass(frozen=True)
class Plan:
    """A layer synchronization schedule for one period of ``H`` iterations, identical on every peer.

    Invariants (checked on construction, so a plan from a peer or a checkpoint is safe to use): syncs are
    ordered by ``(iteration, start_s)`` (the link order within an iteration), iterations and layers are in
    range, delays are below ``period``, and every layer is in at least one non-repeat sync.
    """

    version: int
    effective_step: int
    period: int  # H
    layer_names: tuple[str, ...]  # forward order
    syncs: tuple[GroupSync, ...]  # ordered by (iteration, start_s)
    exposed_s: tuple[float, ...]  # predicted exposed wait per iteration (len H)
    compute_s: float  # predicted fwd+bwd time of one iteration

    def __post_init__(self) -> None:
        if not is_int(self.version) or self.version < 0:
            raise ValueError(f"plan version must be an int >= 0, got {self.version!r}")
        if not is_int(self.effective_step) or self.effective_step < 0:
            raise ValueError(f"plan effective_step must be an int >= 0, got {self.effective_step!r}")
        if not is_int(self.period) or self.period < 1:
            raise ValueError(f"plan period must be an int >= 1, got {self.period!r}")
        names = self.layer_names
        if not isinstance(names, tuple) or not names or not all(isinstance(n, str) and n for n in names):
            raise ValueError("plan layer_names must be a non-empty tuple of non-empty str")
        if len(set(names)) != len(names):
            raise ValueError("plan layer_names must be unique")
        if not isinstance(self.syncs, tuple) or not all(isinstance(s, GroupSync) for s in self.syncs):
            raise ValueError("plan syncs must be a tuple of GroupSync")
        if not isinstance(self.exposed_s, tuple) or len(self.exposed_s) != self.period:
            raise ValueError(f"plan exposed_s must be a tuple of {self.period} values")
        for i, wait in enumerate(self.exposed_s):
            _check_time(f"plan exposed_s[{i}]", wait)
        _check_time("plan compute_s", self.compute_s)
        covered = [False] * len(names)
        for i, sync in enumerate(self.syncs):
            if sync.iteration >= self.period:
                raise ValueError(f"sync {i}: iteration {sync.iteration} outside period {self.period}")
            if sync.delay >= self.period:
                raise ValueError(f"sync {i}: delay {sync.delay} must be < period {self.period}")
            if sync.layers[-1] >= len(names):
                raise ValueError(f"sync {i}: layer {sync.layers[-1]} outside {len(names)} layers")
            if not sync.repeat:
                for x in sync.layers:
                    covered[x] = True
        for a, b in itertools.pairwise(self.syncs):
            if (b.iteration, b.start_s) < (a.iteration, a.start_s):
                raise ValueError("plan syncs must be ordered by (iteration, start_s)")
        if not all(covered):
            missing = [names[x] for x in range(len(names)) if not covered[x]]
            raise ValueError(f"every layer must sync at least once per period; never synced: {missing}")

    def syncs_at(self, iteration: int) -> tuple[GroupSync, ...]:
        """Syncs launched in ``iteration`` (0..H-1 within the period), in link order."""
        if not is_int(iteration) or not 0 <= iteration < self.period:
            raise ValueError(f"iteration must be an int in [0, {self.period}), got {iteration!r}")
        return tuple(s for s in self.syncs if s.iteration == iteration)

    def iteration_of(self, step: int) -> int:
        """Iteration within the period of global training step ``step`` (the plan starts at effective_step)."""
        if not is_int(step) or step < self.effective_step:
            raise ValueError(f"step must be an int >= effective_step {self.effective_step}, got {step!r}")
        return (step - self.effective_step) % self.period

    def inflight_share(self, layer_bytes: Sequence[int]) -> float:
        """The largest share of the model's bytes (``layer_bytes`` per layer) whose syncs are in flight between two
        steps: a sync launched at iteration i with delay d travels across the ends of steps i .. i+d-1 (the period
        repeats, so a late sync wraps into the next one). Its host buffers (snapshot and mean) live that long."""
        total = sum(layer_bytes)
        if total <= 0:
            return 0.0
        ends = [0] * self.period
        for sync in self.syncs:
            nbytes = sum(layer_bytes[li] for li in sync.layers)
            for k in range(sync.delay):
                ends[(sync.iteration + k) % self.period] += nbytes
        return max(ends) / total

    def step_time_s(self) -> float:
        """Predicted mean time of one training step: compute plus the mean exposed wait."""
        return self.compute_s + math.fsum(self.exposed_s) / self.period

    def digest(self) -> int:
        """64 bits naming what the plan's rounds are: which layers sync at which step with which delay.

        Two plans with equal digests run the same rounds; predictions (start times, exposed waits) are
        left out, so members whose measurements differ slightly but decide the same schedule agree.
        """
        shape = [self.version, self.effective_step, self.period, list(self.layer_names)]
        shape += [[s.iteration, list(s.layers), s.delay, s.repeat] for s in self.syncs]
        raw = hashlib.sha256(json.dumps(shape, separators=(",", ":")).encode()).digest()
        return int.from_bytes(raw[:8], "big")

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe form; ``from_dict`` restores an equal plan (floats survive JSON via repr exactly)."""
        return {
            "format": PLAN_FORMAT,
            "version": self.version,
            "effective_step": self.effective_step,
            "period": self.period,
            "layer_names": list(self.layer_names),
            "syncs": [s.to_dict() for s in self.syncs],
            "exposed_s": [float(w) for w in self.exposed_s],
            "compute_s": float(self.compute_s),
        }

    @staticmethod
    def from_dict(d: Mapping[str, Any]) -> Plan:
        """Rebuild a plan from ``to_dict`` output, refusing anything malformed with ValueError."""
        if not isinstance(d, Mapping):
            raise ValueError(f"plan must be a mapping, got {type(d).__name__}")
        if d.get("format") != PLAN_FORMAT:
            raise ValueError(f"unknown plan format {d.get('format')!r}, expected {PLAN_FORMAT!r}")
        keys = ("version", "effective_step", "period", "layer_names", "syncs", "exposed_s", "compute_s")
        missing = [k for k in keys if k not in d]
        if missing:
            raise ValueError(f"plan lacks fields {missing}")
        for k in ("layer_names", "syncs", "exposed_s"):
            if not isinstance(d[k], list | tuple):
                raise ValueError(f"plan field {k!r} must be a list")
        syncs = []
        for i, raw in enumerate(d["syncs"]):
            if not isinstance(raw, Mapping):
                raise ValueError(f"sync {i} must be a mapping")
            fields = ("iteration", "layers", "delay", "start_s", "comm_s", "repeat")
            if sorted(raw.keys()) != sorted(fields):
                raise ValueError(f"sync {i} must have exactly the fields {list(fields)}")
            if not isinstance(raw["layers"], list | tuple):
                raise ValueError(f"sync {i}: layers must be a list")
            syncs.append(
                GroupSync(
                    iteration=raw["iteration"],
                    layers=tuple(raw["layers"]),
                    delay=raw["delay"],
                    start_s=_as_float(f"sync {i} start_s", raw["start_s"]),
                    comm_s=_as_float(f"sync {i} comm_s", raw["comm_s"]),
                    repeat=raw["repeat"],
                )
            )
        return Plan(
            version=d["version"],
            effective_step=d["effective_step"],
            period=d["period"],
            layer_names=tuple(d["layer_names"]),
            syncs=tuple(syncs),
            exposed_s=tuple(_as_float("exposed_s", w) for w in d["exposed_s"]),
            compute_s=_as_float("compute_s", d["compute_s"]),
        )


def _as_float(name: str, value: object) -> float:
    if not _is_real(value):
        raise ValueError(f"{name} must be a number, got {value!r}")
    return float(value)  # type: ignore[arg-type]


def total_exposed(plan: Plan) -> float:
    """Predicted exposed wait summed over one period."""
    return math.fsum(plan.exposed_s)
