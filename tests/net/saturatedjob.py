"""The jobs of test_saturated_link.py, run in each member's own process by `dreamp2p.devtools.launch.run_local`:
one large all-reduce that fills a slow link for tens of seconds, while the member watches its view and
times echoes of its own to the other member (`saturate`), or during which one member is killed or frozen
and the other times how long it stays in its view (`fault`)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import xxhash

from dreamp2p.errors import PeerError, RoundFailed
from dreamp2p.peer import Peer

WATCH_S = 0.05  # how often the view is looked at
ECHO_EVERY_S = 0.5  # how often the job's own echo goes out (after the previous one came back)


async def saturate(peer: Peer, rank: int, world: int, floats: int, seed: int = 0) -> dict[str, Any]:
    """Average ``floats`` seeded fp32 values with the other member; what the view and the echoes did meanwhile.

    Returns the round's outcome (``ok``, ``seconds``, ``digest`` or ``error``), ``lost_at``: seconds into the
    round at which the other member was missing from our view (empty: never), ``view_changes`` and
    ``max_echo_s``: the slowest of our echoes that came back during the round.
    """
    other = next(p.node_id for p in peer.ring if p.node_id != peer.config.node_id)
    link = peer.link(other)
    t0 = time.monotonic()
    stop = asyncio.Event()
    lost: list[float] = []
    echoes: list[float] = []

    async def watch() -> None:
        while not stop.is_set():
            if other not in peer.view:
                lost.append(round(time.monotonic() - t0, 2))
            await asyncio.sleep(WATCH_S)

    async def time_echoes() -> None:
        while not stop.is_set():
            with contextlib.suppress(PeerError):  # a broken connection: the next echo goes on a new one
                echoes.append(await link.heartbeat(120.0))
            await asyncio.sleep(ECHO_EVERY_S)

    tasks = [asyncio.create_task(watch()), asyncio.create_task(time_echoes())]
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    x = [torch.randn(floats, generator=g)]
    try:
        res = await peer.allreduce(x, group_id=0, codec="fp32")
        outcome: dict[str, Any] = {
            "ok": True,
            "seconds": res.seconds,
            "digest": xxhash.xxh64(x[0].numpy().tobytes()).hexdigest(),
        }
    except RoundFailed as exc:
        outcome = {"ok": False, "error": str(exc), "seconds": time.monotonic() - t0}
    stop.set()
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    return {**outcome, "lost_at": lost[:10], "view_changes": peer.view_changes, "max_echo_s": max(echoes, default=0.0)}


async def _until(check: Callable[[], bool]) -> None:
    """Wait until ``check()`` holds (the test's pytest timeout guards against a hang)."""
    while True:
        if check():
            return
        await asyncio.sleep(0.01)


class _Drops(logging.Handler):
    """The heartbeat's messages that drop a member from the view."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if "re-forms without it" in message:
            self.messages.append(message)


def _read_mark(mark: Path) -> dict[str, Any] | None:
    text = mark.read_text() if mark.exists() else ""
    return json.loads(text) if text else None


async def fault(
    peer: Peer, rank: int, world: int, floats: int, fault: str, after_s: float, mark: str, out: str
) -> dict[str, Any]:
    """One large all-reduce, during which rank 1 is SIGKILLed or SIGSTOPped (``fault``: "kill" or "stop")
    ``after_s`` into it, by its own hand; rank 0 times how long the other member stays in its view after, and
    says why it left.

    Rank 1 writes its pid and the moment of the fault (CLOCK_MONOTONIC, one clock for every process) to
    ``mark`` first. Rank 0 writes ``{"dropped_after_s": ...}`` to ``out`` (a killed member never lets
    `run_local` return results), then SIGCONTs a stopped member, whose round then fails like ours.
    """
    g = torch.Generator().manual_seed(rank)
    round_ = asyncio.ensure_future(peer.allreduce([torch.randn(floats, generator=g)], group_id=0, codec="fp32"))
    if rank == 1:
        await asyncio.sleep(after_s)
        note = json.dumps({"pid": os.getpid(), "at": time.monotonic()})
        await asyncio.to_thread(Path(mark).write_text, note)
        os.kill(os.getpid(), signal.SIGKILL if fault == "kill" else signal.SIGSTOP)
    else:
        why = _Drops()  # the heartbeat's words on why the member left the view
        logging.getLogger("dreamp2p.peer.heartbeat").addHandler(why)
        faulted = None
        while faulted is None:
            faulted = await asyncio.to_thread(_read_mark, Path(mark))
            await asyncio.sleep(0.01)
        await _until(lambda: "p1" not in peer.view)
        dropped = json.dumps({"dropped_after_s": time.monotonic() - faulted["at"], "why": why.messages})
        await asyncio.to_thread(Path(out).write_text, dropped)
        if fault == "stop":
            os.kill(faulted["pid"], signal.SIGCONT)
    with contextlib.suppress(RoundFailed):  # it lost a member
        await round_
    return {}
