"""`dreamp2p node --config FILE`: one region's daemon, trainer plus peer, run from a TOML file.

Lifecycle: load and validate the config, build the task and model, start the peer and connect to the
ring, attach the strategy (replicas start from rank 0's parameters, or from the newest checkpoint with
``--resume``), then train. Every step's numbers go to Prometheus and the run log; checkpoints are written
every ``checkpoint.every_steps`` (one the storage fails, a full disk say, is a warning and the next interval
tries again, unless ``checkpoint.on_write_error = "stop"``). SIGTERM/SIGINT stop after the current step:
rounds in flight are drained, a checkpoint is written, the peer shuts down, and the process exits 0. With
``--quiet-steps N`` the last N steps before the stop step run at learning rate 0, so only averaging moves the
parameters and every member ends with the same ones (what `dreamp2p bench chaos` checks by digest). How a
step is computed (the task or the user's recipe: optimizer, LR scheduler, data; ``[train]``'s accumulation,
clipping and AMP) is :mod:`dreamp2p.service.recipe`.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import threading
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dreamp2p.config.daemon import DaemonConfig
from dreamp2p.errors import FlushIncomplete, RoundFailed
from dreamp2p.manifest import manifest_hash, param_digest
from dreamp2p.node import Node
from dreamp2p.service.checkpoint import list_checkpoints
from dreamp2p.service.heaptrim import HeapTrimmer
from dreamp2p.service.lifecycle import JOIN, StopFlag, check_resume, save_or_warn
from dreamp2p.service.lifecycle import abort_when_stuck as _abort_when_stuck
from dreamp2p.service.lifecycle import drain as _drain
from dreamp2p.service.metrics import NodeMetrics, RecordKind
from dreamp2p.service.progresslog import ProgressLog
from dreamp2p.service.recipe import Training, make_training
from dreamp2p.service.region import (
    data_parallel,
    data_position,
    elastic_restart,
    rank_daemon_config,
    rank_device,
    region_agree_and_load,
    save_region_checkpoint,
    start_region,
    torchrun_place,
)
from dreamp2p.service.sdnotify import Notifier
from dreamp2p.sync.comm.shards import rank_node_id

log = logging.getLogger(__name__)


__all__ = ["StopFlag", "run_node"]  # StopFlag lives in service.lifecycle, shared with library loops


def _device(name: str) -> str:
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device = 'cuda' but no CUDA device is available")
    return name


def run_node(
    cfg: DaemonConfig,
    resume: bool = False,
    stop: StopFlag | None = None,
    stop_at_file: Path | None = None,
    join: bool = False,
    quiet_steps: int = 0,
) -> dict[str, Any]:
    """Train until ``task.steps``, a stop signal, or the step written in ``stop_at_file``; returns a summary.

    ``join``: the cluster is running without us (we are new, or restarted after a crash): take the state
    and step from the live members instead of a broadcast or our own checkpoint.

    ``stop_at_file`` lets an operator end a multi-node run cleanly: every node stops after the same
    step, so no node waits for a round that a stopped node will never join.

    ``quiet_steps``: the last steps before the stop step (``task.steps`` or the one in ``stop_at_file``)
    run at learning rate 0; checkpoints keep the configured learning rate.
    """
    stop = stop or StopFlag()
    node_cfg = cfg.node
    ring_ids = [p.node_id for p in node_cfg.ring] or [node_cfg.node_id]
    rank, world = ring_ids.index(node_cfg.node_id), len(ring_ids)
    device = _device(cfg.device)
    place = torchrun_place(os.environ)
    if place is not None:  # one local rank of a region (torchrun), see dreamp2p.service.region
        cfg, device = rank_daemon_config(cfg, place, resume, join), rank_device(device, place)
        if elastic_restart(os.environ) and not join:
            # torchrun restarted the region after one of its ranks died: the others trained on without it
            log.warning("torchrun restarted this region: joining the running cluster by state transfer")
            join, resume = True, False
        start_region(device)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    training = make_training(cfg, *data_position(rank, world, place), device)
    model = training.model
    node_cfg = dataclasses.replace(node_cfg, manifest_hash=manifest_hash(model.state_dict().items()))
    model = training.model = data_parallel(model, device) if place is not None else model
    who = rank_node_id(node_cfg.node_id, place.rank) if place is not None else node_cfg.node_id
    metrics = _start_metrics(cfg, who, device, model, resume, join)
    opt = training.optimizer
    if join and resume:
        raise ValueError("--join and --resume exclude each other: a joining node takes the live members' state")
    if resume:  # settings the checkpoint cannot take are refused here, on every node alike, before any wait
        check_resume(cfg.checkpoint.dir, cfg.sync)
    node = Node(node_cfg, joining=join)
    try:
        node.connect(require_all=not join)
        restored: tuple[Path, dict[str, Any]] | None = None
        if resume:
            decided = region_agree_and_load(cfg.checkpoint.dir, node)  # agree_and_load outside a region
            if decided == JOIN:
                # the cluster trained on without us: our checkpoint is older than its state
                log.warning("members are training: joining them instead of resuming from our checkpoint")
                node.stand_aside()
                join = True
            else:
                restored = decided
        sync = node.attach(model, opt, sync=cfg.sync, broadcast=restored is None, join=join)
        if join:
            metrics.record(RecordKind.JOIN, step=sync.step_count, digest=param_digest(model), resumed=resume)
        if restored is not None:
            path, state = restored
            sync.load_state_dict(state["sync"])
            log.info("resumed from %s at step %d", path, sync.step_count)
            metrics.record(RecordKind.RESUME, step=sync.step_count, path=str(path), digest=param_digest(model))
        training.restore(sync.step_count, restored[1] if restored is not None else None)
        done = threading.Event()
        watcher = threading.Thread(
            target=_abort_when_stuck, args=(stop, done, cfg.stop_grace_s, node), name="stop-watcher", daemon=True
        )
        watcher.start()
        try:
            return _train(cfg, training, model, sync, node, metrics, stop, stop_at_file, quiet_steps)
        finally:
            done.set()
    finally:
        node.close()
        metrics.close()


def _start_metrics(cfg: DaemonConfig, who: str, device: str, model: nn.Module, resume: bool, join: bool) -> NodeMetrics:
    """The node's run log and metrics (served when ``[metrics] listen`` is set), opened with its START record."""
    max_bytes = int(cfg.metrics.jsonl_max_mb * 1e6)
    metrics = NodeMetrics(who, cfg.metrics.run_dir, max_bytes, cfg.metrics.jsonl_files)
    metrics.record(
        RecordKind.START, device=device, params=sum(p.numel() for p in model.parameters()), resume=resume, join=join
    )
    if cfg.metrics.listen:
        port = metrics.serve(cfg.metrics.listen)
        log.info("metrics on %s (port %d)", cfg.metrics.listen, port)
    return metrics


def _read_stop_at(path: Path | None) -> int | None:
    if path is None:
        return None
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def _saved_state(sync: Any, training: Training) -> dict[str, Any]:
    """What a checkpoint holds: the strategy's state, the scheduler's and the GradScaler's.

    Between two steps the learning rates are the scheduled ones (a quiet stretch sets 0 only inside a step).
    """
    return {"sync": sync.state_dict(), **training.state()}


def _publish_step(
    cfg: DaemonConfig,
    sync: Any,
    node: Node,
    metrics: NodeMetrics,
    step: int,
    value: float,
    tokens_per_s: float,
    stats: Any,
    last_plan: int,
    lr: float = 0.0,
) -> int:
    """A finished step's gauges and records, the peer status and a changed plan; the plan version now seen."""
    metrics.step.set(step + 1)
    metrics.loss.set(value)
    metrics.tokens_per_s.set(tokens_per_s)
    metrics.step_stats(stats)
    metrics.hidden.set(sync.totals.hidden_fraction)
    metrics.plan_version.set(stats.plan_version)
    if step % cfg.metrics.log_every == 0:
        metrics.record(
            RecordKind.STEP,
            step=step,
            loss=value,
            tokens_per_s=tokens_per_s,
            exposed_s=stats.exposed_s,
            comm_s=stats.comm_s,
            hidden_fraction=stats.hidden_fraction,
            bytes_sent=stats.bytes_sent,
            plan_version=stats.plan_version,
            lr=lr,
        )
    if step % 10 == 0:
        metrics.peer_status(node.comm.status())
    if sync.plan_version != last_plan:
        last_plan = sync.plan_version
        report = sync.plan_report()
        if report is not None:
            metrics.write_json("plan.json", report)
    return last_plan


def _checkpoint(
    cfg: DaemonConfig, node: Node, sync: Any, training: Training, step: int, next_step: int | None
) -> Path | None:
    """The checkpoint of ``step``; None when the storage failed it under ``on_write_error = "continue"``
    (one warning line; ``next_step`` tries again, None at the stop)."""
    state = _saved_state(sync, training)
    return save_or_warn(
        lambda: save_region_checkpoint(node, cfg.checkpoint.dir, step, state, cfg.checkpoint.keep),
        cfg.checkpoint.on_write_error,
        next_step,
    )


def _interval_checkpoint(
    cfg: DaemonConfig, node: Node, sync: Any, training: Training, metrics: NodeMetrics, step: int, final: int
) -> bool:
    """``[checkpoint] every_steps`` came round at ``step``: land rounds in flight, save; False when the storage
    failed it."""
    sync.close()  # land rounds in flight so the checkpoint is a consistent cut
    # the next try: the next interval, or the stop's checkpoint; none when this is the last step
    next_try = min(step + cfg.checkpoint.every_steps, final) if step < final else None
    saved = _checkpoint(cfg, node, sync, training, step, next_try)
    if saved is not None:
        # the digest lets a resume be checked against what was saved (xxh3: cheap beside the write)
        digest = param_digest(training.model)
        metrics.record(RecordKind.CHECKPOINT, step=step, path=str(saved), digest=digest)
    return saved is not None


def _flush_at_end(sync: Any) -> str | None:
    """The run reached its last step: make every member that reached it bit-identical (``[train] flush_at_end``);
    how the trainable parameters became so (`Strategy.flush`), None where the flush did not complete.

    Each member ends at the same step count (``task.steps`` or the agreed stop step), so their flush rounds
    meet. Members that left before the end keep their own replicas: a warning, not a failed run.
    """
    log.info("flushing at the end of the run (step %d)", sync.step_count)
    try:
        path: str = sync.flush()
    except FlushIncomplete as exc:
        log.warning("the end-of-run flush left replicas apart: %s", exc)
        return None
    except RoundFailed as exc:
        log.warning("the end-of-run flush failed; each member keeps its own replica: %s", exc)
        return None
    log.info("flushed (%s): every member that reached the end holds the same parameters", path)
    return path


def _pace(t_step: float, min_step_s: float, stop: StopFlag) -> None:
    """Sleep out what is left of ``min_step_s`` since ``t_step`` (``[train] min_step_s``); a stop cuts it short."""
    if (rest := min_step_s - (time.perf_counter() - t_step)) > 0:
        stop.event.wait(rest)


def _train(
    cfg: DaemonConfig,
    training: Training,
    model: Any,
    sync: Any,
    node: Node,
    metrics: NodeMetrics,
    stop: StopFlag,
    stop_at_file: Path | None = None,
    quiet_steps: int = 0,
) -> dict[str, Any]:
    first_eval = last_eval = None
    failed_at = -1  # the step of the last checkpoint the storage failed
    last_plan = -1
    t_last = time.perf_counter()
    progress = ProgressLog(cfg.metrics.progress_every_s, sync, metrics)
    final = cfg.task.steps
    notifier = Notifier()  # systemd Type=notify: ready once attached, watchdog pings from the steps
    notifier.ready(f"training from step {sync.step_count}")
    heap = HeapTrimmer()
    while sync.step_count < final and not stop.event.is_set():
        step, t_step = sync.step_count, time.perf_counter()
        if step % 5 == 0 and (agreed := _read_stop_at(stop_at_file)) is not None:
            final = min(cfg.task.steps, max(agreed, step))
        try:
            done = training.step(sync, step, quiet=bool(quiet_steps) and step >= final - quiet_steps)
        except (RoundFailed, RuntimeError) as exc:
            if not stop.event.is_set():
                raise
            # stopping, and a round needed a peer that already left: this step did not happen here
            log.warning("step %d abandoned while stopping: %s", step, exc)
            sync.zero_grad()
            sync.abandon()
            break
        sync.zero_grad()
        _pace(t_step, cfg.train.min_step_s, stop)
        now = time.perf_counter()
        dt, t_last = now - t_last, now
        value, stats = done.loss, done.stats
        if not math.isfinite(value):
            raise RuntimeError(f"loss became {value} at step {step}")
        tokens_per_s = training.tokens_per_step / dt if dt > 0 else 0.0
        last_plan = _publish_step(cfg, sync, node, metrics, step, value, tokens_per_s, stats, last_plan, done.lr)
        notifier.watchdog()
        heap.maybe_trim()
        progress.step(step, final, value, tokens_per_s, stats.plan_version)
        if ((step + 1) % cfg.task.eval_every == 0 or step == 0) and (last_eval := training.evaluate()) is not None:
            first_eval = last_eval if first_eval is None else first_eval
            metrics.eval_loss.set(last_eval)
            metrics.record(RecordKind.EVAL, step=step, eval_loss=last_eval)
        saving = (step + 1) % cfg.checkpoint.every_steps == 0
        if saving and not _interval_checkpoint(cfg, node, sync, training, metrics, step + 1, final):
            failed_at = step + 1
    at_end = cfg.train.flush_at_end and sync.step_count >= final and not stop.event.is_set()
    flushed = _flush_at_end(sync) if at_end else None  # the STOP record below carries the digest
    notifier.stopping(f"draining at step {sync.step_count}")
    node.begin_drain()  # probes see NOT_SERVING while rounds in flight land
    _drain(sync, node, cfg.stop_grace_s)
    # the stop's checkpoint, unless the storage just failed this very step's (it said it stops without it)
    saved = _checkpoint(cfg, node, sync, training, sync.step_count, None) if failed_at != sync.step_count else None
    # a final checkpoint the storage failed: the newest one kept is what a resume finds
    path = saved if saved is not None else next(reversed(list_checkpoints(cfg.checkpoint.dir)), None)
    if (last_eval := training.evaluate()) is not None:
        metrics.record(RecordKind.EVAL, step=sync.step_count - 1, eval_loss=last_eval)
    checkpoint = str(path) if path is not None else None
    metrics.record(
        RecordKind.STOP,
        step=sync.step_count,
        signal=stop.signal,
        checkpoint=checkpoint,
        digest=param_digest(model),
        flushed=flushed,
    )
    return {
        "step": sync.step_count,
        "first_eval": first_eval,
        "last_eval": last_eval,
        "checkpoint": checkpoint,
        "signal": stop.signal,
    }
