"""`Namespaces.block`: a one-way partition. What the blocked regions send to the others is dropped on arrival
while the others' packets still reach them, and `unblock` heals it; in the tbf star and the veth pair. Needs root.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from dreamp2p.devtools.netns import Namespaces

pytestmark = [
    pytest.mark.netns,
    pytest.mark.timeout(120),
    pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root"),
]

# sends one UDP datagram to ADDR and waits for it on the receiving side: prints 1 if it arrived, 0 if not
RECEIVE = """
import socket, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.bind((sys.argv[1], 47123)); s.settimeout(1.5)
try:
    s.recvfrom(64); print(1)
except TimeoutError:
    print(0)
"""
SEND = """
import socket, sys, time
time.sleep(0.4)
socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b"x", (sys.argv[1], 47123))
"""


def arrives(ns: Namespaces, src: int, dst: int) -> bool:
    (src_ns, _), (dst_ns, dst_addr) = ns.hosts[src], ns.hosts[dst]
    assert src_ns is not None and dst_ns is not None
    recv = subprocess.Popen(
        ["ip", "netns", "exec", dst_ns, sys.executable, "-c", RECEIVE, dst_addr], stdout=subprocess.PIPE, text=True
    )
    subprocess.run(["ip", "netns", "exec", src_ns, sys.executable, "-c", SEND, dst_addr], check=True, timeout=30)
    out, _ = recv.communicate(timeout=30)
    return out.strip() == "1"


@pytest.mark.parametrize("regions", [2, 3])
def test_block_drops_one_direction_only_until_unblocked(regions: int) -> None:
    with Namespaces(regions, "50mbit") as ns:
        assert arrives(ns, 0, 1) and arrives(ns, 1, 0)
        ns.block([0], [1])
        assert not arrives(ns, 0, 1)  # region 0 reaches nobody it was blocked from
        assert arrives(ns, 1, 0)  # but hears them
        if regions == 3:
            assert arrives(ns, 0, 2) and arrives(ns, 2, 1)  # the rest of the star is untouched
        ns.unblock([0], [1])
        assert arrives(ns, 0, 1) and arrives(ns, 1, 0)
        ns.block([0], [1])  # a second time: the local table stays moved, no error
        assert not arrives(ns, 0, 1)


def test_blocks_of_two_layers_are_made_and_healed_apart_through_the_packet_emulator() -> None:
    """Through the packet emulator (TUN devices, no links of ours) a block works as on tbf links, and a block of
    another layer on the same regions (a link flap over a partition, `bench chaos`) is a rule of its own: healing
    one leaves the other in place."""
    with Namespaces(3, "50mbit", rtt="4ms") as ns:
        assert ns.emulator is not None
        assert arrives(ns, 0, 1) and arrives(ns, 1, 0)
        ns.block([0], [1])
        ns.block([0], [1], layer=1)
        assert not arrives(ns, 0, 1) and arrives(ns, 1, 0) and arrives(ns, 0, 2)
        ns.unblock([0], [1], layer=1)
        assert not arrives(ns, 0, 1)  # the first layer's rule still drops
        ns.unblock([0], [1])
        assert arrives(ns, 0, 1)
    with pytest.raises(ValueError, match=r"block layer must be in 0\.\.99"):
        Namespaces(2, "50mbit")._drop(0, 1, layer=100)
