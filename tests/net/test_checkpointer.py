"""`Checkpointer` in process, on a one-member ring on loopback (issue 13, deliver 4): its cadence, what it
saves and restores (strategy, scheduler, GradScaler), its signal handlers and their removal. The real SIGTERM
to a library process is tests/e2e/test_library_lifecycle.py."""

from __future__ import annotations

import logging
import shutil
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import resize_tmpfs, small_tmpfs
from torch import nn

from dreamp2p.config import PeerConfig, PeerInfo
from dreamp2p.manifest import param_digest
from dreamp2p.node import Node
from dreamp2p.service.checkpoint import (
    CheckpointWriteError,
    checkpoint_file,
    checkpoint_step,
    list_checkpoints,
    load_latest,
)
from dreamp2p.service.lifecycle import Checkpointer


@pytest.fixture
def node() -> Iterator[Node]:
    n = Node(PeerConfig(node_id="solo", cluster_id="lib", listen="127.0.0.1:0"))
    try:
        n.connect([PeerInfo("solo", n.address)])
        yield n
    finally:
        n.close()


def setup(node: Node, directory: Path) -> tuple[Checkpointer, Any, Any, torch.amp.GradScaler, nn.Module]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    ckpt = Checkpointer(node, directory, every_steps=3)
    sync = ckpt.attach(model, torch.optim.AdamW(model.parameters(), lr=0.01), strategy="localsgd", period=2)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(sync, T_max=20)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=2)
    ckpt.track(scheduler=sched, scaler=scaler)
    return ckpt, sync, sched, scaler, model


def train(
    sync: Any, sched: Any, scaler: torch.amp.GradScaler, model: nn.Module, ckpt: Checkpointer, n: int
) -> list[int]:
    saved = []
    for _ in range(n):
        x = torch.randn(8, 4, generator=torch.Generator().manual_seed(sync.step_count))
        scaler.scale(nn.functional.mse_loss(model(x), x.sum(1, keepdim=True))).backward()
        scaler.step(sync)
        scaler.update()
        sync.zero_grad()
        sched.step()
        if ckpt.maybe_save() is not None:
            saved.append(sync.step_count)
        assert ckpt.maybe_save() is None  # never twice for one step
    return saved


def test_saves_every_n_steps_and_restores_strategy_scheduler_and_scaler(node: Node, tmp_path: Path) -> None:
    ckpt, sync, sched, scaler, model = setup(node, tmp_path)
    with ckpt:
        assert ckpt.resumed_from is None and sync.step_count == 0
        assert train(sync, sched, scaler, model, ckpt, 7) == [3, 6]
        path = ckpt.finish()  # step 7 was not saved yet
    assert [checkpoint_step(p) for p in list_checkpoints(tmp_path)] == [3, 6, 7]
    loaded = load_latest(tmp_path)
    assert loaded is not None and loaded[0] == path
    state = loaded[1]
    assert set(state) == {"sync", "scheduler", "scaler"}  # the daemon's format, plus what was tracked
    saved = (param_digest(model), sched.last_epoch, scaler.get_scale(), sync.param_groups[0]["lr"])
    assert scaler.get_scale() != 2.0**8  # the scaler moved (growth every 2 steps): its state is worth checking

    node2 = Node(PeerConfig(node_id="solo", cluster_id="lib", listen="127.0.0.1:0"))
    try:
        node2.connect([PeerInfo("solo", node2.address)])
        ckpt2, sync2, sched2, scaler2, model2 = setup(node2, tmp_path)
        with ckpt2:
            assert ckpt2.resumed_from == path and sync2.step_count == 7
            assert (param_digest(model2), sched2.last_epoch, scaler2.get_scale(), sync2.param_groups[0]["lr"]) == saved
            assert sched2.get_last_lr() == [saved[3]]
    finally:
        node2.close()


def test_signal_handlers_request_a_stop_and_are_put_back(node: Node, tmp_path: Path) -> None:
    before = signal.getsignal(signal.SIGTERM)
    with Checkpointer(node, tmp_path, every_steps=5) as ckpt:
        assert signal.getsignal(signal.SIGTERM) is not before
        assert not ckpt.stop_requested
        signal.raise_signal(signal.SIGTERM)
        assert ckpt.stop_requested and ckpt.signal == "SIGTERM"
    assert signal.getsignal(signal.SIGTERM) is before


def test_off_the_main_thread_no_handlers_but_a_stop_can_be_requested(node: Node, tmp_path: Path) -> None:
    before = signal.getsignal(signal.SIGTERM)
    made: list[Checkpointer] = []
    t = threading.Thread(target=lambda: made.append(Checkpointer(node, tmp_path, every_steps=5)))
    t.start()
    t.join()
    assert signal.getsignal(signal.SIGTERM) is before
    made[0].request_stop("done for today")
    assert made[0].stop_requested and made[0].signal == "done for today"
    made[0].close()


@pytest.mark.parametrize(("every", "keep"), [(0, 3), (5, 0)])
def test_refuses_bad_cadence(node: Node, tmp_path: Path, every: int, keep: int) -> None:
    with pytest.raises(ValueError, match="must be >= 1"):
        Checkpointer(node, tmp_path, every_steps=every, keep=keep)


def test_methods_before_attach_say_so(node: Node, tmp_path: Path) -> None:
    with (
        Checkpointer(node, tmp_path, every_steps=5, signals=False) as ckpt,
        pytest.raises(RuntimeError, match="attach"),
    ):
        ckpt.maybe_save()


def test_attach_leaves_broadcast_and_join_to_the_agreement(node: Node, tmp_path: Path) -> None:
    model = nn.Linear(2, 1)
    with Checkpointer(node, tmp_path, every_steps=5, signals=False) as ckpt, pytest.raises(ValueError, match="join"):
        ckpt.attach(model, torch.optim.SGD(model.parameters(), lr=0.1), join=True)


MiB = 1 << 20


def plain_steps(sync: Any, model: nn.Module, ckpt: Checkpointer, n: int) -> list[int]:
    """``n`` training steps, each followed by maybe_save (twice: never two tries in one step); the steps saved."""
    saved = []
    for _ in range(n):
        x = torch.randn(8, 64, generator=torch.Generator().manual_seed(sync.step_count))
        nn.functional.mse_loss(model(x), x).backward()
        sync.step()
        sync.zero_grad()
        if ckpt.maybe_save() is not None:
            saved.append(sync.step_count)
        assert ckpt.maybe_save() is None
    return saved


def fill_up(disk: Path, room: int) -> None:
    """Leave only ``room`` bytes free on the tmpfs: the disk filled up (logs, another job)."""
    resize_tmpfs(disk, shutil.disk_usage(disk).used + room)


def failures(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "not written" in r.getMessage()]


def test_a_full_disk_is_one_warning_and_training_goes_on_and_tries_at_the_next_interval(
    node: Node, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with small_tmpfs(tmp_path / "disk", 16 * MiB) as disk:
        torch.manual_seed(0)
        model = nn.Linear(64, 64)
        with Checkpointer(node, disk, every_steps=3, signals=False) as ckpt:
            sync = ckpt.attach(model, torch.optim.AdamW(model.parameters(), lr=0.01), strategy="localsgd", period=2)
            assert plain_steps(sync, model, ckpt, 3) == [3]
            first = checkpoint_file(disk, 3)
            size = first.stat().st_size
            fill_up(disk, size // 2)
            caplog.set_level(logging.WARNING, logger="dreamp2p.service.lifecycle")
            assert plain_steps(sync, model, ckpt, 3) == []  # step 6 could not be written ...
            assert sync.step_count == 6  # ... and training went on
            (warning,) = failures(caplog)  # one line per failed checkpoint, not one per maybe_save call
            assert warning.startswith(f"checkpoint of step 6 not written to {disk}: No space left on device (ENOSPC)")
            assert f"previous checkpoint {first} is kept" in warning and "next try at step 9" in warning
            assert "bytes free" in warning and "the state's tensors" in warning and "\n" not in warning
            assert [p.name for p in disk.iterdir()] == [first.name]  # no partial file keeps the disk full
            resize_tmpfs(disk, 16 * MiB)  # the operator makes room
            assert plain_steps(sync, model, ckpt, 3) == [9]  # the next interval tries again, and it fits
            assert len(failures(caplog)) == 1
            plain_steps(sync, model, ckpt, 1)
            fill_up(disk, size // 2)
            assert ckpt.finish() is None  # the final checkpoint of step 10 does not fit either: no raise
            last = failures(caplog)[-1]
            assert last.startswith("checkpoint of step 10 not written") and "stopping without it" in last
            assert f"previous checkpoint {checkpoint_file(disk, 9)} is kept" in last
        assert [checkpoint_step(p) for p in list_checkpoints(disk)] == [3, 9]
        loaded = load_latest(disk)
        assert loaded is not None and loaded[1]["sync"]["step"] == 9


def test_on_write_error_stop_raises_the_write_error(node: Node, tmp_path: Path) -> None:
    with small_tmpfs(tmp_path / "disk", 16 * MiB) as disk:
        torch.manual_seed(0)
        model = nn.Linear(64, 64)
        with Checkpointer(node, disk, every_steps=3, signals=False, on_write_error="stop") as ckpt:
            sync = ckpt.attach(model, torch.optim.AdamW(model.parameters(), lr=0.01), strategy="localsgd", period=2)
            assert plain_steps(sync, model, ckpt, 3) == [3]
            fill_up(disk, checkpoint_file(disk, 3).stat().st_size // 2)
            with pytest.raises(CheckpointWriteError, match="No space left on device") as info:
                plain_steps(sync, model, ckpt, 3)
            assert info.value.step == 6 and info.value.kept == checkpoint_file(disk, 3)
            assert [p.name for p in disk.iterdir()] == [checkpoint_file(disk, 3).name]


def test_refuses_an_unknown_write_error_policy(node: Node, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="on_write_error must be one of continue, stop"):
        Checkpointer(node, tmp_path, every_steps=5, signals=False, on_write_error="ignore")  # type: ignore[arg-type]
