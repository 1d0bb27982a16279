"""A checkpoint that cannot be written (full disk, I/O error): the error names the cause, the size needed and
the free space, the partial file is removed, the previous checkpoint is named and stays intact.

The full disk is real: a 1 MiB tmpfs (root only; skipped elsewhere with the reason). torch.save's zip
writer turns the ENOSPC of a write into ``RuntimeError: [enforce fail at inline_container.cc] unexpected
pos``; these tests check that the cause is found anyway.
"""

from __future__ import annotations

import errno
import os
import pickle
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import small_tmpfs

from dreamp2p.service.checkpoint import (
    CheckpointWriteError,
    failure_errno,
    list_checkpoints,
    load_latest,
    save_checkpoint,
    state_nbytes,
    write_failure_message,
)

MiB = 1 << 20


def temp_files(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.startswith("."))


def test_a_full_disk_names_the_cause_the_sizes_and_the_kept_checkpoint(tmp_path: Path) -> None:
    with small_tmpfs(tmp_path / "disk", MiB) as disk:
        small = {"w": torch.full((100_000,), 1.0)}  # 400 kB: fits
        first = save_checkpoint(disk, 1, small)
        big = {"w": torch.ones(200_000), "step": 2}  # 800 kB beside the first: does not fit
        with pytest.raises(OSError) as info:  # an OSError, not torch's RuntimeError about zip positions
            save_checkpoint(disk, 2, big)
        exc = info.value
        free = shutil.disk_usage(disk).free
        message = str(exc)
        assert exc.errno == errno.ENOSPC
        assert message.startswith(f"checkpoint of step 2 not written to {disk}: "), message
        assert "No space left on device (ENOSPC)" in message, message
        assert "800000 bytes" in message, message  # needed: the state's tensor bytes
        assert f"{free} bytes free" in message, message  # free after the partial file was removed
        assert f"previous checkpoint {first} is kept" in message, message
        assert "unexpected pos" not in message
        assert temp_files(disk) == []  # the partial file does not keep the disk full
        assert free > 600_000  # the space the partial file took is back
        assert isinstance(exc, CheckpointWriteError)
        assert (exc.step, exc.needed_bytes, exc.free_bytes, exc.kept) == (2, 800_000, free, first)
        assert 0 < exc.partial_bytes <= MiB
        assert list_checkpoints(disk) == [first]
        loaded = load_latest(disk)
        assert loaded is not None and loaded[0] == first and torch.equal(loaded[1]["w"], small["w"])
        # the next checkpoint that fits is written: nothing of the failed one is left in the way
        second = save_checkpoint(disk, 3, {"w": torch.full((100_000,), 3.0)})
        assert list_checkpoints(disk) == [first, second]


def test_without_a_previous_checkpoint_the_error_says_none_is_kept(tmp_path: Path) -> None:
    with small_tmpfs(tmp_path / "disk", MiB) as disk:
        with pytest.raises(CheckpointWriteError, match="No space left on device") as info:
            save_checkpoint(disk, 7, {"w": torch.ones(400_000)})
        assert info.value.kept is None and "no previous checkpoint" in str(info.value)
        assert list(disk.iterdir()) == []


def test_a_partial_file_left_by_a_dead_process_is_removed_before_the_next_write(tmp_path: Path) -> None:
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, check=True)
    pid = int(dead.stdout)
    with small_tmpfs(tmp_path / "disk", MiB) as disk:
        leftover = disk / f".ckpt-0000000005.pt.tmp-{pid}"  # a daemon killed mid-write, or an older version
        leftover.write_bytes(b"\0" * 700_000)
        kept = disk / "unrelated.bin"  # other files are not ours to remove
        kept.write_bytes(b"x")
        path = save_checkpoint(disk, 6, {"w": torch.ones(100_000)})
        assert not leftover.exists() and kept.exists()
        assert list_checkpoints(disk) == [path]


def test_an_io_error_at_fsync_is_named_and_the_temp_file_removed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = save_checkpoint(tmp_path, 10, {"w": torch.zeros(4)})

    def failing_fsync(fd: int) -> None:
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(os, "fsync", failing_fsync)
    with pytest.raises(CheckpointWriteError) as info:
        save_checkpoint(tmp_path, 20, {"w": torch.ones(4)})
    monkeypatch.undo()
    assert info.value.errno == errno.EIO
    assert "Input/output error (EIO)" in str(info.value) and str(first) in str(info.value)
    assert temp_files(tmp_path) == [] and list_checkpoints(tmp_path) == [first]


def test_an_error_that_is_not_the_disk_is_raised_as_it_is_and_leaves_no_temp_file(tmp_path: Path) -> None:
    with pytest.raises((pickle.PicklingError, AttributeError, TypeError)):
        save_checkpoint(tmp_path, 1, {"f": lambda: 0})  # not serialisable: the caller's error, not the disk's
    assert list(tmp_path.iterdir()) == []


def test_the_message_names_cause_sizes_and_what_is_kept() -> None:
    message = write_failure_message(
        step=40,
        directory=Path("/ckpt"),
        code=errno.ENOSPC,
        needed=3_000_000,
        partial=1_048_576,
        free=12_288,
        kept=Path("/ckpt/ckpt-0000000030.pt"),
    )
    assert message == (
        "checkpoint of step 40 not written to /ckpt: No space left on device (ENOSPC); it needs about "
        "3000000 bytes (2.9 MiB, the state's tensors), 1048576 bytes (1.0 MiB) were written when it failed "
        "and are removed again, 12288 bytes free (0.0 MiB); the previous checkpoint /ckpt/ckpt-0000000030.pt is kept"
    )
    assert "no previous checkpoint is kept" in write_failure_message(1, Path("/c"), errno.EIO, 8, 0, None, None)
    assert "free space unknown" in write_failure_message(1, Path("/c"), errno.EIO, 8, 0, None, None)
    inferred = write_failure_message(1, Path("/c"), errno.ENOSPC, 8, 0, 4, None, inferred=True)
    assert re.search(r"ENOSPC, inferred from the free space", inferred)


def test_the_cause_is_found_under_torch_zip_writer_error() -> None:
    seen = OSError(errno.ENOSPC, "No space left on device")
    torn = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    assert failure_errno(torn, seen) == errno.ENOSPC  # what the write raised, kept aside
    try:
        try:
            raise seen
        except OSError:
            raise torn from None
    except RuntimeError as chained:
        assert failure_errno(chained, None) == errno.ENOSPC  # the OSError torch left as the context
    assert failure_errno(RuntimeError("write failed: Input/output error"), None) == errno.EIO  # in the text
    assert failure_errno(OSError(errno.EDQUOT, "Disk quota exceeded"), None) == errno.EDQUOT
    assert failure_errno(RuntimeError("unexpected pos 704 vs 598"), None) is None  # nothing says why


def test_needed_size_counts_each_storage_once() -> None:
    w = torch.zeros(1000)
    state = {"a": w, "view": w[:10], "nested": [{"b": torch.zeros(5, dtype=torch.float64)}], "step": 3}
    assert state_nbytes(state) == 4000 + 40
