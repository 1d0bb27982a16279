"""A straggler scenario for `launch.run_local`: one member's sends are slowed until a control file appears.

Every rank averages one tensor per step (round id = step) and sleeps ``step_s`` as its compute. The
``slow`` rank paces its sends to ``rate_Bps`` from the start, so it holds every round it is in, until the
file ``control_dir/lift`` exists: then it removes the limit and measures its links again (the control
hook a test uses to end the slowdown). Rank 0 writes that file once it has made ``lift_after`` rounds
without the slow rank (it was excluded as a straggler). Every rank stops after ``back`` rounds with all
members since the first eviction, at one after which nobody is excluded; rounds are all-or-none and the
verdicts are taken in them, so all stop after the same round.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import torch

from dreamp2p.errors import RoundFailed
from dreamp2p.peer import Peer

log = logging.getLogger(__name__)

LIFT_FILE = "lift"


async def straggler_run(
    peer: Peer,
    rank: int,
    world: int,
    *,
    slow: int,
    control_dir: str,
    numel: int,
    rate_Bps: float,
    lift_after: int,
    back: int,
    step_s: float = 0.05,
    probe_bytes: int = 32 << 10,
    max_steps: int = 5000,
) -> dict[str, Any]:
    """Run the scenario on one rank; returns its round counts by world size and its straggler counters."""
    lift = Path(control_dir) / LIFT_FILE
    slowed = rank == slow
    if slowed:
        peer.set_rate_limit(rate_Bps)
    await peer.probe_now(probe_bytes)  # every link has a measured rate before the first round
    by_world: dict[int, int] = {}
    full_at_eviction: int | None = None  # rounds with every member when the first eviction was judged
    failed, step, lifted_at, done = 0, 0, -1, False
    while not done and step < max_steps:
        step += 1
        if slowed and lifted_at < 0 and lift.exists():
            peer.set_rate_limit(None)
            await peer.probe_now(probe_bytes)
            lifted_at = step
        t = torch.full((numel,), float(rank + step))
        try:
            res = await peer.allreduce([t], group_id=0, round_id=step, guard_norm=False)
        except RoundFailed:
            failed += 1
        else:
            n = res.contributors
            by_world[n] = by_world.get(n, 0) + 1
            # read right after a round with every member: each member judged the same votes in it, so
            # each sees the same eviction count and exclusions here, and all stop after the same round
            status = peer.status()
            if full_at_eviction is None and status.straggler_evictions:
                full_at_eviction = by_world.get(world, 0)
            if n == world and full_at_eviction is not None and not status.excluded:
                done = by_world[world] - full_at_eviction >= back
            if rank == 0 and by_world.get(world - 1, 0) >= lift_after and not lift.exists():
                lift.write_text("lift\n")
        await asyncio.sleep(step_s)
    status = peer.status()
    return {
        "steps": step,
        "by_world": by_world,
        "failed": failed,
        "full_after_eviction": by_world.get(world, 0) - (full_at_eviction or 0),
        "lifted_at": lifted_at,
        "evictions": status.straggler_evictions,
        "returns": status.straggler_returns,
        "excluded": list(status.excluded),
        "failures": [(list(f.key), f.reason, f.deadline) for f in peer.rounds.failures],
    }
