"""`bench lm`'s links: how the regions are joined (``shaping`` in the report), and the emulator's counters.

As root (and unless ``netns=False``) every region runs in its own network namespace. With a round trip,
jitter or loss (``rtt_ms``, ``jitter_ms``, ``loss``) and two regions or more, the packet emulator joins them
("wanemu", `dreamp2p.devtools.wanemu`): every directed pair of regions is a path of its own at ``rate`` with
one-way delay rtt/2, the jitter and the loss, so TCP itself sees the path (no in-process delay); the report
adds the emulator's counters and CPU (``emulator``, per strategy and for the whole run). Without any of them
each direction of a region's link is shaped by ``tc tbf`` to ``rate`` ("tbf"): two regions are joined by one
veth pair (deploy/netns-wan.sh), three or more each by a veth to a bridge in a namespace of their own (a
star: every region has an access link of ``rate`` each way). Not root (or ``netns=False``): the transport's
in-process token bucket (``transport.rate_limit``) emulates the rate and its delay line
(``transport.delay_s = rtt / 2``) the round trip ("in-process"); it cannot lose or jitter packets, so
``loss`` and ``jitter_ms`` are refused there.
"""

from __future__ import annotations

import os
from typing import Any

from dreamp2p.config import parse_rate
from dreamp2p.devtools.netns import Namespaces


def stats_delta(after: dict[str, Any], before: dict[str, Any]) -> dict[str, Any]:
    """The packet emulator's counters (`WanEmulator.stats`) between two readings, in the same form."""
    earlier = {(p["src"], p["dst"]): p for p in before["paths"]}
    paths = []
    for p in after["paths"]:
        b = earlier.get((p["src"], p["dst"]), {})
        paths.append({**p, **{k: v - b.get(k, 0) for k, v in p.items() if k not in ("src", "dst")}})
    scalars = ("cpu_s", "user_s", "sys_s", "wakeups")
    return {**after, "paths": paths, **{k: after[k] - before[k] for k in scalars}}


def choose_shaping(
    rate: str, netns: bool | None, rtt_ms: float, loss: float = 0.0, jitter_ms: float = 0.0, regions: int = 2
) -> tuple[float, str, dict[str, Any]]:
    """The link rate in bytes/s, how the links are emulated ("wanemu", "tbf" or "in-process": see the module
    docstring), and the [transport] table of the regions."""
    rate_Bps = parse_rate(rate)
    if not 0.0 <= loss < 1.0:
        raise ValueError(f"loss must be a fraction in [0, 1), got {loss}")
    if jitter_ms < 0:
        raise ValueError(f"jitter_ms must be >= 0, got {jitter_ms}")
    root = os.geteuid() == 0
    if netns and not root:
        raise ValueError("netns=True needs root (network namespaces, tc)")
    use_netns = root if netns is None else netns
    if not use_netns and (loss or jitter_ms):
        why = "netns=False" if root else "not root"
        raise ValueError(
            f"loss and jitter need the packet emulator (network namespaces, root); {why}: the links are "
            "emulated in process, which delays and paces but cannot lose or jitter packets"
        )
    if use_netns and regions >= 2 and (rtt_ms or loss or jitter_ms):
        return rate_Bps, "wanemu", {}  # the path delays the packets: no in-process delay
    transport: dict[str, Any] = {"delay_s": rtt_ms / 2000.0}
    if not use_netns:
        transport["rate_limit"] = rate_Bps
    return rate_Bps, "tbf" if use_netns else "in-process", transport


def make_namespaces(
    shaping: str, regions: int, rate: str, rtt_ms: float, loss: float, jitter_ms: float
) -> Namespaces | None:
    """The regions' namespaces for ``shaping`` (not entered yet), or None in process."""
    if shaping == "in-process":
        return None
    if shaping == "tbf":
        return Namespaces(regions, rate)
    return Namespaces(regions, rate, rtt=rtt_ms / 1e3, jitter=jitter_ms / 1e3, loss=loss)
