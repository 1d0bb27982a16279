"""Error feedback inside the compressed ring all-reduce: what each lossy encode lost, carried to the next round.

The ring encodes twice per element and round at most at one member: a reduce-scatter partial sum it
forwards (its own contribution at step 0) and, at the segment's owner, the mean sent in the all-gather.
A member re-encodes the same positions every round while the ring's layout is unchanged, so it keeps
one residual per element for each of the two encodes and adds it to the next round's values before
encoding (the worker and server error of 1-bit Adam, arXiv 2102.02888, and EF-SGD, arXiv 1901.09847).
Over rounds the decoded means then track the true means up to the current residual, instead of
accumulating every round's rounding error. Only meaningful for rounds that average increments
(pseudo-gradients), not parameters. Pure tensor math, no I/O.

A round's residuals are drafted on a copy and committed only when the round applies everywhere, so a
failed or retried round leaves them as they were.
"""

from __future__ import annotations

from collections.abc import Hashable

import torch

REDUCE = 0  # residual of the reduce-scatter encodes this member makes
GATHER = 1  # residual of the all-gather encode of the segment this member owns


class GroupFeedback:
    """The committed residuals of one group (one per ring layout: any change of layout starts from zero)."""

    def __init__(self) -> None:
        self._layout: Hashable = None
        self._residuals = torch.zeros(2, 0)

    def begin(self, layout: Hashable, numel: int) -> RoundFeedback:
        """Residuals for a round over ``numel`` elements laid out as ``layout`` (members, rank, codecs)."""
        if layout != self._layout or self._residuals.shape[1] != numel:
            self._layout = layout
            self._residuals = torch.zeros(2, numel)
        return RoundFeedback(self, self._residuals.clone())

    def adopt(self, draft: torch.Tensor) -> None:
        """Make a committed round's draft the residuals carried forward."""
        self._residuals = draft

    def residual_norm(self) -> float:
        """Size of what is carried into the next round (for metrics and tests)."""
        return float(self._residuals.norm())


class RoundFeedback:
    """One round's draft of its group's residuals; :meth:`commit` once the round applied everywhere."""

    def __init__(self, group: GroupFeedback, draft: torch.Tensor) -> None:
        self._group = group
        self._draft = draft

    def compensate(self, which: int, start: int, values: torch.Tensor) -> torch.Tensor:
        """``values`` (elements ``start ..``) plus the residual carried there: what to encode instead."""
        return values + self._draft[which, start : start + values.numel()]

    def keep(self, which: int, start: int, compensated: torch.Tensor, decoded: torch.Tensor) -> None:
        """Record what encoding ``compensated`` lost, given what the receivers will decode."""
        torch.sub(compensated, decoded, out=self._draft[which, start : start + compensated.numel()])

    def commit(self) -> None:
        self._group.adopt(self._draft)
