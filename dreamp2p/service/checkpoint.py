"""Atomic, rotating checkpoints that load without unpickling arbitrary objects.

Written to a temporary file in the same directory, fsynced, then renamed over the final name (and the
directory fsynced), so a crash leaves either the old or the new checkpoint, never half of one. Loading
uses ``torch.load(weights_only=True)``: tensors, numbers, strings, lists and dicts only.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

_NAME = re.compile(r"^ckpt-(\d{10})\.pt$")


def save_checkpoint(directory: str | Path, step: int, state: dict[str, Any], keep: int = 3) -> Path:
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    final = checkpoint_file(d, step)
    tmp = d / f".{final.name}.tmp-{os.getpid()}"
    with open(tmp, "wb") as fh:
        torch.save(state, fh)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, final)
    dir_fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    for old in list_checkpoints(d)[:-keep]:
        old.unlink(missing_ok=True)
    log.info("checkpoint %s written", final)
    return final


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


def load_latest(directory: str | Path) -> tuple[Path, dict[str, Any]] | None:
    """The newest readable checkpoint, or None if there is none; corrupt files are skipped with a warning."""
    for path in reversed(list_checkpoints(directory)):
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as exc:  # a torn or foreign file: fall back to the previous checkpoint
            log.warning("skipping unreadable checkpoint %s: %s", path, exc)
            continue
        if not isinstance(state, dict):
            log.warning("skipping checkpoint %s: not a dict", path)
            continue
        return path, state
    return None
