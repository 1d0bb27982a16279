"""What the daemon's progress lines say and when one is due: pure logic, no I/O, no clock of its own.

One line per node at a steady cadence in wall-clock time (``[metrics] progress_every_s``), whatever the
step time: the first step, then the first step ending ``every_s`` seconds or more after the last line.
The time left is estimated from the pace between the last two lines, so it follows a link that slowed
down. Membership changes are told apart here too (which members left or came back between two reads of
the peer's status), and so are the lines for the lifecycle records of the run log.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Progress:
    """One progress line's figures."""

    step: int  # steps done so far
    final: int  # the step the run ends at
    loss: float
    tokens_per_s: float
    hidden_fraction: float  # share of communication time hidden behind compute, whole run
    link_Bps: float | None  # the slowest link's measured goodput (None before the first measurement)
    plan_version: int
    eta_s: float | None  # time left at the recent pace (None before a pace is known)

    def message(self) -> str:
        link = "-" if self.link_Bps is None else f"{self.link_Bps * 8 / 1e6:.1f}"
        return (
            f"step {self.step}/{self.final} loss {self.loss:.4f} tok/s {self.tokens_per_s:.0f} "
            f"hidden {self.hidden_fraction:.0%} link {link} Mbit/s plan v{self.plan_version} "
            f"ETA {format_duration(self.eta_s)}"
        )

    def fields(self) -> dict[str, Any]:
        """The figures as a log record's extra fields (JSON mode writes them as keys)."""
        return {
            "event": "progress",
            "step": self.step,
            "final_step": self.final,
            "loss": self.loss,
            "tokens_per_s": self.tokens_per_s,
            "hidden_fraction": self.hidden_fraction,
            "link_mbit_s": None if self.link_Bps is None else self.link_Bps * 8 / 1e6,
            "plan_version": self.plan_version,
            "eta_s": self.eta_s,
        }


def format_duration(seconds: float | None) -> str:
    """``"?"``, ``"45s"``, ``"12m05s"`` or ``"3h07m"``: a time left as people read it."""
    if seconds is None or not math.isfinite(seconds) or seconds < 0:
        return "?"
    s = round(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


class ProgressClock:
    """Says when a progress line is due and the pace (steps per second) between the last two lines."""

    def __init__(self, every_s: float) -> None:
        if not every_s >= 0:
            raise ValueError(f"every_s must be >= 0, got {every_s}")
        self.every_s = every_s
        self._last: tuple[int, float] | None = None  # (steps done, time) at the last line
        self.pace: float | None = None

    def due(self, step: int, now: float) -> bool:
        """Whether a line is due after ``step`` steps done at time ``now``; if so, it counts as written."""
        if self._last is not None and now - self._last[1] < self.every_s:
            return False
        if self._last is not None:
            done, elapsed = step - self._last[0], now - self._last[1]
            if done > 0 and elapsed > 0:
                self.pace = done / elapsed
        self._last = (step, now)
        return True

    def eta(self, step: int, final: int) -> float | None:
        """Seconds until ``final`` at the pace between the last two lines (None before there is one)."""
        if self.pace is None:
            return None
        return max(0, final - step) / self.pace


def membership_change(before: Iterable[str], after: Iterable[str]) -> tuple[list[str], list[str]]:
    """(members lost, members joined) between two sets of live members, each sorted."""
    old, new = set(before), set(after)
    return sorted(old - new), sorted(new - old)


def lifecycle_message(kind: str, fields: Mapping[str, Any]) -> str | None:
    """The log line for a lifecycle record of the run log (start, join, resume, checkpoint, stop), else None."""
    if kind == "start":
        how = ", resuming" if fields.get("resume") else ", joining" if fields.get("join") else ""
        return f"node started on {fields.get('device')}: {fields.get('params', 0):,} parameters{how}"
    if kind == "join":
        why = " (asked to resume, but the others trained on)" if fields.get("resumed") else ""
        return f"joined the cluster at step {fields.get('step')}{why}"
    if kind == "resume":
        return f"resumed from {fields.get('path')} at step {fields.get('step')}"
    if kind == "checkpoint":
        return f"checkpoint at step {fields.get('step')}: {fields.get('path')}"
    if kind == "stop":
        sig = f" on {fields['signal']}" if fields.get("signal") else ""
        return f"stopped at step {fields.get('step')}{sig}; checkpoint {fields.get('checkpoint')}"
    return None
