"""`dreamp2p bench transport`: goodput of the transport between two processes.

A receiver process serves the real servicer (serde, auth, limits) backed by a sink that verifies each
frame's checksum and size and counts it; a sender process handshakes on every channel of a
:class:`~dreamp2p.transport.client.Link` (as a member's link does) and streams fp32 frames over it with
bandwidth-aware chunk size and parallel streams. The
reduction work of a real round is measured separately by `bench allreduce`. With ``netns`` both
processes run in two network namespaces joined by a tbf-shaped veth pair (deploy/netns-wan.sh), and
``link_util`` is goodput over the shaped rate. With a round-trip time, jitter or loss the namespaces are
joined by the packet-level WAN emulator instead (`dreamp2p.devtools.wanemu`), whose packet counts and CPU
time per MB are reported under ``emulator``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing as mp
import multiprocessing.connection
import os
import subprocess
import time
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import xxhash

from dreamp2p.collective.chunking import choose_chunk_bytes
from dreamp2p.config import PeerConfig, PeerInfo, TransportConfig, parse_rate
from dreamp2p.config.parse import parse_duration
from dreamp2p.devtools.launch import enter_netns
from dreamp2p.devtools.netns import Namespaces
from dreamp2p.devtools.wanemu import summary
from dreamp2p.errors import PeerError, Status
from dreamp2p.messages import PROTOCOL_VERSION, DType, Frame, Hello, MemberProgress, PeerStatus, Phase, Vote
from dreamp2p.transport.linkrate.kernelnet import read_tcp_limits
from dreamp2p.transport.linkrate.tcptuning import choose_streams, per_flow_rate_Bps

if TYPE_CHECKING:
    from dreamp2p.transport.client import Link

log = logging.getLogger(__name__)

SCRIPT = Path(__file__).resolve().parents[3] / "deploy" / "netns-wan.sh"


@contextlib.contextmanager
def wan_namespaces(rate: str, prefix: str = "dp2pbench") -> Iterator[list[tuple[str | None, str]]]:
    """Create the two shaped namespaces for the duration of the block; always removes them."""
    if not SCRIPT.exists():
        raise FileNotFoundError(f"{SCRIPT} not found: --netns needs a source checkout")
    try:
        out = subprocess.run(
            ["bash", str(SCRIPT), "up", "--prefix", prefix, "--rate", rate],
            check=True,
            capture_output=True,
            text=True,
            timeout=60,
        ).stdout.split()
        yield [(out[0], out[1]), (out[2], out[3])]
    except subprocess.CalledProcessError as exc:
        raise RuntimeError(f"netns-wan.sh up failed: {exc.stderr.strip()}") from None
    finally:
        subprocess.run(["bash", str(SCRIPT), "down", "--prefix", prefix], capture_output=True, timeout=60, check=False)


class SinkBackend:
    """Servicer backend that verifies and counts frames instead of reducing them."""

    max_probe_bytes = 4 << 20

    def __init__(self, max_payload: int) -> None:
        self.max_payload = max_payload
        self.frames = 0
        self.bytes = 0
        self.first = 0.0
        self.last = 0.0
        self.handshakes = 0

    def admit(self, hello: Hello) -> Hello:
        self.handshakes += 1
        return Hello("bench", hello.protocol_version, "sink", hello.manifest_hash, hello.codecs)

    async def accept_frame(self, frame: Frame) -> None:
        if xxhash.xxh3_64_intdigest(frame.payload) != frame.checksum:
            raise PeerError(Status.CHECKSUM_MISMATCH, "payload checksum mismatch")
        if len(frame.payload) != 4 * frame.chunk_length:
            raise PeerError(Status.BAD_FRAME, "payload size does not match chunk length")
        now = time.perf_counter()
        if not self.frames:
            self.first = now
        self.frames += 1
        self.bytes += len(frame.payload)
        self.last = now

    def stream_broken(self, sender: str, keys: set[tuple[int, int]], reason: str) -> None:
        pass

    def note_rejected(self, err: PeerError) -> None:
        pass

    def note_probe(self, sender: str, nbytes: int) -> None:
        pass

    def vote(self, v: Vote) -> None:
        raise PeerError(Status.UNKNOWN_PEER, "the transport benchmark's sink takes part in no rounds")

    def status(self) -> PeerStatus:
        return PeerStatus("sink", "bench", 1, (), (), 0, 0, 0)

    def progress(self) -> MemberProgress | None:
        return None  # no trainer

    def out_of_ring(self) -> bool:
        return False


def sink_frame(elems: int, sender: str) -> Frame:
    """A frame of ``elems`` random fp32 values that `SinkBackend` takes (its checksum and size hold)."""
    payload = os.urandom(elems * 4)
    return Frame(
        1,
        0,
        0,
        Phase.REDUCE_SCATTER,
        0,
        0,
        0,
        elems,
        1,
        DType.FP32,
        elems,
        xxhash.xxh3_64_intdigest(payload),
        False,
        0,
        payload,
        sender,
    )


def run_sink(conn: mp.connection.Connection, host: str, netns: str | None, cfg: TransportConfig) -> None:
    if netns:
        enter_netns(netns)

    async def main() -> dict[str, Any]:
        from dreamp2p.transport.server import build_server

        sink = SinkBackend(cfg.max_message_bytes - (64 << 10))
        # the sink may listen in a network namespace of this machine (--netns): a private link, no TLS
        sink_cfg = PeerConfig(node_id="sink", listen=f"{host}:0", transport=cfg, allow_insecure=True)
        server, port = build_server(sink_cfg, sink)
        await server.start()
        conn.send(port)
        await asyncio.get_running_loop().run_in_executor(None, conn.recv)
        await server.stop(1.0)
        span = sink.last - sink.first
        return {"frames": sink.frames, "bytes": sink.bytes, "span_s": span, "handshakes": sink.handshakes}

    report_to(conn, main)


async def sink_link(cfg: TransportConfig, address: str, me: str) -> Link:
    """A member's link named ``me`` to the sink at ``address``, handshaken.

    On every channel, as a member's link does: a Push from a connection that never handshook must deliver its
    first frame within transport.first_frame_timeout_s, which a few MB per stream on fresh connections of a
    long path miss (8 streams at 100 ms: "sender did not finish").
    """
    from dreamp2p.transport.client import Link

    link = Link(me, PeerInfo("sink", address), cfg, None, None)
    await link.handshake(Hello("bench", PROTOCOL_VERSION, me, b"", ()), cfg.connect_timeout_s)
    return link


def _sender(
    conn: mp.connection.Connection, address: str, netns: str | None, cfg: TransportConfig, seconds: float
) -> None:
    if netns:
        enter_netns(netns)

    async def main() -> dict[str, Any]:
        link = await sink_link(cfg, address, "bench-sender")
        try:
            await link.probe_rtt()
            for _ in range(3):  # let the estimate settle before sizing chunks from it
                await link.probe_bandwidth(cfg.probe_burst_bytes)
            chunk = choose_chunk_bytes(
                link.stats.goodput_Bps,
                1 << 30,
                2,
                min_bytes=cfg.chunk_min_bytes,
                max_bytes=cfg.chunk_max_bytes,
            )
            frame = sink_frame(chunk // 4, "bench-sender")
            stream = link.open_stream(timeout=seconds + 60)
            t0 = time.perf_counter()
            sent = 0
            while time.perf_counter() - t0 < seconds:
                await stream.put(frame)
                sent += len(frame.payload)
            await stream.close()
            elapsed = time.perf_counter() - t0
            return {
                "bytes": sent,
                "seconds": elapsed,
                "chunk_bytes": chunk,
                "probe_goodput_MBps": link.stats.goodput_Bps / 1e6,
                "rtt_ms": link.stats.rtt_s * 1e3,
            }
        finally:
            await link.close()

    report_to(conn, main)


def report_to(conn: mp.connection.Connection, main: Callable[[], Coroutine[Any, Any, dict[str, Any]]]) -> None:
    """Run ``main`` and send its result, or ``{"error": ...}`` when it raised, so the parent never waits in vain."""
    try:
        result = asyncio.run(main())
    except Exception as exc:
        conn.send({"error": f"{type(exc).__name__}: {exc}"})
        raise
    conn.send(result)


def child_result(
    conn: mp.connection.Connection, proc: mp.process.BaseProcess, who: str, timeout: float
) -> dict[str, Any]:
    """What ``proc`` sent on ``conn`` within ``timeout`` seconds; RuntimeError naming its error, or that it died
    or did not answer in time."""
    deadline = time.monotonic() + timeout
    while not conn.poll(0.2):
        if not proc.is_alive() and not conn.poll(0.2):
            raise RuntimeError(f"{who} exited ({proc.exitcode}) without a result")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{who} did not finish within {timeout:g} s")
    res: dict[str, Any] = conn.recv()
    if "error" in res:
        raise RuntimeError(f"{who} failed: {res['error']}")
    return res


def auto_streams(rate: str, rtt: str, loss: float) -> tuple[int, dict[str, Any]]:
    """Streams for a link of ``rate``, ``rtt`` and ``loss`` under this host's TCP settings
    (`transport.linkrate.tcptuning.choose_streams`), and what they were chosen from."""
    limits = read_tcp_limits()
    window = limits.window_bytes if limits is not None else 2 << 20  # Linux's default tcp_wmem ceiling, halved
    loss_based = limits.loss_based if limits is not None else True
    rtt_s = max(parse_duration(rtt), 1e-3)  # an unemulated path: a millisecond, as a LAN
    n = choose_streams(rtt_s, parse_rate(rate), loss, window, loss_based=loss_based)
    flow = per_flow_rate_Bps(rtt_s, loss, window, loss_based=loss_based)
    why = {
        "window_bytes": window,
        "congestion": limits.congestion if limits is not None else None,
        "per_flow_Mbit": round(flow * 8 / 1e6, 1),
    }
    return n, why


def bench_transport(
    mbytes: float = 64.0,
    seconds: float = 6.0,
    streams: int | str = 2,
    netns: bool = False,
    rate: str = "100mbit",
    rtt: str = "0ms",
    jitter: str = "0ms",
    loss: float = 0.0,
) -> dict[str, Any]:
    """Measure one-way goodput; ``mbytes`` caps the sender's queued bytes (backpressure window).

    ``rtt``, ``jitter`` (sd of each direction's delay) and ``loss`` (per direction) need ``netns``;
    ``streams="auto"`` too (it chooses from the shaped rate, see `auto_streams`).
    """
    emulated = bool(parse_duration(rtt) or parse_duration(jitter) or loss)
    if emulated and not netns:
        raise ValueError("rtt, jitter and loss are emulated only across namespaces (netns=True)")
    if isinstance(streams, str):
        if streams != "auto" or not netns:
            raise ValueError(f"streams must be a count >= 1, or 'auto' with netns=True, got {streams!r}")
        streams, why = auto_streams(rate, rtt, loss)
        out = bench_transport(mbytes, seconds, streams, netns, rate, rtt, jitter, loss)
        out["streams_auto"] = why
        return out
    cfg = TransportConfig(streams_per_link=streams, outbound_queue_bytes=int(mbytes * 1e6))
    if netns:
        # on a slow link a deep queue only adds drain time after the measuring window
        queue = int(min(mbytes * 1e6, max(2 * cfg.chunk_max_bytes, parse_rate(rate) * 0.5)))
        cfg = TransportConfig(streams_per_link=streams, outbound_queue_bytes=queue, probe_burst_bytes=1 << 20)
        if emulated:
            # a queue as deep as the path's bytes in flight, so the sender's window can fill it
            queue = max(cfg.outbound_queue_bytes, int(parse_rate(rate) * parse_duration(rtt) * 2))
            cfg = TransportConfig(streams_per_link=streams, outbound_queue_bytes=queue, probe_burst_bytes=1 << 20)
            with Namespaces(2, rate, rtt=rtt, jitter=jitter, loss=loss) as net:
                out = _run_pair(cfg, seconds, net.hosts)
                final = net.emulator.stop() if net.emulator is not None else None
            out["emulator"] = summary(final) if final else None
            out.update(rtt=rtt, jitter=jitter, loss=loss)
        else:
            # tc reads "mbps" as megabytes: hand it plain bits/s, as parse_rate understood the rate
            with wan_namespaces(f"{round(parse_rate(rate) * 8)}bit") as hosts:
                out = _run_pair(cfg, seconds, hosts)
        rate_MBps = parse_rate(rate) / 1e6
        out["rate"] = rate
        out["link_util"] = round(out["goodput_MBps"] / rate_MBps, 3)
        return out
    return _run_pair(cfg, seconds, [(None, "127.0.0.1"), (None, "127.0.0.1")])


def beside_sink(
    cfg: TransportConfig,
    hosts: list[tuple[str | None, str]],
    target: Callable[..., None],
    args: tuple[Any, ...],
    who: str,
    timeout: float,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Serve the sink in ``hosts[1]`` and run ``target(conn, address, netns, cfg, *args)`` in ``hosts[0]``, each
    in its own process (``who`` names the client in errors); the client's result, then the sink's."""
    ctx = mp.get_context("spawn")
    r_parent, r_child = ctx.Pipe()
    c_parent, c_child = ctx.Pipe()
    recv = ctx.Process(target=run_sink, args=(r_child, hosts[1][1], hosts[1][0], cfg), daemon=True)
    recv.start()
    try:
        if not r_parent.poll(60):
            raise RuntimeError("receiver did not start")
        port = r_parent.recv()
        if isinstance(port, dict):
            raise RuntimeError(f"receiver failed: {port.get('error')}")
        client = ctx.Process(
            target=target, args=(c_child, f"{hosts[1][1]}:{port}", hosts[0][0], cfg, *args), daemon=True
        )
        client.start()
        cres = child_result(c_parent, client, who, timeout)
        r_parent.send("stop")
        rres = child_result(r_parent, recv, "receiver", 30)
        client.join(10)
    finally:
        recv.join(5)
        if recv.is_alive():
            recv.kill()
    return cres, rres


def _run_pair(cfg: TransportConfig, seconds: float, hosts: list[tuple[str | None, str]]) -> dict[str, Any]:
    sres, rres = beside_sink(cfg, hosts, _sender, (seconds,), "sender", seconds + 120)
    if rres["bytes"] != sres["bytes"]:
        raise RuntimeError(f"receiver counted {rres['bytes']} bytes, sender sent {sres['bytes']}")
    return {
        "goodput_MBps": round(sres["bytes"] / sres["seconds"] / 1e6, 1),
        "receiver_MBps": round(rres["bytes"] / max(rres["span_s"], 1e-9) / 1e6, 1),
        "bytes": sres["bytes"],
        "seconds": round(sres["seconds"], 3),
        "frames": rres["frames"],
        "handshakes": rres["handshakes"],
        "chunk_bytes": sres["chunk_bytes"],
        "streams_per_link": cfg.streams_per_link,
        "probe_goodput_MBps": round(sres["probe_goodput_MBps"], 1),
        "rtt_ms": round(sres["rtt_ms"], 3),
        "netns": hosts[0][0] is not None,
    }
