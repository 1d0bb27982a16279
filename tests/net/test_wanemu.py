"""The packet WAN emulator between real namespaces: round trips, loss and rate as configured. Needs root.

Traffic goes only between the namespaces each test creates (`Namespaces(..., rtt=..., loss=...)`), by small
Python programs run in them. Assertions are on the emulator's correctness (what the receiver sees against
what was asked), never on this machine's speed: the rates are ones the forwarder carries with room to spare.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import statistics
import subprocess
import sys
import time

import pytest

from dreamp2p.devtools.netns import Namespaces
from dreamp2p.devtools.wanemu import summary
from dreamp2p.devtools.wanmodel import WanPath

pytestmark = [
    pytest.mark.netns,
    pytest.mark.timeout(180),
    pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root"),
]

_ECHO = """
import socket, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.bind((sys.argv[1], 0))
print(s.getsockname()[1], flush=True)
while True:
    data, peer = s.recvfrom(2048)
    s.sendto(data, peer)
"""

# count probes `interval` apart, each carrying its number; prints the round trip of every echo that came back
_PING = """
import json, select, socket, struct, sys, time
host, port, count, interval = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.connect((host, port))
sent, rtts = {}, {}
t0 = time.perf_counter()
def drain(until):
    while True:
        left = until - time.perf_counter()
        if left <= 0 or not select.select([s], [], [], left)[0]:
            return
        now = time.perf_counter()
        (i,) = struct.unpack("!I", s.recv(64)[:4])
        rtts[i] = now - sent[i]
for i in range(count):
    sent[i] = time.perf_counter()
    s.send(struct.pack("!I", i) + bytes(28))
    drain(t0 + (i + 1) * interval)
drain(time.perf_counter() + 2.0)
print(json.dumps(rtts))
"""

_SINK = """
import json, socket, sys, time
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
s.bind((sys.argv[1], 0))
print(s.getsockname()[1], flush=True)
seqs, stamps, sizes = [], [], []
s.settimeout(30.0)
first = s.recv(2048)
seqs.append(int.from_bytes(first[:4], "big")); stamps.append(time.perf_counter()); sizes.append(len(first))
s.settimeout(1.5)
try:
    while True:
        data = s.recv(2048)
        stamps.append(time.perf_counter()); seqs.append(int.from_bytes(data[:4], "big")); sizes.append(len(data))
except socket.timeout:
    pass
print(json.dumps({"seqs": seqs, "stamps": stamps, "sizes": sizes}), flush=True)
"""

# count datagrams of `size` bytes at `pps` packets/s, paced in small bursts
_SOURCE = """
import socket, sys, time
host, port, count, size, pps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5])
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.connect((host, port))
pad = bytes(size - 4)
t0 = time.perf_counter()
for i in range(count):
    wait = t0 + i / pps - time.perf_counter()
    if wait > 0.002:
        time.sleep(wait)
    s.send(i.to_bytes(4, "big") + pad)
"""


def _in_ns(ns: str | None, code: str, *args: object) -> list[str]:
    assert ns is not None
    return ["ip", "netns", "exec", ns, sys.executable, "-c", code, *map(str, args)]


def _serve(ns: str | None, code: str, addr: str) -> tuple[subprocess.Popen[str], int]:
    proc = subprocess.Popen(_in_ns(ns, code, addr), stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    return proc, int(proc.stdout.readline())


def _ping(net: Namespaces, count: int, interval: float) -> list[float]:
    (ns_a, _), (ns_b, addr_b) = net.hosts
    echo, port = _serve(ns_b, _ECHO, addr_b)
    try:
        out = subprocess.run(
            _in_ns(ns_a, _PING, addr_b, port, count, interval), capture_output=True, text=True, timeout=120, check=True
        ).stdout
    finally:
        echo.kill()
        echo.wait(10)
    return list(json.loads(out).values())


def _stream(net: Namespaces, count: int, size: int, pps: float) -> dict[str, list[float]]:
    """Send ``count`` datagrams from the first region to the second; what the receiver saw."""
    (ns_a, _), (ns_b, addr_b) = net.hosts
    sink, port = _serve(ns_b, _SINK, addr_b)
    try:
        subprocess.run(_in_ns(ns_a, _SOURCE, addr_b, port, count, size, pps), timeout=120, check=True)
        assert sink.stdout is not None
        seen = json.loads(sink.stdout.readline())
    finally:
        sink.kill()
        sink.wait(10)
    return dict(seen)


def binomial_interval(n: int, p: float, confidence: float = 0.999) -> tuple[int, int]:
    """The central ``confidence`` interval of Binomial(n, p): the smallest [lo, hi] with each tail under (1-c)/2."""
    tail = (1.0 - confidence) / 2.0
    log_pmf = [
        math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1) + k * math.log(p) + (n - k) * math.log1p(-p)
        for k in range(n + 1)
    ]
    cdf, lo = 0.0, 0
    for k in range(n + 1):
        cdf += math.exp(log_pmf[k])
        if cdf > tail:
            lo = k
            break
    sf, hi = 0.0, n
    for k in range(n, -1, -1):
        sf += math.exp(log_pmf[k])
        if sf > tail:
            hi = k
            break
    return lo, hi


def test_binomial_interval_matches_the_normal_approximation() -> None:
    lo, hi = binomial_interval(20000, 0.02)
    half = 3.29 * math.sqrt(20000 * 0.02 * 0.98)
    assert abs(lo - (400 - half)) <= 3 and abs(hi - (400 + half)) <= 3, (lo, hi)


@pytest.mark.parametrize("rtt_ms", [40, 200])
def test_echo_round_trips_take_the_configured_rtt(rtt_ms: int) -> None:
    with Namespaces(2, "20mbit", rtt=f"{rtt_ms}ms") as net:
        rtts = _ping(net, count=20, interval=0.05)
        stats = net.emulator_stats()
    assert len(rtts) == 20, rtts  # no loss configured
    rtt = rtt_ms / 1e3
    # the model delays exactly (plus ~1 µs of serialization); the rest is the hosts' scheduling
    assert min(rtts) >= rtt * 0.995, rtts
    assert statistics.median(rtts) <= rtt * 1.10, rtts
    assert stats["unroutable"] == 0, stats


def test_jitter_spreads_round_trips_around_the_rtt() -> None:
    # each direction's delay varies by a normal of sd 8 ms: a round trip's sd is sqrt(2) * 8 ms
    with Namespaces(2, "20mbit", wan=WanPath.parse("20mbit", rtt="100ms", jitter="8ms", reorder=True)) as net:
        rtts = _ping(net, count=150, interval=0.02)
    assert len(rtts) == 150
    assert abs(statistics.mean(rtts) - 0.100) <= 0.010, statistics.mean(rtts)
    sd = statistics.stdev(rtts)
    assert 0.75 * math.sqrt(2) * 0.008 <= sd <= 1.3 * math.sqrt(2) * 0.008, sd


@pytest.mark.parametrize("loss", [0.005, 0.05])
def test_a_counted_stream_loses_packets_at_the_configured_rate(loss: float) -> None:
    count = 20000
    with Namespaces(2, "20mbit", wan=WanPath.parse("20mbit", rtt="10ms", loss=loss, seed=12345)) as net:
        seen = _stream(net, count, size=100, pps=4000)  # ~4 Mbit/s: no queue at 20 Mbit/s
        stats = net.emulator_stats()
    forward = next(p for p in stats["paths"] if p["src"] == 0)
    assert forward["in_pkts"] == count, forward  # every datagram reached the emulator: only it lost any
    assert forward["queue_drops"] == 0, forward
    received = len(seen["seqs"])
    assert received == count - forward["lost"], (received, forward)
    lo, hi = binomial_interval(count, 1.0 - loss)
    assert lo <= received <= hi, (received, lo, hi)


def test_bursty_loss_comes_in_bursts_of_the_configured_mean_length() -> None:
    count, loss, burst = 20000, 0.02, 4.0
    path = WanPath.parse("20mbit", rtt="10ms", loss=loss, loss_burst=burst, seed=7)
    with Namespaces(2, "20mbit", wan=path) as net:
        seen = _stream(net, count, size=100, pps=4000)
    got = sorted(set(int(s) for s in seen["seqs"]))
    gaps = [b - a - 1 for a, b in itertools.pairwise(got) if b - a > 1]
    lost = count - len(got)
    # ~100 bursts of geometric length (sd ~3.5): the mean within ~3 standard errors
    assert abs(statistics.mean(gaps) - burst) <= 0.3 * burst, (statistics.mean(gaps), len(gaps))
    assert abs(lost / count - loss) <= 0.4 * loss, lost


def test_the_receiver_sees_the_configured_rate() -> None:
    rate_bps, size = 20e6, 1400
    ip_size = size + 28  # UDP and IPv4 headers: the emulator's rate counts IP packets
    pps = rate_bps / 8 / ip_size * 1.3  # overdriven by 30%: the bottleneck queue fills and tail-drops
    count = int(pps * 4)  # ~4 s
    with Namespaces(2, "20mbit", rtt="20ms") as net:
        t0 = time.perf_counter()
        seen = _stream(net, count, size=size, pps=pps)
        s = summary(net.emulator_stats())
    stamps = seen["stamps"]
    # bytes after the first packet over the time from its arrival to the last one's
    carried = (len(stamps) - 1) * ip_size * 8 / (stamps[-1] - stamps[0])
    assert abs(carried / rate_bps - 1.0) <= 0.05, (carried, s, time.perf_counter() - t0)
    assert s["queue_drops"] > 0, s  # it was the emulator that held the rate
