"""systemd's notify protocol (``sd_notify``) for the node daemon: READY=1, WATCHDOG=1, STOPPING=1.

A datagram of ``KEY=VALUE`` lines to the unix socket named by ``$NOTIFY_SOCKET`` (a leading ``@`` names
the abstract namespace). Without ``$NOTIFY_SOCKET`` (not run by systemd with ``Type=notify``) every call
is a no-op. Watchdog pings are rate-limited to half of ``$WATCHDOG_USEC``, so calling ``watchdog()`` every
training step costs a clock read. A send that fails is logged, never raised: systemd's watchdog then
notices on its own.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable, Mapping

log = logging.getLogger(__name__)


def socket_address(value: str) -> str | bytes | None:
    """The address to send to for ``$NOTIFY_SOCKET``'s value: a path, or bytes for the abstract namespace."""
    if not value:
        return None
    if value.startswith("@"):
        return b"\0" + value[1:].encode()
    if value.startswith("/"):
        return value
    return None  # systemd also knows vsock addresses; not supported here


def watchdog_interval(env: Mapping[str, str], pid: int) -> float | None:
    """Seconds between watchdog pings: half of ``$WATCHDOG_USEC``; None when the watchdog is off for us."""
    usec = env.get("WATCHDOG_USEC", "")
    owner = env.get("WATCHDOG_PID", "")
    if not usec.isdigit() or int(usec) == 0 or (owner and owner != str(pid)):
        return None
    return int(usec) / 2e6


class Notifier:
    """Sends notify messages to systemd; every method is a no-op without ``$NOTIFY_SOCKET``."""

    def __init__(self, env: Mapping[str, str] | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        env = os.environ if env is None else env
        self.address = socket_address(env.get("NOTIFY_SOCKET", ""))
        self.interval = watchdog_interval(env, os.getpid()) if self.address is not None else None
        self._clock = clock
        self._last_ping: float | None = None

    @property
    def enabled(self) -> bool:
        return self.address is not None

    def send(self, *fields: str) -> bool:
        """Send ``fields`` as one message (e.g. "READY=1", "STATUS=..."); whether it went out."""
        if self.address is None:
            return False
        try:
            # nonblocking: a full receive queue (systemd not reading) must never stall a training step
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC | socket.SOCK_NONBLOCK) as sock:
                sock.sendto("\n".join(fields).encode(), self.address)
        except OSError as exc:
            log.warning("sd_notify %s failed: %s", ",".join(fields), exc)
            return False
        return True

    def ready(self, status: str = "") -> bool:
        return self.send("READY=1", *([f"STATUS={status}"] if status else []))

    def stopping(self, status: str = "") -> bool:
        return self.send("STOPPING=1", *([f"STATUS={status}"] if status else []))

    def watchdog(self) -> bool:
        """Ping the watchdog unless the last ping is less than half the watchdog interval ago."""
        if self.interval is None:
            return False
        now = self._clock()
        if self._last_ping is not None and now - self._last_ping < self.interval:
            return False
        self._last_ping = now
        return self.send("WATCHDOG=1")
