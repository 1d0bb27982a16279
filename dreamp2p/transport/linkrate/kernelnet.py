"""Reads this host's TCP settings from /proc/sys and logs, once per link, when they cap its measured rate.

The arithmetic is `dreamp2p.transport.linkrate.tcptuning`'s; this module only reads the files and writes the log.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

from dreamp2p.transport.linkrate.linkstats import LinkEstimator
from dreamp2p.transport.linkrate.tcptuning import TcpLimits, cap_warning, congestion_lines

log = logging.getLogger(__name__)

PROC_SYS = Path("/proc/sys")


def read_tcp_limits(root: Path = PROC_SYS) -> TcpLimits | None:
    """This network namespace's TCP ceilings and congestion control; None where they cannot be read."""
    try:
        net = root / "net"
        return TcpLimits(
            tcp_rmem_max=int((net / "ipv4" / "tcp_rmem").read_text().split()[2]),
            tcp_wmem_max=int((net / "ipv4" / "tcp_wmem").read_text().split()[2]),
            core_rmem_max=int((net / "core" / "rmem_max").read_text()),
            core_wmem_max=int((net / "core" / "wmem_max").read_text()),
            congestion=(net / "ipv4" / "tcp_congestion_control").read_text().strip(),
            available=tuple((net / "ipv4" / "tcp_available_congestion_control").read_text().split()),
        )
    except (OSError, ValueError, IndexError) as exc:
        log.debug("cannot read the kernel's TCP settings under %s: %s", root, exc)
        return None


class KernelCheck:
    """Warns once per peer when the kernel's TCP settings hold that link's measured rate at their ceiling."""

    def __init__(self, limits: TcpLimits | None) -> None:
        self.limits = limits
        self.warned: set[str] = set()
        if limits is not None and limits.loss_based:
            log.info(
                "TCP congestion control is %s: on lossy WAN paths each connection backs off on every loss; BBR "
                "does not (%s)",
                limits.congestion,
                "; ".join(congestion_lines(limits)),
            )

    def check(self, peer: str, stats: LinkEstimator, streams: int, loss: float = 0.0) -> str | None:
        """The warning logged for ``peer``'s current estimate (None if none, or if logged before)."""
        if self.limits is None or peer in self.warned or not stats.samples or not stats.rtt_samples:
            return None
        rtt, rate = stats.min_rtt_s, stats.goodput_Bps
        if not (math.isfinite(rtt) and rtt > 0 and math.isfinite(rate) and rate > 0):
            return None
        text = cap_warning(self.limits, rtt, rate, streams, loss, peer=peer)
        if text is not None:
            self.warned.add(peer)
            log.warning("%s", text)
        return text
