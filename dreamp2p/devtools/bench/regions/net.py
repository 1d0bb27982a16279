"""`bench regions`' network: one namespace per local rank, an unshaped LAN per region, a tbf WAN link per shard.

Needs root (ip netns, tc). For R regions of N local ranks, rank k of region r lives in namespace
``<prefix>-r<r>k<k>`` with two interfaces, named alike in every namespace:

- ``lan0``, the region's LAN (N > 1 only): a veth to a bridge in the region's hub namespace
  ``<prefix>-l<r>``, address ``10.78.<r>.<k + 1>/24``, not shaped. The region's process group (gloo: DDP's
  gradient all-reduce, the shard gathers) and its rendezvous run here.
- ``wan0``, shard k's WAN link: for two regions one veth pair joining ``r0k<k>`` and ``r1k<k>`` (the shard
  pair's own two namespaces); for more, a veth from each region's rank-k namespace to a bridge in the
  shard's hub namespace ``<prefix>-w<k>`` (a star). Every direction is shaped by ``tc tbf`` to the rate:
  on a pair each end's egress, on a star both ends of every veth (region -> hub and hub -> region).

Region r's WAN address is ``10.77.0.<r + 1>`` on every shard link. The links are separate namespaces, so
the same address may sit on each: local rank k dials region r's ring address (host:port) at port + k
(`dreamp2p.sync.comm.shards.rank_config`) and, in its own namespace, that host is reached over shard k's link
only. A region of one rank (the baseline) runs in the ``k0`` namespaces: it has shard 0's link alone.
Everything created here is removed on exit, also when the run is interrupted.
"""

from __future__ import annotations

import os
import subprocess

from dreamp2p.config import parse_rate
from dreamp2p.devtools.netns import shape

WAN_DEV = "wan0"
LAN_DEV = "lan0"


def _ip(*args: str) -> str:
    res = subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)
    return res.stdout


def wan_host(region: int) -> str:
    """Region ``region``'s address on every shard link."""
    return f"10.77.0.{region + 1}"


def lan_host(region: int, rank: int) -> str:
    """Local rank ``rank`` of region ``region``'s address on its region's LAN."""
    return f"10.78.{region}.{rank + 1}"


class RegionNet:
    """The namespaces and links of R regions x N ranks (see the module docstring); a context manager."""

    def __init__(self, regions: int, ranks: int, rate: str) -> None:
        if regions < 2 or ranks < 1:
            raise ValueError(f"need >= 2 regions of >= 1 rank, got {regions} x {ranks}")
        if regions > 250 or ranks > 250:
            raise ValueError("at most 250 regions and 250 ranks (one /24 each)")
        self.regions, self.ranks = regions, ranks
        self.bps = parse_rate(rate) * 8.0
        self.prefix = f"dpr{os.getpid() % 100000}"
        self._created: list[str] = []

    def ns(self, region: int, rank: int) -> str:
        """The namespace of local rank ``rank`` of region ``region``."""
        return f"{self.prefix}-r{region}k{rank}"

    def __enter__(self) -> RegionNet:
        try:
            for r in range(self.regions):
                for k in range(self.ranks):
                    self._add_ns(self.ns(r, k))
            if self.ranks > 1:
                for r in range(self.regions):
                    self._up_lan(r)
            for k in range(self.ranks):
                if self.regions == 2:
                    self._up_wan_pair(k)
                else:
                    self._up_wan_star(k)
        except BaseException:
            self.down()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.down()

    def _add_ns(self, ns: str) -> None:
        _ip("netns", "add", ns)
        self._created.append(ns)
        _ip("-n", ns, "link", "set", "lo", "up")

    def _bridge(self, hub: str) -> None:
        self._add_ns(hub)
        _ip("-n", hub, "link", "add", "br0", "type", "bridge")
        _ip("-n", hub, "link", "set", "br0", "up")

    def _veth(self, ns: str, dev: str, addr: str, hub: str, port: str) -> None:
        """A veth from ``ns`` (``dev``, ``addr``/24) to the bridge of ``hub`` (``port``); created in place."""
        _ip("link", "add", dev, "netns", ns, "type", "veth", "peer", "name", port, "netns", hub)
        _ip("-n", hub, "link", "set", port, "master", "br0")
        _ip("-n", hub, "link", "set", port, "up")
        _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
        _ip("-n", ns, "link", "set", dev, "up")

    def _up_lan(self, region: int) -> None:
        hub = f"{self.prefix}-l{region}"
        self._bridge(hub)
        for k in range(self.ranks):
            self._veth(self.ns(region, k), LAN_DEV, lan_host(region, k), hub, f"p{k}")

    def _up_wan_pair(self, rank: int) -> None:
        a, b = self.ns(0, rank), self.ns(1, rank)
        _ip("link", "add", WAN_DEV, "netns", a, "type", "veth", "peer", "name", WAN_DEV, "netns", b)
        for r, ns in enumerate((a, b)):
            _ip("-n", ns, "addr", "add", f"{wan_host(r)}/24", "dev", WAN_DEV)
            _ip("-n", ns, "link", "set", WAN_DEV, "up")
            shape(ns, WAN_DEV, self.bps)

    def _up_wan_star(self, rank: int) -> None:
        hub = f"{self.prefix}-w{rank}"
        self._bridge(hub)
        for r in range(self.regions):
            ns = self.ns(r, rank)
            self._veth(ns, WAN_DEV, wan_host(r), hub, f"p{r}")
            shape(ns, WAN_DEV, self.bps)  # region -> hub
            shape(hub, f"p{r}", self.bps)  # hub -> region

    def down(self) -> None:
        """Remove every namespace created here (their veths go with them); never raises."""
        for ns in reversed(self._created):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30, check=False)
        self._created = []
