"""Per-sender budget of received frame bytes that the server holds while the frames wait for their round.

A frame that arrives before its round opens stays in memory until the round opens or times out. One
sender may keep such frames waiting on many streams at once; this budget bounds the payload bytes it
holds across all of them, so no member (or a caller claiming its name) can pin unbounded memory.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from dreamp2p.config import PeerConfig, TransportConfig
from dreamp2p.errors import PeerError, Status


class SenderBudget:
    """Payload bytes each sender has waiting here, refused beyond ``limit_bytes`` per sender.

    Used from the server's event loop only (no locking).
    """

    def __init__(self, limit_bytes: int) -> None:
        if limit_bytes <= 0:
            raise ValueError(f"limit_bytes must be > 0, got {limit_bytes}")
        self.limit_bytes = limit_bytes
        self._held: dict[str, int] = {}

    @staticmethod
    def for_backend(backend: object) -> SenderBudget:
        """Sized by ``backend.config`` (a PeerConfig, as `dreamp2p.peer.Peer` has), else by the default limit."""
        cfg = getattr(backend, "config", None)
        transport = cfg.transport if isinstance(cfg, PeerConfig) else TransportConfig()
        return SenderBudget(transport.max_buffered_bytes_per_peer)

    def held(self, sender: str) -> int:
        """Bytes ``sender`` has waiting now."""
        return self._held.get(sender, 0)

    def held_by_sender(self) -> dict[str, int]:
        """Bytes each sender has waiting now, as a copy; a sender holding nothing is absent."""
        return dict(self._held)

    def reserve(self, sender: str, nbytes: int) -> None:
        """Count ``nbytes`` more for ``sender``, or raise OVERSIZE (counting nothing) if that passes the limit."""
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        held = self._held.get(sender, 0)
        if held + nbytes > self.limit_bytes:
            raise PeerError(
                Status.OVERSIZE,
                f"sender {sender!r} already has {held} bytes of frames waiting here; {nbytes} more would exceed "
                f"the per-peer limit of {self.limit_bytes} bytes (transport.max_buffered_bytes_per_peer)",
            )
        self._held[sender] = held + nbytes

    def release(self, sender: str, nbytes: int) -> None:
        """Give back bytes counted by `reserve`; a sender holding nothing is forgotten."""
        left = self._held.get(sender, 0) - nbytes
        if left < 0:
            raise ValueError(f"released {nbytes} bytes for {sender!r}, more than it holds")
        if left:
            self._held[sender] = left
        else:
            self._held.pop(sender, None)

    @contextmanager
    def holding(self, sender: str, nbytes: int) -> Iterator[None]:
        """Reserve for the duration of the block (released however it ends, cancellation included)."""
        self.reserve(sender, nbytes)
        try:
            yield
        finally:
            self.release(sender, nbytes)
