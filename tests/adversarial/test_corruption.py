"""Payload integrity on the wire (issue 5): bytes corrupted in flight are refused by the frame's checksum,
nothing of them is applied, and the round is retried and lands with exact results.

A TCP relay on loopback flips one byte in flight, between two real peers. A frame whose checksum field
itself is wrong, sent by hand, is one of test_bad_input.py's single calls (CHECKSUM_MISMATCH).
"""

from __future__ import annotations

import asyncio
import contextlib

import torch
from conftest import ring_configs

from dreamp2p.config import PeerInfo, TransportConfig
from dreamp2p.peer import Peer


class FlippingRelay:
    """Forwards TCP connections to ``target``; flips one byte at stream offset ``at`` of the first
    client-to-server stream that gets that far (once for the relay's whole life)."""

    def __init__(self, target_port: int, at: int) -> None:
        self.target_port = target_port
        self.at = at
        self.flipped = False
        self.port = 0
        self._server: asyncio.base_events.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def _serve(self, cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        sr, sw = await asyncio.open_connection("127.0.0.1", self.target_port)
        up = asyncio.ensure_future(self._pump(cr, sw, corrupt=True))
        down = asyncio.ensure_future(self._pump(sr, cw, corrupt=False))
        self._tasks.update((up, down))
        await asyncio.wait([up, down], return_when=asyncio.FIRST_COMPLETED)
        for t in (up, down):
            t.cancel()
        for w in (cw, sw):
            w.close()

    async def _pump(self, r: asyncio.StreamReader, w: asyncio.StreamWriter, corrupt: bool) -> None:
        seen = 0
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
            while data := await r.read(65536):
                if corrupt and not self.flipped and seen <= self.at < seen + len(data):
                    buf = bytearray(data)
                    buf[self.at - seen] ^= 0x40
                    data = bytes(buf)
                    self.flipped = True
                seen += len(data)
                w.write(data)
                await w.drain()

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for t in self._tasks:
            t.cancel()


async def test_corrupted_bytes_are_refused_and_the_round_is_retried() -> None:
    t = TransportConfig(heartbeat_s=0.2, round_timeout_s=20.0, round_retries=1, streams_per_link=1)
    p0, p1 = (Peer(c) for c in ring_configs(2, transport=t))
    for p in (p0, p1):
        await p.start()
    relay = FlippingRelay(p1.port, at=1_500_000)  # deep inside the first large reduce-scatter frame
    await relay.start()
    try:
        # p0 reaches p1 only through the relay; p1 reaches p0 directly
        await asyncio.gather(
            p0.connect([PeerInfo("p0", p0.address), PeerInfo("p1", f"127.0.0.1:{relay.port}")]),
            p1.connect([PeerInfo("p0", p0.address), PeerInfo("p1", p1.address)]),
        )
        data = [[torch.full((2_000_000,), float(r))] for r in range(2)]
        await asyncio.gather(*(p.allreduce(d, round_id=1) for p, d in zip((p0, p1), data, strict=True)))
        assert relay.flipped
        assert p1.frames_rejected >= 1  # refused by its checksum, not applied
        assert p0.rounds_retried == 1 and p1.rounds_retried == 1
        assert all(torch.all(d[0] == 0.5) for d in data)  # the retry landed exactly
    finally:
        await asyncio.gather(p0.close(), p1.close())
        await relay.close()
