"""The contribution guard: whether our own values may enter an average (finite, and no sudden norm jump).

A replica whose state went bad (NaN/Inf, or an update whose norm jumps far above the group's usual one)
must not spread it to every member through the average. The round still runs: the peer sends zeros
marked as excluded and takes the others' mean (see `collective.ring`).
"""

from __future__ import annotations

import math

import torch

# weight of the newest norm in a group's running "usual" norm
NORM_EWMA = 0.1


def all_finite(t: torch.Tensor) -> bool:
    """True when ``t`` holds no NaN/Inf; min/max propagate both and cost one vectorized pass."""
    if t.numel() == 0:
        return True
    lo, hi = torch.aminmax(t)
    return math.isfinite(float(lo)) and math.isfinite(float(hi))


class ContributionGuard:
    """Per group id, the running norm of our contributions; refuses non-finite values and norm jumps."""

    def __init__(self, max_norm_ratio: float) -> None:
        self.max_norm_ratio = max_norm_ratio  # <= 0: norms are not checked
        self.refused = 0
        self._norms: dict[int, float] = {}

    def check(self, group_id: int, flat: torch.Tensor, guard_norm: bool) -> str | None:
        """Why ``flat`` must not enter the average of ``group_id`` (None if it may); counts refusals."""
        reason = self._why(group_id, flat, guard_norm)
        if reason is not None:
            self.refused += 1
        return reason

    def _why(self, group_id: int, flat: torch.Tensor, guard_norm: bool) -> str | None:
        if not all_finite(flat):
            return "holds NaN or Inf"
        ratio = self.max_norm_ratio
        if not guard_norm or ratio <= 0 or flat.numel() == 0:
            return None
        norm = float(torch.linalg.vector_norm(flat))
        usual = self._norms.get(group_id)
        if usual is not None and usual > 0 and norm > ratio * usual:
            return f"norm {norm:.3g} is over {ratio:g}x its usual {usual:.3g}"
        self._norms[group_id] = norm if usual is None else (1 - NORM_EWMA) * usual + NORM_EWMA * norm
        return None
