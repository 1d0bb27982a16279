"""Atomic, rotating checkpoints that load without unpickling arbitrary objects.

Written to a temporary file in the same directory, fsynced, then renamed over the final name (and the
directory fsynced), so a crash leaves either the old or the new checkpoint, never half of one. Loading
uses ``torch.load(weights_only=True)``: tensors, numbers, strings, lists and dicts only.

A write that fails for the storage's sake (a full disk, an I/O error) removes its temporary file and raises
:class:`CheckpointWriteError`, which names the cause, the size needed, the free space and the previous
checkpoint, which is kept. torch.save's zip writer reports such a failure as a RuntimeError about zip
positions; the write goes through a file object that keeps the OSError the disk raised, so the cause is
not lost. Temporary files that a killed process left behind are removed before the next write.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import shutil
from pathlib import Path
from typing import IO, Any, BinaryIO, cast

import torch

log = logging.getLogger(__name__)

_NAME = re.compile(r"^ckpt-(\d{10})\.pt$")
_TEMP = re.compile(r"^\.ckpt-\d{10}\.pt\.tmp-(\d+)$")
# the storage failures a message may only spell out (torch's writer keeps the words, not the errno)
_STORAGE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EROFS, errno.EFBIG)


class CheckpointWriteError(OSError):
    """A checkpoint the storage could not take (full disk, I/O error, ...): its partial file is removed and
    the previous checkpoint (``kept``, None if there was none) is left as it was.

    ``errno`` is the cause; ``needed_bytes`` the state's tensor bytes (what the file needs, give or take
    its small header); ``partial_bytes`` what was written before the failure; ``free_bytes`` the free space
    of the checkpoint's filesystem once the partial file is removed (None if it could not be read).
    """

    def __init__(
        self,
        step: int,
        directory: Path,
        code: int,
        needed_bytes: int,
        partial_bytes: int,
        free_bytes: int | None,
        kept: Path | None,
        inferred: bool = False,
    ) -> None:
        message = write_failure_message(
            step, directory, code, needed_bytes, partial_bytes, free_bytes, kept, inferred=inferred
        )
        super().__init__(message)
        self.errno = code
        self.step = step
        self.directory = directory
        self.needed_bytes = needed_bytes
        self.partial_bytes = partial_bytes
        self.free_bytes = free_bytes
        self.kept = kept


def write_failure_message(
    step: int,
    directory: Path,
    code: int,
    needed: int,
    partial: int,
    free: int | None,
    kept: Path | None,
    *,
    inferred: bool = False,
) -> str:
    """The one line that tells why the checkpoint of ``step`` is missing and what is left. Pure."""
    name = errno.errorcode.get(code, f"errno {code}")
    how = f"{name}, inferred from the free space" if inferred else name
    room = "free space unknown" if free is None else f"{free} bytes free ({_mib(free)})"
    previous = f"the previous checkpoint {kept} is kept" if kept is not None else "no previous checkpoint is kept"
    return (
        f"checkpoint of step {step} not written to {directory}: {os.strerror(code)} ({how}); it needs about "
        f"{needed} bytes ({_mib(needed)}, the state's tensors), {partial} bytes ({_mib(partial)}) were written "
        f"when it failed and are removed again, {room}; {previous}"
    )


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def failure_errno(exc: BaseException, seen: OSError | None) -> int | None:
    """The errno behind a failed checkpoint write, or None when nothing tells one (then it is no storage
    failure that this module knows). ``seen``: the OSError the file's ``write`` raised, which torch's zip
    writer replaces by a RuntimeError; else the exception, its causes and contexts, then their words."""
    if seen is not None and seen.errno:
        return seen.errno
    chain: list[BaseException] = []
    e: BaseException | None = exc
    while e is not None and e not in chain:
        chain.append(e)
        e = e.__cause__ or e.__context__
    for e in chain:
        if isinstance(e, OSError) and e.errno:
            return e.errno
    text = " ".join(str(e) for e in chain)
    return next((code for code in _STORAGE_ERRNOS if os.strerror(code) in text), None)


def state_nbytes(state: Any) -> int:
    """The bytes of the tensors in ``state`` (dicts, lists and tuples walked), each storage counted once, as
    torch.save writes them: about the size of its checkpoint file."""
    storages: dict[tuple[str, int], int] = {}
    stack = [state]
    while stack:
        obj = stack.pop()
        if isinstance(obj, torch.Tensor):
            try:
                storage = obj.untyped_storage()
                key, nbytes = (str(obj.device), storage.data_ptr()), storage.nbytes()
            except (RuntimeError, NotImplementedError):  # sparse and other storage-less layouts
                key, nbytes = (str(obj.device), id(obj)), obj.element_size() * obj.numel()
            storages[key] = max(storages.get(key, 0), nbytes)
        elif isinstance(obj, dict):
            stack.extend(obj.values())
        elif isinstance(obj, list | tuple):
            stack.extend(obj)
    return sum(storages.values())


class _KeptErrorFile:
    """The file torch.save writes through: it keeps the OSError a write raised, which torch's zip writer
    turns into a RuntimeError that no longer says why."""

    def __init__(self, fh: BinaryIO) -> None:
        self.fh = fh
        self.error: OSError | None = None

    def write(self, data: Any) -> int:
        try:
            return self.fh.write(data)
        except OSError as exc:
            self.error = exc
            raise

    def flush(self) -> None:
        self.fh.flush()


def save_checkpoint(directory: str | Path, step: int, state: dict[str, Any], keep: int = 3) -> Path:
    """Write the checkpoint of ``step`` atomically, keeping the newest ``keep``; its path.

    Raises :class:`CheckpointWriteError` when the storage fails the write (the temporary file is then
    removed and the previous checkpoints are untouched); any other error is raised as it is, also after
    the temporary file is removed.
    """
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    d = Path(directory)
    final = checkpoint_file(d, step)
    tmp = d / f".{final.name}.tmp-{os.getpid()}"
    out: _KeptErrorFile | None = None
    try:
        d.mkdir(parents=True, exist_ok=True)
        remove_stale_temps(d)
        with open(tmp, "wb") as fh:
            out = _KeptErrorFile(fh)
            torch.save(state, cast(IO[bytes], out))
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, final)
    except BaseException as exc:
        partial = _remove(tmp)
        if isinstance(exc, OSError | RuntimeError):
            failure = _write_failure(exc, out.error if out is not None else None, d, step, state, partial)
            if failure is not None:
                raise failure from exc
        raise
    dir_fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    for old in list_checkpoints(d)[:-keep]:
        old.unlink(missing_ok=True)
    log.info("checkpoint %s written", final)
    return final


def _remove(tmp: Path) -> int:
    """Remove a failed write's temporary file; the bytes it held (0 if there was none)."""
    try:
        size = tmp.stat().st_size
        tmp.unlink()
    except OSError:
        return 0
    return size


def _write_failure(
    exc: BaseException, seen: OSError | None, d: Path, step: int, state: dict[str, Any], partial: int
) -> CheckpointWriteError | None:
    """The error to raise for a write the storage failed; None when ``exc`` is no storage failure."""
    needed = state_nbytes(state)
    try:
        free: int | None = shutil.disk_usage(d).free
    except OSError:
        free = None
    code = failure_errno(exc, seen)
    inferred = code is None and free is not None and free < needed
    if inferred:
        code = errno.ENOSPC
    if code is None:
        return None
    kept = next(reversed(list_checkpoints(d)), None)
    return CheckpointWriteError(step, d, code, needed, partial, free, kept, inferred=inferred)


def remove_stale_temps(directory: Path) -> None:
    """Remove the temporary files of writes that never finished: left by a process that is gone (killed
    mid-write), or by this one (no write of ours is in flight when a new one starts)."""
    for p in directory.iterdir():
        m = _TEMP.match(p.name)
        if m is None or (int(m.group(1)) != os.getpid() and _alive(int(m.group(1)))):
            continue
        try:
            size = p.stat().st_size
            p.unlink()
        except OSError:
            continue
        log.warning("removed %s (%d bytes), the partial checkpoint of a write that never finished", p, size)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except PermissionError:  # someone else's process
        return True
    except (ProcessLookupError, OverflowError):
        return False
    return True


def checkpoint_file(directory: str | Path, step: int) -> Path:
    """Where the checkpoint of ``step`` is (or would be) in ``directory``."""
    return Path(directory) / f"ckpt-{step:010d}.pt"


def list_checkpoints(directory: str | Path) -> list[Path]:
    d = Path(directory)
    if not d.is_dir():
        return []
    return sorted((p for p in d.iterdir() if _NAME.match(p.name)), key=lambda p: p.name)


def checkpoint_step(path: Path) -> int:
    m = _NAME.match(path.name)
    if m is None:
        raise ValueError(f"not a checkpoint file name: {path.name}")
    return int(m.group(1))


def load_step(directory: str | Path, step: int) -> tuple[Path, dict[str, Any]]:
    path = Path(directory) / f"ckpt-{step:010d}.pt"
    state = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(state, dict):
        raise ValueError(f"checkpoint {path} does not hold a dict")
    return path, state


def agree_resume_step(mine: list[int], others: list[list[int]]) -> int | None:
    """The checkpoint step a node of a restart wave resumes from, given the other nodes' checkpoint steps.

    The wave continues from the newest state any node saved: the nodes holding that step resume from it,
    every other node gets None and joins them (state transfer), since its own checkpoints are older.
    None for everyone when no node has a checkpoint (a fresh start). Pure.
    """
    newest = max((s for steps in (mine, *others) for s in steps), default=None)
    return newest if newest is not None and newest in mine else None


def load_latest(directory: str | Path, mmap: bool = False) -> tuple[Path, dict[str, Any]] | None:
    """The newest readable checkpoint, or None if there is none; corrupt files are skipped with a warning.

    ``mmap``: map its tensors instead of reading them, to look into it cheaply (its settings, say).
    """
    for path in reversed(list_checkpoints(directory)):
        try:
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
        except Exception as exc:  # a torn or foreign file: fall back to the previous checkpoint
            log.warning("skipping unreadable checkpoint %s: %s", path, exc)
            continue
        if not isinstance(state, dict):
            log.warning("skipping checkpoint %s: not a dict", path)
            continue
        return path, state
    return None
