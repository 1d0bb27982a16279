"""The DreamDDP simulator: the steady-state Gantt timeline of one period of a plan, on any link.

Comm times are recomputed from the link given (the plan's own predictions are not trusted) and run through
the planner's cyclic link model (`schedule.timing`), so a plan can be judged on a link it was not made for;
the per-iteration timelines are what the run report draws its Gantt chart from. Pure: no I/O, no clocks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from dreamp2p.schedule.cost import LayerCost, LinkModel, ring_comm_time
from dreamp2p.schedule.plan import Plan
from dreamp2p.schedule.timing import Job, profile_of, steady_state


@dataclass(frozen=True)
class ComputeBlock:
    """Forward or backward computation of one layer, in seconds from the start of the simulated period."""

    layer: int  # forward index
    phase: str  # "fwd" or "bwd"
    start_s: float
    end_s: float


@dataclass(frozen=True)
class CommBlock:
    """One sync on the link, in seconds from the start of the simulated period (may run past its iteration)."""

    layers: tuple[int, ...]
    launch_iteration: int
    due_iteration: int  # (launch + delay) % H: its result is merged before this iteration's optimizer step
    repeat: bool
    start_s: float
    end_s: float


@dataclass(frozen=True)
class IterationTimeline:
    """Gantt data of one iteration of the steady-state period."""

    iteration: int
    start_s: float  # forward begins
    backward_start_s: float
    backward_end_s: float
    end_s: float  # optimizer step: backward end plus the exposed wait
    exposed_s: float
    compute: tuple[ComputeBlock, ...]
    comm: tuple[CommBlock, ...]  # syncs launched in this iteration


# The per-iteration timeline is the unit a Gantt chart is drawn from.
Timeline = IterationTimeline


def simulate(plan: Plan, costs: Sequence[LayerCost], link: LinkModel) -> list[IterationTimeline]:
    """Steady-state timeline of one period of ``plan`` executed with ``costs`` on ``link``.

    Comm times are recomputed from ``link`` (the plan's predictions are not trusted), in the plan's link order,
    with the same cyclic model the planner uses; so a plan can be judged on a link it was not made for.
    """
    prof = profile_of(costs)
    if prof.names != plan.layer_names:
        raise ValueError("costs do not describe the plan's layers (names differ)")
    H = plan.period
    jobs = [
        Job(
            s.iteration,
            s.layers,
            s.delay,
            s.repeat,
            max(prof.ready[x] for x in s.layers),
            ring_comm_time(sum(prof.nbytes[x] for x in s.layers), link),
        )
        for s in plan.syncs
    ]
    cyc = steady_state(jobs, H, prof.B, prof.F)
    out = []
    t = 0.0
    L = prof.L
    for h in range(H):
        compute = []
        clock = t
        for x in range(L):
            compute.append(ComputeBlock(x, "fwd", clock, clock + prof.fwd[x]))
            clock += prof.fwd[x]
        bstart = clock
        for x in range(L - 1, -1, -1):
            compute.append(ComputeBlock(x, "bwd", clock, clock + costs[x].bwd_s))
            clock += costs[x].bwd_s
        bend = bstart + prof.B
        comm = tuple(
            CommBlock(job.layers, h, (h + job.delay) % H, job.repeat, bstart + cyc.starts[j], bstart + cyc.finishes[j])
            for j, job in enumerate(jobs)
            if job.iteration == h
        )
        end = bend + cyc.exposed[h]
        out.append(IterationTimeline(h, t, bstart, bend, end, cyc.exposed[h], tuple(compute), comm))
        t = end
    return out
