"""How many TCP connections a link needs, and when the kernel's TCP settings cap it: pure arithmetic, no I/O.

One TCP connection carries at most the least of two bounds:

- **window**: ``window / RTT``, the bytes the kernel lets one connection have in flight. About half of a
  socket buffer holds payload (the rest is the kernel's bookkeeping, ``tcp_adv_win_scale = 1``), so the
  window is half the smaller of the largest receive and send buffers autotuning may reach
  (``tcp_rmem``/``tcp_wmem``'s third number);
- **loss** (loss-based congestion control: cubic, reno): Mathis et al.'s ``MSS / RTT * 1.22 / sqrt(p)``. BBR
  paces at the measured bottleneck rate and is not held to it at the loss rates of real paths.

:func:`choose_streams` gives the connections that together reach a link's rate (1..16);
:func:`cap_warning` the warning, with the sysctl lines that lift the cap, when the kernel holds a link's
measured rate at its ceiling. `dreamp2p.transport.linkrate.kernelnet` reads the settings and logs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

MSS_BYTES = 1448  # a 1500-byte MTU's TCP payload with timestamps
MATHIS_C = math.sqrt(1.5)  # 1.22
MAX_STREAMS = 16
# the buffers deploy/sysctl.d/90-dreamp2p.conf sets: a 32 MiB window, 2.7 Gbit/s per connection at 100 ms
SUGGESTED_BUFFER_BYTES = 64 << 20
SYSCTL_FILE = "deploy/sysctl.d/90-dreamp2p.conf"
# a measured rate this close to the ceiling is taken to be held there by it
AT_CAP = 0.8


@dataclass(frozen=True)
class TcpLimits:
    """The kernel's TCP settings that bound one connection (see `kernelnet.read_tcp_limits`).

    ``tcp_rmem_max``/``tcp_wmem_max``: the third numbers of ``net.ipv4.tcp_rmem``/``tcp_wmem`` (autotuning's
    ceiling); ``core_rmem_max``/``core_wmem_max``: ``net.core.rmem_max``/``wmem_max`` (the ceiling of a
    buffer a program sets itself); ``congestion``: ``net.ipv4.tcp_congestion_control``; ``available``: the
    algorithms ``tcp_available_congestion_control`` lists.
    """

    tcp_rmem_max: int
    tcp_wmem_max: int
    core_rmem_max: int
    core_wmem_max: int
    congestion: str
    available: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for name in ("tcp_rmem_max", "tcp_wmem_max", "core_rmem_max", "core_wmem_max"):
            if getattr(self, name) <= 0:
                raise ValueError(f"TcpLimits.{name} must be > 0 bytes, got {getattr(self, name)}")

    @property
    def window_bytes(self) -> int:
        """The most one connection may have in flight: half the smaller autotuning ceiling (see the module)."""
        return min(self.tcp_rmem_max, self.tcp_wmem_max) // 2

    @property
    def loss_based(self) -> bool:
        """Whether the congestion control backs off on every loss (all but BBR)."""
        return not self.congestion.startswith("bbr")


def _check(rtt_s: float, loss: float) -> None:
    if not (math.isfinite(rtt_s) and rtt_s > 0):
        raise ValueError(f"rtt_s must be a finite time > 0 seconds, got {rtt_s}")
    if not 0.0 <= loss < 1.0:
        raise ValueError(f"loss must be a fraction in [0, 1), got {loss}")


def window_rate_Bps(window_bytes: float, rtt_s: float) -> float:
    """Bytes/s one connection carries with ``window_bytes`` in flight at ``rtt_s``."""
    _check(rtt_s, 0.0)
    if window_bytes <= 0:
        raise ValueError(f"window_bytes must be > 0, got {window_bytes}")
    return window_bytes / rtt_s


def mathis_rate_Bps(rtt_s: float, loss: float, mss: int = MSS_BYTES) -> float:
    """Mathis et al.'s bound on one loss-based connection: ``MSS / RTT * 1.22 / sqrt(loss)`` (inf at no loss)."""
    _check(rtt_s, loss)
    if loss == 0.0:
        return math.inf
    return mss / rtt_s * MATHIS_C / math.sqrt(loss)


def per_flow_rate_Bps(
    rtt_s: float, loss: float, window_bytes: float, *, loss_based: bool = True, mss: int = MSS_BYTES
) -> float:
    """The most one connection carries: the window bound, and the loss bound under loss-based control."""
    rate = window_rate_Bps(window_bytes, rtt_s)
    return min(rate, mathis_rate_Bps(rtt_s, loss, mss)) if loss_based else rate


def choose_streams(
    rtt_s: float,
    rate_Bps: float,
    loss: float,
    window_bytes: float,
    *,
    loss_based: bool = True,
    mss: int = MSS_BYTES,
    lo: int = 1,
    hi: int = MAX_STREAMS,
) -> int:
    """Connections per link that together carry ``rate_Bps``: ``ceil(rate / per-flow bound)`` in ``lo..hi``."""
    if not (math.isfinite(rate_Bps) and rate_Bps > 0):
        raise ValueError(f"rate_Bps must be a finite rate > 0 bytes/s, got {rate_Bps}")
    if not 1 <= lo <= hi:
        raise ValueError(f"need 1 <= lo <= hi, got lo={lo}, hi={hi}")
    flow = per_flow_rate_Bps(rtt_s, loss, window_bytes, loss_based=loss_based, mss=mss)
    return max(lo, min(hi, math.ceil(rate_Bps / flow - 1e-9)))


def buffer_for(rate_Bps: float, rtt_s: float, streams: int) -> int:
    """A socket-buffer ceiling (a power of two, at least 4 MiB) that lets ``streams`` connections carry
    ``rate_Bps`` at ``rtt_s``: twice each one's share of the bandwidth-delay product (half is payload)."""
    _check(rtt_s, 0.0)
    need = 2.0 * rate_Bps * rtt_s / max(1, streams)
    size = 4 << 20
    while size < need:
        size *= 2
    return size


def sysctl_lines(limits: TcpLimits, buffer_bytes: int) -> list[str]:
    """The ``sysctl -w`` lines raising every ceiling under ``buffer_bytes`` (and BBR, when it is not in use)."""
    lines = []
    if limits.core_rmem_max < buffer_bytes:
        lines.append(f"sysctl -w net.core.rmem_max={buffer_bytes}")
    if limits.core_wmem_max < buffer_bytes:
        lines.append(f"sysctl -w net.core.wmem_max={buffer_bytes}")
    if limits.tcp_rmem_max < buffer_bytes:
        lines.append(f"sysctl -w net.ipv4.tcp_rmem='4096 131072 {buffer_bytes}'")
    if limits.tcp_wmem_max < buffer_bytes:
        lines.append(f"sysctl -w net.ipv4.tcp_wmem='4096 65536 {buffer_bytes}'")
    lines += congestion_lines(limits)
    return lines


def congestion_lines(limits: TcpLimits) -> list[str]:
    """The lines that switch to BBR (loading its module first where the kernel does not list it); none under BBR."""
    if not limits.loss_based:
        return []
    load = [] if "bbr" in limits.available else ["modprobe tcp_bbr"]
    return [*load, "sysctl -w net.core.default_qdisc=fq", "sysctl -w net.ipv4.tcp_congestion_control=bbr"]


def _mbit(rate_Bps: float) -> str:
    return f"{rate_Bps * 8 / 1e6:.0f} Mbit/s" if rate_Bps * 8 >= 10e6 else f"{rate_Bps * 8 / 1e6:.2g} Mbit/s"


def cap_warning(
    limits: TcpLimits, rtt_s: float, rate_Bps: float, streams: int, loss: float = 0.0, *, peer: str = "a link"
) -> str | None:
    """The warning when ``streams`` connections' ceiling at ``rtt_s`` holds ``peer``'s measured ``rate_Bps``
    (within `AT_CAP` of it, or above it): what caps it, how far, and the lines to lift it. None otherwise."""
    if streams < 1:
        raise ValueError(f"streams must be >= 1, got {streams}")
    window_cap = streams * window_rate_Bps(limits.window_bytes, rtt_s)
    loss_cap = streams * mathis_rate_Bps(rtt_s, loss) if limits.loss_based else math.inf
    cap = min(window_cap, loss_cap)
    if rate_Bps < AT_CAP * cap:
        return None
    if window_cap <= loss_cap:
        what = (
            f"the kernel's TCP buffers (tcp_rmem max {limits.tcp_rmem_max}, tcp_wmem max {limits.tcp_wmem_max} "
            f"bytes: a {limits.window_bytes}-byte window per connection)"
        )
    else:
        what = f"{limits.congestion}'s back-off at {loss:.3%} loss (Mathis: MSS / RTT * 1.22 / sqrt(loss))"
    buffer = max(SUGGESTED_BUFFER_BYTES, buffer_for(rate_Bps * 4, rtt_s, streams))
    fix = "; ".join(sysctl_lines(limits, buffer)) or "none (the buffers are already large enough)"
    return (
        f"{peer} measured {_mbit(rate_Bps)} at {rtt_s * 1e3:.0f} ms RTT, at the ceiling {what} set for "
        f"{streams} connection(s): {_mbit(cap)}; the link may be faster. To lift it: {fix} "
        f"(or install {SYSCTL_FILE} in /etc/sysctl.d/), or more transport.streams_per_link"
    )
