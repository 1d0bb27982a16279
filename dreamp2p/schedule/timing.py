"""The timing model the DreamDDP planner and simulator share: layer profiles, syncs on one link, steady state.

See `schedule.dreamddp` (its module docstring) for the model: layers in forward order, layer ``x`` ready at
``ready(x)`` into the backward pass, syncs (`Job`) served one after another by one FIFO link, cyclically over
the period, and the exposed wait of each iteration in the steady state (`steady_state`). The planner
searches over jobs with it and the simulator (`schedule.simulate`) replays a plan with it, so a plan is
judged by the very model it was made with. Pure: no I/O, no torch, no clocks; plain float arithmetic in a
fixed order, so peers computing from agreed inputs get identical results.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from dreamp2p.schedule.cost import LayerCost
from dreamp2p.schedule.plan import is_int

# A steady state is normally reached in a few periods; the cap only bounds pathological float behaviour.
MAX_PERIODS = 64


@dataclass(frozen=True)
class Profile:
    """Per-layer times and sizes of one model, and when each gradient is ready in backward."""

    names: tuple[str, ...]
    fwd: tuple[float, ...]  # forward order
    nbytes: tuple[int, ...]  # forward order
    ready: tuple[float, ...]  # forward order: when layer x's gradient is ready in backward
    F: float  # total forward time
    B: float  # total backward time

    @property
    def L(self) -> int:
        return len(self.names)

    @property
    def compute_s(self) -> float:
        return self.F + self.B


def profile_of(costs: Sequence[LayerCost]) -> Profile:
    """The timing profile of ``costs`` (forward order); ValueError on anything but unique LayerCosts."""
    if isinstance(costs, str | bytes) or not isinstance(costs, Sequence):
        raise ValueError("costs must be a sequence of LayerCost")
    if not costs:
        raise ValueError("costs must hold at least one layer")
    for i, c in enumerate(costs):
        if not isinstance(c, LayerCost):
            raise ValueError(f"costs[{i}] must be a LayerCost, got {type(c).__name__}")
    names = tuple(c.name for c in costs)
    if len(set(names)) != len(names):
        raise ValueError("layer names must be unique")
    L = len(costs)
    ready = [0.0] * L
    acc = 0.0
    for x in range(L - 1, -1, -1):  # backward order: output layer first
        acc += costs[x].bwd_s
        ready[x] = acc
    fwd = tuple(float(c.fwd_s) for c in costs)
    F = 0.0
    for t in fwd:
        F += t
    return Profile(names, fwd, tuple(c.nbytes for c in costs), tuple(ready), F, acc)


def check_H(H: int) -> None:
    if not is_int(H) or H < 1:
        raise ValueError(f"H (the period) must be an int >= 1, got {H!r}")


def check_round_cost(round_cost_s: float) -> None:
    if isinstance(round_cost_s, bool) or not isinstance(round_cost_s, int | float):
        raise ValueError(f"round_cost_s must be a number, got {round_cost_s!r}")
    if not math.isfinite(round_cost_s) or round_cost_s < 0:
        raise ValueError(f"round_cost_s must be finite and >= 0, got {round_cost_s!r}")


def check_version(version: int, effective_step: int) -> None:
    if not is_int(version) or version < 0:
        raise ValueError(f"version must be an int >= 0, got {version!r}")
    if not is_int(effective_step) or effective_step < 0:
        raise ValueError(f"effective_step must be an int >= 0, got {effective_step!r}")


def layers_of(L: int, i: int, j: int) -> tuple[int, ...]:
    """Forward indices of backward positions [i, j), ascending."""
    return tuple(range(L - j, L - i))


@dataclass(frozen=True)
class Job:
    """One sync of the period on the link: its layers, launch iteration, delay and link time."""

    iteration: int
    layers: tuple[int, ...]
    delay: int
    repeat: bool
    release: float  # ready time of the group's last-ready layer, relative to its iteration's backward start
    comm: float


@dataclass(frozen=True)
class Cycle:
    """The steady-state timing of a period of jobs."""

    exposed: tuple[float, ...]  # per iteration, steady state
    starts: tuple[float, ...]  # per job, relative to its launch iteration's backward start
    finishes: tuple[float, ...]
    carry: tuple[float, ...]  # per iteration: link busy until (relative to its backward start) before its syncs


def steady_state(jobs: Sequence[Job], H: int, B: float, F: float) -> Cycle:
    """Steady-state timing of a period whose syncs share one FIFO link (jobs are given in link order)."""
    per_iter: list[list[int]] = [[] for _ in range(H)]
    for j, job in enumerate(jobs):
        per_iter[job.iteration].append(j)
    n = len(jobs)
    starts, finishes = [0.0] * n, [0.0] * n
    link_free = 0.0
    pending: list[tuple[int, int, float]] = []  # (iterations until due, job, finish rel. to current backward)
    history: list[tuple[float, tuple[tuple[int, int, float], ...]]] = [(link_free, ())]
    exposures: list[list[float]] = []
    carry = [0.0] * H
    cycle_len = 1
    for _ in range(MAX_PERIODS):
        exposed = [0.0] * H
        for h in range(H):
            carry[h] = link_free
            for j in per_iter[h]:
                start = max(jobs[j].release, link_free)
                finish = start + jobs[j].comm
                link_free = finish
                starts[j], finishes[j] = start, finish
                pending.append((jobs[j].delay, j, finish))
            wait = 0.0
            kept = []
            for left, j, finish in pending:
                if left == 0:
                    wait = max(wait, finish - B)
                else:
                    kept.append((left, j, finish))
            exposed[h] = wait
            # next backward starts after the rest of this backward, the wait and the next forward
            shift = B + wait + F
            link_free = max(0.0, link_free - shift)
            pending = [(left - 1, j, finish - shift) for left, j, finish in kept]
        exposures.append(exposed)
        state = (link_free, tuple(pending))
        if state in history:
            cycle_len = len(history) - history.index(state)
            break
        history.append(state)
    if cycle_len == 1:
        final = tuple(exposures[-1])
    else:  # periodic steady state of several periods: average each iteration's wait over the cycle
        tail = exposures[-cycle_len:]
        final = tuple(math.fsum(p[h] for p in tail) / cycle_len for h in range(H))
    return Cycle(final, tuple(starts), tuple(finishes), tuple(carry))
