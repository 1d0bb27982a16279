"""Network namespaces for local multi-region runs: one per region, every link direction shaped by tbf.

Needs root (ip netns, tc). Two regions get one veth pair (deploy/netns-wan.sh); more get a star through a
bridge namespace. Used by `bench lm`; removed on exit, also when the run is interrupted. Given a round-trip
time, jitter or loss, the regions are joined instead through the packet-level WAN emulator
(`dreamp2p.devtools.wanemu`: a TUN device per region, every direction delayed, jittered, lossy, rate-limited).
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
from pathlib import Path
from typing import Any

from dreamp2p.config import parse_rate
from dreamp2p.devtools.wanemu import WanEmulator
from dreamp2p.devtools.wanmodel import WanPath

log = logging.getLogger(__name__)

SCRIPT = Path(__file__).resolve().parents[2] / "deploy" / "netns-wan.sh"


# ---------------------------------------------------------------------------------------------- network


def _ip(*args: str) -> str:
    res = subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)
    return res.stdout


def tbf_burst(bps: float) -> int:
    """tbf's bucket in bytes: at least rate/HZ; 4 ms worth of bytes, never under 32 KiB (as netns-wan.sh)."""
    return max(32768, int(bps / 8 / 1000 * 4))


def shape(ns: str, dev: str, bps: float) -> None:
    """Shape ``dev``'s egress in ``ns`` with tbf at ``bps`` bits/s, its GSO size capped under the bucket.

    tbf cuts a TSO super-packet larger than its bucket into MTU packets in software, charging the trainers'
    cores on one host for a NIC's work; a GSO size under the bucket keeps the link the same without it (an
    eighth left for the segments' headers, which tbf counts), as netns-wan.sh does.
    """
    burst = tbf_burst(bps)
    tbf = ["tbf", "rate", f"{int(bps)}bit", "burst", str(burst), "latency", "100ms"]
    _ip("netns", "exec", ns, "tc", "qdisc", "replace", "dev", dev, "root", *tbf)
    try:
        _ip("-n", ns, "link", "set", "dev", dev, "gso_max_size", str(min(65536, burst * 7 // 8)))
    except subprocess.CalledProcessError as exc:
        log.warning("could not cap %s's GSO size, tbf will segment in software: %s", dev, exc.stderr.strip())


def wire_bytes(dev: str, ns: str | None = None) -> int:
    """Bytes ``dev``'s tbf root qdisc has sent (in ``ns``, or this process's namespace).

    Not the device's own counter: with GSO a veth counts one header per super-packet, while tbf counts the
    length of every segment the wire would carry, headers included (qdisc_pkt_len).
    """
    where = ["-n", ns] if ns else []
    out = subprocess.run(
        ["tc", *where, "-s", "-j", "qdisc", "show", "dev", dev], check=True, capture_output=True, text=True, timeout=30
    ).stdout
    for q in json.loads(out or "[]"):
        if q.get("root") and q.get("kind") == "tbf":
            return int(q["bytes"])
    raise RuntimeError(f"{dev} in {ns or 'this namespace'} has no tbf root qdisc")


class Namespaces:
    """Network namespaces for the regions, each link direction shaped by tbf; use as a context manager.

    ``hosts``: (namespace, address) per rank for `run_local`; ``devs``: (namespace, device) per rank, the
    region's own end of its link (its tbf's byte counter is what the region sent, see `wire_bytes`).

    With ``rtt``, ``jitter`` or ``loss`` (e.g. ``rtt="100ms", loss="0.1%"``), or a whole ``wan`` path, every
    region gets a TUN device instead and the packet emulator forwards between them: each directed pair of
    regions is a path of its own at ``rate`` (see `dreamp2p.devtools.wanmodel`). `split`, `join` and
    `set_rate` are the tbf layout's only (`block` and `unblock` work in every layout); `tx_bytes` then
    counts the IP bytes each region handed the emulator.
    """

    def __init__(
        self,
        n: int,
        rate: str,
        *,
        rtt: str | float | None = None,
        jitter: str | float | None = None,
        loss: str | float | None = None,
        wan: WanPath | None = None,
    ) -> None:
        self.n = n
        self.bps = parse_rate(rate) * 8.0
        if wan is None and (rtt or jitter or loss):
            wan = WanPath.parse(self.bps, rtt=rtt or 0.0, jitter=jitter or 0.0, loss=loss or 0.0)
        self.wan = wan
        self.emulator: WanEmulator | None = None
        tag = os.getpid() % 100000
        self.prefix = f"dpm{tag}"
        self.subnet = f"10.204.{tag % 200 + 20}"
        self.hosts: list[tuple[str | None, str]] = []
        self.devs: list[tuple[str, str]] = []
        self._created: list[str] = []

    def __enter__(self) -> Namespaces:
        try:
            if self.wan is not None:
                self._up_emulated(self.wan)
            elif self.n == 2:
                self._up_pair()
            else:
                self._up_star()
        except BaseException:
            self.down()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.down()

    def _up_pair(self) -> None:
        p, s = self.prefix, self.subnet
        self._created = [f"{p}-a", f"{p}-b"]
        subprocess.run(
            ["bash", str(SCRIPT), "up", "--prefix", p, "--rate", f"{int(self.bps)}bit", "--subnet", s],
            check=True,
            capture_output=True,
            text=True,
            timeout=60,
        )
        self.hosts = [(f"{p}-a", f"{s}.1"), (f"{p}-b", f"{s}.2")]
        self.devs = [(f"{p}-a", f"{p}-va"), (f"{p}-b", f"{p}-vb")]

    def _up_star(self) -> None:
        p, s = self.prefix, self.subnet
        hub, bridge = f"{p}-x", f"{p}-br"
        _ip("netns", "add", hub)
        self._created.append(hub)
        _ip("-n", hub, "link", "add", bridge, "type", "bridge")
        _ip("-n", hub, "link", "set", bridge, "up")
        for i in range(self.n):
            ns, dev, far = f"{p}-r{i}", f"{p}-v{i}", f"{p}-p{i}"
            _ip("netns", "add", ns)
            self._created.append(ns)
            _ip("link", "add", dev, "type", "veth", "peer", "name", far)
            _ip("link", "set", dev, "netns", ns)
            _ip("link", "set", far, "netns", hub)
            _ip("-n", hub, "link", "set", far, "master", bridge)
            _ip("-n", hub, "link", "set", far, "up")
            _ip("-n", ns, "addr", "add", f"{s}.{i + 1}/24", "dev", dev)
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", ns, "link", "set", dev, "up")
            shape(ns, dev, self.bps)  # region -> hub
            shape(hub, far, self.bps)  # hub -> region
            self.hosts.append((ns, f"{s}.{i + 1}"))
            self.devs.append((ns, dev))

    def _up_emulated(self, wan: WanPath) -> None:
        p, s = self.prefix, self.subnet
        ports = []
        for i in range(self.n):
            ns = f"{p}-r{i}"
            _ip("netns", "add", ns)
            self._created.append(ns)
            ports.append((ns, f"{p}-t{i}", f"{s}.{i + 1}"))
        self.emulator = WanEmulator(ports, wan)
        self.emulator.start()
        for ns, dev, addr in ports:
            # no IPv6 on the TUN: its router solicitations would be the only stray packets on the paths
            subprocess.run(
                ["ip", "netns", "exec", ns, "sysctl", "-qw", f"net.ipv6.conf.{dev}.disable_ipv6=1"],
                capture_output=True,
                timeout=30,
                check=False,
            )
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", ns, "link", "set", dev, "up")
            self.hosts.append((ns, addr))
            self.devs.append((ns, dev))

    def _tbf_only(self, what: str) -> None:
        if self.wan is not None:
            raise ValueError(f"{what}() needs the tbf layout, not the packet emulator (rtt/jitter/loss)")

    def emulator_stats(self) -> dict[str, Any]:
        """The packet emulator's counters (see `WanEmulator.stats`); its last ones once it has stopped."""
        if self.emulator is None:
            raise ValueError("emulator_stats() needs the packet emulator (rtt/jitter/loss)")
        return self.emulator.stats()

    def split(self, apart: list[int]) -> None:
        """Partition the star: regions ``apart`` move to a bridge of their own, reaching only each other.

        Their links stay up (no carrier loss to notice), packets just stop crossing: what a real partition
        between two groups of regions looks like to both sides. :meth:`join` heals it.
        """
        self._tbf_only("split")
        if self.n == 2:
            raise ValueError("split() needs the star layout (3 regions or more)")
        hub, other = f"{self.prefix}-x", f"{self.prefix}-br2"
        _ip("-n", hub, "link", "add", other, "type", "bridge")
        _ip("-n", hub, "link", "set", other, "up")
        for i in apart:
            _ip("-n", hub, "link", "set", f"{self.prefix}-p{i}", "master", other)

    def block(self, src: list[int], dst: list[int], layer: int = 0) -> None:
        """One direction of a partition: what regions ``src`` send to regions ``dst`` is dropped on arrival,
        silently, while ``dst``'s packets still reach ``src``. :meth:`unblock` heals it.

        A blackhole policy rule in each ``dst`` region's namespace for packets from a ``src`` address
        arriving on its link, ranked before the local table (moved from rank 0 to 1000 there once): no tc
        action or netfilter module is needed, and the links' shaping stays as it is. ``layer``: blocks of
        different layers are rules of their own (a link flap over a partition), made and healed apart.
        """
        for j in dst:
            ns = self.hosts[j][0]
            assert ns is not None
            if "lookup local" in _ip("-n", ns, "rule", "show", "pref", "0"):
                _ip("-n", ns, "rule", "add", "pref", "1000", "lookup", "local")
                _ip("-n", ns, "rule", "del", "pref", "0")
            for i in src:
                _ip("-n", ns, "rule", "add", *self._drop(i, j, layer))

    def unblock(self, src: list[int], dst: list[int], layer: int = 0) -> None:
        """Heal :meth:`block` of the same regions and layer."""
        for j in dst:
            for i in src:
                _ip("-n", str(self.hosts[j][0]), "rule", "del", *self._drop(i, j, layer))

    def _drop(self, i: int, j: int, layer: int = 0) -> list[str]:
        if not 0 <= layer < 100:
            raise ValueError(f"block layer must be in 0..99, got {layer}")
        return ["pref", str(10 + layer), "from", f"{self.hosts[i][1]}/32", "iif", self.devs[j][1], "blackhole"]

    def hub_link(self, i: int) -> tuple[str, str]:
        """(namespace, device) of region ``i``'s port on the hub (star layout): down, the region is cut off."""
        self._star_only("hub_link")
        return f"{self.prefix}-x", f"{self.prefix}-p{i}"

    def _star_only(self, what: str) -> None:
        self._tbf_only(what)
        if self.n == 2:
            raise ValueError(f"{what}() needs the star layout (3 regions or more)")

    def set_rate(self, ranks: list[int], rate: str) -> None:
        """Reshape the links of regions ``ranks`` (both directions, star layout) to ``rate`` (e.g. "4mbit")."""
        self._tbf_only("set_rate")
        if self.n == 2:
            raise ValueError("set_rate() needs the star layout (3 regions or more)")
        bps = parse_rate(rate) * 8.0
        for i in ranks:
            shape(f"{self.prefix}-r{i}", f"{self.prefix}-v{i}", bps)
            shape(f"{self.prefix}-x", f"{self.prefix}-p{i}", bps)

    def join(self) -> None:
        """Heal :meth:`split`: every region's port back on the one bridge, the second bridge removed."""
        self._tbf_only("join")
        hub = f"{self.prefix}-x"
        for i in range(self.n):
            _ip("-n", hub, "link", "set", f"{self.prefix}-p{i}", "master", f"{self.prefix}-br")
        _ip("-n", hub, "link", "del", f"{self.prefix}-br2")

    def down(self) -> None:
        """Remove every namespace (and any veth left in this one) created here; never raises."""
        if self.emulator is not None:
            try:
                self.emulator.stop()  # its TUN devices go with it
            except Exception as exc:  # never raises: the namespaces must still go
                log.warning("stopping the WAN emulator: %s", exc)
        if self.n == 2 and self.wan is None:
            subprocess.run(
                ["bash", str(SCRIPT), "down", "--prefix", self.prefix], capture_output=True, timeout=60, check=False
            )
        for ns in self._created:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30, check=False)
        for i in range(self.n if self.n != 2 and self.wan is None else 0):
            subprocess.run(["ip", "link", "del", f"{self.prefix}-v{i}"], capture_output=True, timeout=30, check=False)
        self._created = []

    def tx_bytes(self) -> list[int]:
        """Per rank: bytes its link end has put on the wire so far (its tbf's counter, see `wire_bytes`).

        With the packet emulator: the IP bytes the region handed it (before queue drops and losses)."""
        if self.emulator is not None:
            sent = [0] * self.n
            for path in self.emulator.stats()["paths"]:
                sent[int(path["src"])] += int(path["in_bytes"])
            return sent
        return [wire_bytes(dev, ns) for ns, dev in self.devs]
