"""The emulated WAN's shaping: every shaped veth end has tbf at the asked rate, and a GSO size under its bucket.

A TSO super-packet larger than tbf's bucket is cut into MTU-sized packets in software (sch_tbf's
`tbf_segment`), charging the trainers' own cores on one host for work a real NIC does in hardware; the
GSO cap avoids that without changing the link (same rate, same bucket). Checked for both layouts: the
veth pair of two regions (deploy/netns-wan.sh) and the star of three (`Namespaces._up_star`). Needs root.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from dreamp2p.config import parse_rate
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
