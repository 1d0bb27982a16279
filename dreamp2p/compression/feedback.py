"""Sender-side error feedback (EF-SGD, Karimireddy et al. 2019, arXiv 1901.09847) for lossy codecs."""

from __future__ import annotations

from collections.abc import Hashable

import torch

from dreamp2p.compression.base import Codec

__all__ = ["ErrorFeedback"]


class ErrorFeedback:
    """Sender-side error feedback for lossy codecs (EF-SGD): keeps, per key, what the last encode lost and
    adds it to the next input.

    Over many rounds the sum of what was decoded differs from the sum of what was offered by exactly the
    current residual, which is bounded by one quantization step (for the sparse ``topk``: by what has not
    yet grown large enough to be selected); without feedback the rounding errors of each round pile up
    instead (with ``topk``, 98% of every input). Not thread-safe: use one instance per sending thread, or
    lock around it.
    """

    def __init__(self, codec: Codec) -> None:
        self.codec = codec
        self._residuals: dict[Hashable, torch.Tensor] = {}

    def encode(self, key: Hashable, x: torch.Tensor) -> torch.Tensor:
        """Encode ``x`` plus the residual stored under ``key``; store what this encode lost."""
        if self.codec.lossless:
            return self.codec.encode(x)
        x = x.detach()
        prev = self._residuals.get(key)
        if prev is None:
            compensated = x
        else:
            if prev.shape != x.shape:
                raise ValueError(
                    f"error feedback: key {key!r} holds a residual of shape {tuple(prev.shape)}, "
                    f"input has shape {tuple(x.shape)}; call reset({key!r}) when a tensor changes size"
                )
            compensated = x + prev
        # Encode before touching state, so a refused input (NaN/Inf) leaves the residual as it was.
        encoded = self.codec.encode(compensated)
        decoded = self.codec.decode(encoded, compensated.numel())
        if compensated is x:
            self._residuals[key] = x - decoded
        else:
            self._residuals[key] = compensated.sub_(decoded)
        return encoded

    def residual(self, key: Hashable) -> torch.Tensor | None:
        """The error carried into the next ``encode`` for ``key``, or None if there is none."""
        return self._residuals.get(key)

    def reset(self, key: Hashable | None = None) -> None:
        """Forget the residual of ``key``, or of every key when ``key`` is None."""
        if key is None:
            self._residuals.clear()
        else:
            self._residuals.pop(key, None)
