"""Fault injection with real processes on loopback: a peer killed with SIGKILL mid-run, then restarted.

The parent starts N trainer processes (the regression task of `bench.jobs.training`, DreamDDP by default),
kills one with SIGKILL once every rank is past ``kill_at`` (rounds are in flight all the time), checks
that the survivors keep stepping, restarts the victim as a joining node (state transfer from the live
members, start at the cluster's step), and finally has every rank train to the same step, then run a
quiet stretch with learning rate 0 so that every layer is averaged with nothing local on top, and
(streaming, DreamDDP) flush: the replicas must then hold identical parameters. With ``rejoin=False`` the
victim stays dead and only the survivors finish. Each rank reports why its failed rounds failed
(`peer.rounds.RoundFailure`), so a test can tell a round given up because a member left from one that
waited out its deadline. Used by the fault tests (issues 5 and 14) and the recovery benchmark.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from dataclasses import dataclass
from multiprocessing.sharedctypes import Synchronized
from typing import Any

from dreamp2p.config import PeerInfo
from dreamp2p.devtools.launch import child_context, expect_message, node_config, reap, start_child
from dreamp2p.devtools.localrun import free_ports

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FaultReport:
    results: list[dict[str, Any]]  # per rank (the victim's from its restarted process)
    steps_at_kill: list[int]
    survivor_steps_after_kill: list[int]  # where the survivors were before the victim came back
    seconds_to_progress: float  # from the kill until every survivor had made `progress` more steps
    joined_at: int  # the step the restarted victim started at (-1 without a rejoin)


def _child(
    rank: int,
    conn: Any,
    step_box: Synchronized[int],
    config: dict[str, Any],
    ring: list[tuple[str, str]],
    join: bool,
    args: dict[str, Any],
) -> None:
    logging.basicConfig(level=logging.WARNING, format=f"%(asctime)s p{rank} %(name)s %(levelname)s %(message)s")
    import math

    import torch
    from torch import nn

    from dreamp2p.devtools.bench.jobs.training import batch, student
    from dreamp2p.manifest import param_digest
    from dreamp2p.node import Node
    from dreamp2p.sync.comm.thread import CommThread

    torch.set_num_threads(1)
    node = Node(node_config(rank, config), joining=join)
    try:
        node.connect([PeerInfo(n, a) for n, a in ring], require_all=not join)
        model = student(args["width"], args["depth"], seed=rank)
        opt = torch.optim.SGD(model.parameters(), lr=args["lr"])
        s = node.attach(model, opt, strategy=args["strategy"], join=join, **args["sync"])
        conn.send(("started", s.step_count))
        losses: list[tuple[int, float]] = []
        final: int | None = None
        quiet = args["quiet_steps"]
        while final is None or s.step_count < final + quiet:
            if final is None and conn.poll():
                final = int(conn.recv())
            step = s.step_count
            if final is not None and step == final:
                for group in opt.param_groups:
                    group["lr"] = 0.0  # from here on only averaging changes the parameters
            x, y = batch(rank, step, args["batch_size"])
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            time.sleep(args["step_sleep"])
            s.step()
            s.zero_grad()
            if not math.isfinite(loss.item()):
                raise RuntimeError(f"loss became {loss.item()} at step {step}")
            losses.append((step, loss.item()))
            step_box.value = s.step_count
        s.close()
        flushed = s.flush() if args.get("flush") else None
        failures: list[tuple[tuple[int, int], str, bool]] = []
        if isinstance(node.comm, CommThread):  # a comm process keeps its peer to itself
            peer = node.comm.peer
            failures = node.comm.on_loop(lambda: [(f.key, f.reason, f.deadline) for f in peer.rounds.failures])
        conn.send(("done", None))
        conn.recv()  # every rank is done: nobody sends to us any more
        conn.send(
            (
                "ok",
                {
                    "losses": losses,
                    "digest": param_digest(model),
                    "flush_path": flushed,
                    "step": s.step_count,
                    "skipped": s.rounds_skipped,
                    "view_changes": node.comm.view_changes,
                    "failures": failures,
                },
            )
        )
    except BaseException as exc:
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        raise
    finally:
        node.close()


def _job_args(strategy: str, sync: dict[str, Any] | None, step_sleep: float) -> dict[str, Any]:
    """What every trainer process of the scenario runs: the task, the strategy and its quiet stretch."""
    sync = sync or {"period": 5, "warmup_steps": 3, "control_every": 5, "max_delay": 2}
    period = int(sync.get("period", 10))
    return {
        "width": 64,
        "depth": 3,
        "lr": 0.05,
        "batch_size": 32,
        "strategy": strategy,
        "sync": sync,
        "step_sleep": step_sleep,
        # Streaming DiLoCo keeps a share (mix_alpha) of each replica's own parameters at every fragment
        # sync, and DreamDDP's 2-bit and sparse syncs leave what they did not carry in each replica
        # (keep_unsent), so replicas approach each other but only flush() makes them identical. DreamDDP's
        # flush goes through its compressed path only where every member's outer weights agree: what the
        # quiet stretch alone showed before
        "flush": strategy in ("streaming", "dreamddp"),
        # every layer syncs once per period and may land max_delay later: two periods leave no doubt
        "quiet_steps": 2 * period + int(sync.get("max_delay", 0)) + 1,
    }


def kill_and_rejoin(
    n: int = 4,
    victim: int = 3,
    kill_at: int = 30,
    progress: int = 20,
    after_join: int = 40,
    sync: dict[str, Any] | None = None,
    transport: dict[str, Any] | None = None,
    strategy: str = "dreamddp",
    step_sleep: float = 0.02,
    timeout: float = 240.0,
    rejoin: bool = True,
    victim_transport: dict[str, Any] | None = None,
) -> FaultReport:
    """Run the scenario in the module docstring; raises RuntimeError with the failing rank's reason.

    ``victim_transport`` overrides the victim's transport settings until it is killed (a ``rate_limit``
    makes every round with it long, so the kill surely lands while rounds with it are in flight).
    """
    args = _job_args(strategy, sync, step_sleep)
    config = {"transport": {"heartbeat_s": 0.5, "round_timeout_s": 30.0, **(transport or {})}}
    ports = free_ports(n)
    ring = [(f"p{r}", f"127.0.0.1:{ports[r]}") for r in range(n)]
    ctx = child_context()
    boxes = [ctx.Value("q", 0) for _ in range(n)]
    procs: list[Any] = [None] * n
    pipes: list[Any] = [None] * n
    deadline = time.monotonic() + timeout

    def spawn(rank: int, join: bool) -> None:
        cfg = {**config, "listen": ring[rank][1]}
        if rank == victim and not join and victim_transport:
            cfg["transport"] = {**config["transport"], **victim_transport}
        procs[rank], pipes[rank] = start_child(_child, (rank, boxes[rank], cfg, ring, join, args), pipe_at=1)

    try:
        for rank in range(n):
            spawn(rank, join=False)
        for rank in range(n):
            expect_message(pipes[rank], "started", deadline, f"rank {rank}")
        while min(b.value for b in boxes) < kill_at:
            if time.monotonic() > deadline:
                raise RuntimeError(f"ranks did not reach step {kill_at}: {[b.value for b in boxes]}")
            time.sleep(0.05)
        os.kill(procs[victim].pid, signal.SIGKILL)  # no goodbye: rounds with it are in flight
        t_kill = time.monotonic()
        at_kill = [b.value for b in boxes]
        procs[victim].join(10)
        survivors = [r for r in range(n) if r != victim]
        while any(boxes[r].value < at_kill[r] + progress for r in survivors):
            if time.monotonic() > deadline:
                raise RuntimeError(f"survivors stalled after the kill: {[b.value for b in boxes]} (at kill {at_kill})")
            time.sleep(0.05)
        to_progress = time.monotonic() - t_kill
        after_kill = [boxes[r].value for r in range(n)]
        joined_at = -1
        if rejoin:
            spawn(victim, join=True)
            joined_at = int(expect_message(pipes[victim], "started", deadline, f"rank {victim} (restarted)"))
        ranks = list(range(n)) if rejoin else survivors
        final = max(boxes[r].value for r in ranks) + after_join
        for rank in ranks:
            pipes[rank].send(final)
        for rank in ranks:
            expect_message(pipes[rank], "done", deadline, f"rank {rank}")
        for rank in ranks:
            pipes[rank].send("close")
        got = {rank: expect_message(pipes[rank], "ok", deadline, f"rank {rank}") for rank in ranks}
        results = [got.get(rank, {}) for rank in range(n)]
        return FaultReport(results, at_kill, after_kill, to_progress, joined_at)
    finally:
        reap(procs)
