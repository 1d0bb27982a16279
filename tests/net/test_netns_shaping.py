"""The emulated WAN's shaping: every shaped veth end has tbf at the asked rate, and a GSO size under its bucket.

A TSO super-packet larger than tbf's bucket is cut into MTU-sized packets in software (sch_tbf's
`tbf_segment`), charging the trainers' own cores on one host for work a real NIC does in hardware; the
GSO cap avoids that without changing the link (same rate, same bucket). Checked for every layout: the
veth pair of two regions (deploy/netns-wan.sh), the star of three, and `bench regions`' shard links. Needs root.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from dreamp2p.config import parse_rate
from dreamp2p.devtools.bench.regions.net import RegionNet
from dreamp2p.devtools.netns import Namespaces


def _run_json(*args: str) -> list[dict[str, object]]:
    out = subprocess.run(list(args), capture_output=True, text=True, timeout=30, check=True).stdout
    return json.loads(out) if out.strip() else []


def _shaped_devices(prefix: str) -> list[tuple[str, str, dict[str, object], int]]:
    """(namespace, device, tbf options, gso_max_size) for every device under a tbf root qdisc."""
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30, check=True).stdout
    found = []
    for ns in (line.split()[0] for line in names.splitlines() if line.startswith(prefix)):
        for link in _run_json("ip", "-n", ns, "-j", "-d", "link", "show"):
            dev = str(link["ifname"])
            for q in _run_json("tc", "-n", ns, "-j", "qdisc", "show", "dev", dev):
                if q.get("kind") == "tbf" and q.get("root"):
                    options = q["options"]
                    assert isinstance(options, dict)
                    found.append((ns, dev, options, int(str(link["gso_max_size"]))))
    return found


@pytest.mark.netns
@pytest.mark.timeout(120)
@pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root")
@pytest.mark.parametrize(("regions", "rate"), [(2, "100mbit"), (2, "20mbit"), (3, "20mbit")])
def test_every_shaped_end_has_the_rate_and_a_gso_size_under_its_bucket(regions: int, rate: str) -> None:
    with Namespaces(regions, rate) as ns:
        shaped = _shaped_devices(ns.prefix)
        # a pair shapes both ends; a star shapes each region's end and the hub's port facing it
        assert len(shaped) == (2 if regions == 2 else 2 * regions), shaped
        for name, dev, options, gso in shaped:
            assert int(str(options["rate"])) == int(parse_rate(rate)), (name, dev, options)
            burst = int(str(options["burst"]))
            # tbf counts every segment's headers in a GSO packet's length (66 bytes per 1448 of payload)
            assert gso * 1.06 <= burst, (name, dev, gso, burst)
            assert gso >= 16384, (name, dev, gso)  # still super-packets, not MTU-sized sends


_SINK = """
import socket, sys
s = socket.socket()
s.bind((sys.argv[1], 0))
s.listen()
print(s.getsockname()[1], flush=True)
c, _ = s.accept()
n = 0
while chunk := c.recv(1 << 20):
    n += len(chunk)
print(n, flush=True)
"""
_SOURCE = """
import socket, sys
socket.create_connection((sys.argv[1], int(sys.argv[2]))).sendall(b"x" * int(sys.argv[3]))
"""


@pytest.mark.netns
@pytest.mark.timeout(120)
@pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root")
def test_tx_bytes_counts_the_headers_of_every_segment_the_wire_carries() -> None:
    """`Namespaces.tx_bytes` counts what the wire carries: payload plus each MTU segment's headers (~4.6%),
    not the veth's one header per GSO super-packet (which would read under 1% over the payload)."""
    payload = 4_000_000
    with Namespaces(2, "100mbit") as ns:
        (ns_a, _), (ns_b, addr_b) = ns.hosts
        assert ns_a is not None and ns_b is not None
        sink = subprocess.Popen(
            ["ip", "netns", "exec", ns_b, sys.executable, "-c", _SINK, addr_b], stdout=subprocess.PIPE, text=True
        )
        try:
            assert sink.stdout is not None
            port = sink.stdout.readline().strip()
            before = ns.tx_bytes()
            subprocess.run(
                ["ip", "netns", "exec", ns_a, sys.executable, "-c", _SOURCE, addr_b, port, str(payload)],
                check=True,
                timeout=60,
            )
            assert int(sink.stdout.readline()) == payload
            sent = ns.tx_bytes()[0] - before[0]
        finally:
            sink.kill()
            sink.wait(10)
    # 52 bytes of TCP/IP headers (timestamps on) + 14 of Ethernet per 1448 of payload is 4.6%
    assert payload * 1.03 < sent < payload * 1.08, sent


@pytest.mark.netns
@pytest.mark.timeout(120)
@pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root")
@pytest.mark.parametrize(("regions", "ranks"), [(2, 2), (3, 1)])
def test_bench_regions_shard_links_are_shaped_the_same_way(regions: int, ranks: int) -> None:
    """`bench regions`' shard links go through the same `shape` as `bench lm`'s: rate, bucket, GSO cap."""
    with RegionNet(regions, ranks, "20mbit") as net:
        shaped = _shaped_devices(net.prefix)
        # a pair per shard shapes both ends; a star per shard shapes each region's end and its hub port
        assert len(shaped) == ranks * (2 if regions == 2 else 2 * regions), shaped
        for name, dev, options, gso in shaped:
            assert int(str(options["rate"])) == int(parse_rate("20mbit")), (name, dev, options)
            assert gso * 1.06 <= int(str(options["burst"])), (name, dev, gso, options)
