"""A size-capped JSON-lines file: ``metrics.jsonl`` keeps its newest records within a byte budget.

The records go to ``NAME``; when the next one would take it past its share of the budget (``max_bytes /
files``), ``NAME`` becomes ``NAME.1``, ``NAME.1`` becomes ``NAME.2`` and so on, the oldest part beyond
``NAME.<files - 1>`` is deleted, and a fresh ``NAME`` is started. So a node that runs for weeks keeps about
the last ``max_bytes`` of its run log in ``files`` files, and readers take the parts oldest first
(:func:`jsonl_parts`). Like a rotated log, nothing is rewritten: each part is only ever appended to.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import IO, Any


def part_path(path: Path, index: int) -> Path:
    """``NAME`` for index 0, ``NAME.<index>`` for the older parts."""
    return path if index == 0 else path.with_name(f"{path.name}.{index}")


def jsonl_parts(path: str | Path) -> list[Path]:
    """The existing parts of a rotated JSON-lines file, oldest first (``NAME.<k>`` ... ``NAME.1``, ``NAME``)."""
    p = Path(path)
    older = []
    for candidate in p.parent.glob(f"{p.name}.*"):
        suffix = candidate.name[len(p.name) + 1 :]
        if suffix.isdigit() and int(suffix) > 0 and candidate.is_file():
            older.append((int(suffix), candidate))
    parts = [c for _, c in sorted(older, reverse=True)]
    return [*parts, p] if p.is_file() else parts


class RotatingJsonl:
    """Appends one JSON object per line to ``path``, rotating so that at most ``files`` parts are kept."""

    def __init__(self, path: str | Path, max_bytes: int, files: int) -> None:
        if max_bytes < 1 or files < 1:
            raise ValueError(f"max_bytes and files must be >= 1, got {max_bytes} and {files}")
        self.path = Path(path)
        self.files = files
        self.part_bytes = max(1, max_bytes // files)
        self._fh: IO[str] | None = None
        self._size = 0
        self._open()

    def _open(self) -> None:
        self._fh = open(self.path, "a", buffering=1, encoding="utf-8")  # noqa: SIM115 - lives as long as the node
        self._size = self.path.stat().st_size

    def write(self, record: dict[str, Any]) -> None:
        """Append ``record``; rotate first when it would not fit in the current part (a part is never empty)."""
        if self._fh is None:
            raise ValueError(f"{self.path} is closed")
        line = json.dumps(record) + "\n"
        size = len(line.encode("utf-8"))
        if self._size > 0 and self._size + size > self.part_bytes:
            self._rotate()
        assert self._fh is not None
        self._fh.write(line)
        self._size += size

    def _rotate(self) -> None:
        assert self._fh is not None
        self._fh.close()
        part_path(self.path, self.files - 1).unlink(missing_ok=True)  # with files == 1: the current part itself
        for index in range(self.files - 2, -1, -1):
            src = part_path(self.path, index)
            if src.exists():
                src.replace(part_path(self.path, index + 1))
        self._open()

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None
