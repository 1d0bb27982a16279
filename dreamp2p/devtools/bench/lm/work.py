"""`bench lm`'s workload: the byte-level GPT, its corpus and shards, one region's training loop, the ceiling.

Everything a region process runs (as a `run_local` job, or with nothing of dreamp2p attached for the
ceiling); the bench itself (`bench.lm.run`) starts the regions and writes the report.
"""

from __future__ import annotations

import functools
import logging
import math
import multiprocessing as mp
import multiprocessing.connection
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from dreamp2p.devtools.bench.lm.speeds import throttle_s
from dreamp2p.devtools.launch import child_context, expect_message, reap, start_child
from dreamp2p.devtools.netns import wire_bytes
from dreamp2p.errors import FlushIncomplete, RoundFailed
from dreamp2p.manifest import param_digest, state_digest
from dreamp2p.node import Node
from dreamp2p.service.tasks import ByteTransformer, stdlib_files
from dreamp2p.sync.comm.process import CommProcess
from dreamp2p.sync.strategies.dreamddp import DreamDDP, plan_summary

log = logging.getLogger(__name__)

JOB = "dreamp2p.devtools.bench.lm.work:lm_job"
HELDOUT_FRACTION = 0.05
EVAL_POINTS = 10  # held-out evaluations per run (plus the final one)
WEIGHT_DECAY = 0.1
BETAS = (0.9, 0.95)
SEED = 0
VOCAB = 256


# ---------------------------------------------------------------------------------------------- workload


def load_corpus() -> tuple[torch.Tensor, torch.Tensor]:
    """The standard library's source as bytes (uint8): (training part, held-out last 5%)."""
    chunks = []
    for path in stdlib_files():
        try:
            chunks.append(path.read_bytes())
        except OSError:
            continue
    data = torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8)
    cut = int(data.numel() * (1.0 - HELDOUT_FRACTION))
    return data[:cut], data[cut:]


def train_shard(train: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """Shard ``rank`` of ``world``: a contiguous slice of the training part."""
    size = train.numel() // world
    return train[rank * size : (rank + 1) * size]


def windows(data: torch.Tensor, starts: torch.Tensor, context: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and next-byte targets of the windows starting at ``starts``."""
    w = data[starts.unsqueeze(1) + torch.arange(context + 1)].long()
    return w[:, :-1].to(device), w[:, 1:].to(device)


def train_batch(
    shard: torch.Tensor, rank: int, step: int, batch: int, context: int, device: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Region ``rank``'s batch of ``step``: a pure function of (rank, step), the same in every run."""
    g = torch.Generator().manual_seed(SEED * 1_000_003 + rank * 7919 + step)
    starts = torch.randint(0, shard.numel() - context - 1, (batch,), generator=g)
    return windows(shard, starts, context, device)


def eval_set(
    heldout: torch.Tensor, eval_batches: int, batch: int, context: int, device: str
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The fixed held-out batches every strategy, region and the ceiling are evaluated on."""
    g = torch.Generator().manual_seed(SEED + 7)
    starts = torch.randint(0, heldout.numel() - context - 1, (eval_batches, batch), generator=g)
    return [windows(heldout, s, context, device) for s in starts]


def make_model(width: int, layers: int, heads: int, context: int, device: str) -> nn.Module:
    torch.manual_seed(SEED)
    return ByteTransformer(context, width, layers, heads).to(device)


def make_optimizer(model: nn.Module, lr: float) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=lr, betas=BETAS, weight_decay=WEIGHT_DECAY)


def count_params(width: int, layers: int, heads: int, context: int) -> int:
    return sum(p.numel() for p in ByteTransformer(context, width, layers, heads).parameters())


def lm_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1))


@torch.no_grad()
def heldout_loss(model: nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    was = model.training
    model.eval()
    loss = sum(float(lm_loss(model, x, y)) for x, y in batches) / len(batches)
    model.train(was)
    return loss if math.isfinite(loss) else float("inf")


def eval_every(steps: int) -> int:
    return max(1, math.ceil(steps / EVAL_POINTS))


def _sync_device(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


# ---------------------------------------------------------------------------------------------- one region


class _Workload:
    """Everything one region (or ceiling process) trains on, built identically in every process."""

    def __init__(self, rank: int, world: int, a: dict[str, Any]) -> None:
        torch.set_num_threads(1)
        self.rank = rank
        self.a = a
        train, heldout = load_corpus()
        self.shard = train_shard(train, rank, world)
        self.evals = eval_set(heldout, a["eval_batches"], a["batch"], a["context"], a["device"])
        self.model = make_model(a["width"], a["layers"], a["heads"], a["context"], a["device"])
        self.opt = make_optimizer(self.model, a["lr"])
        self.speed = float(a.get("speeds", [1.0] * world)[rank])  # `bench lm --slow` (`lm.speeds`)

    def loop(
        self,
        step: Callable[[], Any],
        zero_grad: Callable[[], Any],
        wire: Callable[[], int] | None,
        clock: Callable[[], int] | None = None,
    ) -> dict[str, Any]:
        """The timed training loop; parameter copies every ``eval_every`` steps (clock paused meanwhile).

        ``wire``: the region's link counter (bytes it has put on the wire so far), read at loop start and end.
        ``clock``: the strategy's step counter, run until it reaches ``steps`` (time-paced periods: a slow
        region follows the cluster's clock and takes fewer local steps, ``local_steps``); None: ``steps`` steps.
        """
        a, model = self.a, self.model
        steps, device, every = a["steps"], a["device"], eval_every(a["steps"])
        snaps: list[tuple[int, float, int, list[torch.Tensor]]] = []  # (clock step, loop time, local steps, copy)
        losses: list[float] = []
        wall = copies = 0.0
        wire0 = wire() if wire else 0
        cpu0, thread0 = time.process_time(), time.thread_time()
        t = time.perf_counter()
        k = 0
        while (clock() if clock is not None else k) < steps:
            busy0 = time.thread_time()
            x, y = train_batch(self.shard, self.rank, k, a["batch"], a["context"], device)
            loss = lm_loss(model, x, y)
            loss.backward()
            step()
            zero_grad()
            losses.append(loss.item())
            if self.speed < 1.0:
                time.sleep(throttle_s(time.thread_time() - busy0, self.speed))
            k += 1
            now = clock() if clock is not None else k
            # one copy per ``every`` steps of the clock, so that every region's curve has the same steps (a
            # region that follows the clock may pass several at once: the same copy for each)
            marks = [m for m in range(every * (len(snaps) + 1), min(now, steps - 1) + 1, every)]
            if marks:
                _sync_device(device)
                wall += time.perf_counter() - t
                copy0 = time.thread_time()
                values = [p.detach().clone() for p in model.parameters()]
                snaps.extend((m, wall, k, values) for m in marks)
                copies += time.thread_time() - copy0  # not training: off the trainer's CPU as off its clock
                t = time.perf_counter()
        _sync_device(device)
        wall += time.perf_counter() - t
        thread = time.thread_time() - thread0
        comm_cpu = (time.process_time() - cpu0) - thread
        train_cpu = thread - copies
        sent = wire() - wire0 if wire else None
        snaps.append((steps, wall, k, [p.detach().clone() for p in model.parameters()]))
        tail = losses[-10:]
        return {
            "wall_s": wall,
            "local_steps": k,
            "tokens": k * a["batch"] * a["context"],  # the tokens this region trained on
            "comm_cpu_s": max(0.0, comm_cpu),
            "train_cpu_s": train_cpu,
            "wire_bytes": sent,
            "train_loss_last10": sum(tail) / len(tail) if tail else None,
            "snaps": snaps,
        }

    def evaluate(self, out: dict[str, Any]) -> dict[str, Any]:
        """Replace the parameter copies by their held-out losses: ``curve`` = [[step, loop time, loss], ...], and
        ``curve_local_steps`` the local steps this region had taken at each point."""
        curve, trained = [], []
        params = list(self.model.parameters())
        with torch.no_grad():
            for step, clock, local, values in out.pop("snaps"):
                for p, v in zip(params, values, strict=True):
                    p.copy_(v)
                curve.append([step, clock, heldout_loss(self.model, self.evals)])
                trained.append(local)
        out["curve"] = curve
        out["curve_local_steps"] = trained
        out["heldout_loss"] = curve[-1][2]
        return out


def lm_job(
    node: Node,
    rank: int,
    world: int,
    strategy: str,
    period: int,
    extra_sync: dict[str, Any],
    workload: dict[str, Any],
    wire_devs: list[str | None],
    wire_counter: str = "tbf",
) -> dict[str, Any]:
    """One region (a peer process started by `dreamp2p.devtools.launch.run_local`).

    ``wire_devs[rank]``: the region's end of its link in its namespace (None: no wire counter), read by
    ``wire_counter`` (see :func:`link_tx_bytes`).
    """
    w = _Workload(rank, world, workload)
    dev = wire_devs[rank]
    wire = functools.partial(link_tx_bytes, dev, wire_counter) if dev else None
    wire0 = wire() if wire else 0
    sync = node.attach(w.model, w.opt, strategy=strategy, period=period, **extra_sync)
    attach_wire = wire() - wire0 if wire else None
    child_cpu = node.comm.cpu_seconds if isinstance(node.comm, CommProcess) else lambda: 0.0
    cpu0 = child_cpu()
    out = w.loop(sync.step, sync.zero_grad, wire, lambda: sync.step_count)
    out["comm_cpu_s"] += child_cpu() - cpu0  # the comm process's CPU, with [node] comm = "process"
    out["comm"] = node.config.comm
    tot = sync.totals
    out.update(
        exposed_s=tot.exposed_s,
        comm_s=tot.comm_s,
        compute_s=tot.compute_s,
        bytes_sent=tot.bytes_sent,
        digest=param_digest(w.model),  # before close(): rounds still in flight would change it
        rounds_skipped=sync.rounds_skipped,
        exposed_by_plan=_exposed_by_plan(tot.history),
    )
    if isinstance(sync, DreamDDP):  # its plans, for the report only
        out["plan_history"] = [list(h) for h in sync.plan_history]
        out["plan_summary"] = plan_summary(sync)
        # what each control round gathered: when they ran, and the link every re-plan decision saw
        out["controls"] = [[step, _mb(bw), _mb(goodput)] for step, bw, goodput in sync.controls_seen]
        # the plan in force, the profile and link it was made from, and its codec: `bench plancheck`
        # replays the planner's prediction on exactly these inputs
        out["plan_report"] = {**sync.plan_report(), "codec": sync.sync_codec, "anchor_codec": sync.plan_codec}
    sync.close()
    # the replicas as a user ends a run: one flush, then the model every region holds alike
    wire0 = wire() if wire else 0
    t0 = time.perf_counter()
    try:
        sync.flush()
        out["flush_error"] = None
    except (FlushIncomplete, RoundFailed) as exc:  # reported, not fatal: the table shows which runs it hit
        out["flush_error"] = f"{type(exc).__name__}: {exc}"
    out.update(
        attach_wire_bytes=attach_wire,
        flush_wire_bytes=wire() - wire0 if wire else None,
        flush_s=time.perf_counter() - t0,
        flushed_digest=state_digest(w.model),
        heldout_loss_flushed=heldout_loss(w.model, w.evals),
    )
    return w.evaluate(out)


def link_tx_bytes(dev: str, counter: str) -> int:
    """Bytes the region's link end ``dev`` (in this process's namespace) has put on the wire so far.

    ``counter``: "tbf", its tbf root qdisc's counter (`netns.wire_bytes`: every segment's headers counted);
    "dev", the device's own transmit counter: on the packet emulator's TUN device, the IP bytes the region
    handed the emulator (equal to the emulator's ``in_bytes`` from this region, before its drops and losses).
    """
    if counter == "tbf":
        return wire_bytes(dev)
    if counter == "dev":
        # /proc/net/dev is this process's namespace's (the region entered its namespace with setns, so /sys
        # still shows the parent's): "name: 8 receive counters, then transmit bytes ..."
        for line in Path("/proc/net/dev").read_text().splitlines():
            name, colon, fields = line.partition(":")
            if colon and name.strip() == dev:
                return int(fields.split()[8])
        raise RuntimeError(f"no device {dev} in this process's network namespace")
    raise ValueError(f"unknown wire counter {counter!r}: tbf or dev")


def _mb(bps: float) -> float | None:
    """B/s as MB/s for the report (None where nothing was measured)."""
    return round(bps / 1e6, 3) if math.isfinite(bps) else None


def _exposed_by_plan(history: Sequence[Any]) -> dict[str, list[float]]:
    """Per plan version: [steps, exposed_s, comm_s] of one region (DreamDDP's warm-up plan v0 vs measured ones)."""
    out: dict[str, list[float]] = {}
    for s in history:
        row = out.setdefault(str(s.plan_version), [0, 0.0, 0.0])
        row[0] += 1
        row[1] += s.exposed_s
        row[2] += s.comm_s
    return out


def ceiling_child(
    rank: int, world: int, workload: dict[str, Any], barrier: Any, conn: mp.connection.Connection
) -> None:
    """One ceiling process: the same loop with a plain AdamW step, no dreamp2p, no network."""
    try:
        w = _Workload(rank, world, workload)
        barrier.wait(300)
        out = w.loop(w.opt.step, w.opt.zero_grad, None)
        conn.send(("ok", w.evaluate(out)))
    except BaseException as exc:  # report every failure to the parent
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        raise
    finally:
        conn.close()


def run_ceiling(n: int, workload: dict[str, Any], timeout: float) -> list[dict[str, Any]]:
    """``n`` concurrent plain training processes (started together); their results in rank order."""
    barrier = child_context().Barrier(n)
    pipes, procs = [], []
    for rank in range(n):
        p, parent = start_child(ceiling_child, (rank, n, workload, barrier), pipe_at=4)
        pipes.append(parent)
        procs.append(p)
    deadline = time.monotonic() + timeout
    try:
        results = [expect_message(pipes[r], "ok", deadline, f"ceiling rank {r}") for r in range(n)]
        for p in procs:
            p.join(max(1.0, deadline - time.monotonic()))
        return results
    finally:
        reap(procs, pipes)
