"""Start N peers as separate local processes, wire them into a ring on loopback, run a job on each.

Used by the benchmarks, the demo and the multi-process tests. Each child runs one event loop with
one :class:`~dreamp2p.peer.Peer`; the parent only passes ports, the ring and small result dicts over
multiprocessing pipes between its own children (never data from a network peer).
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import multiprocessing as mp
import multiprocessing.connection
import multiprocessing.context
import time
import traceback
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

from dreamp2p.config import PeerConfig, PeerInfo

log = logging.getLogger(__name__)

Job = Callable[..., Awaitable[Any]]


def resolve(spec: str) -> Job:
    """``"package.module:function"`` -> the function."""
    module, _, name = spec.partition(":")
    if not module or not name:
        raise ValueError(f"job must look like 'package.module:function', got {spec!r}")
    fn = getattr(importlib.import_module(module), name, None)
    if fn is None:
        raise ValueError(f"{module} has no attribute {name!r}")
    return fn


def node_config(rank: int, base: Mapping[str, Any] | None = None) -> PeerConfig:
    data = {"cluster_id": "local", "listen": "127.0.0.1:0", **(base or {}), "node_id": f"p{rank}"}
    per_rank = data.pop("per_rank", None)
    if per_rank:
        data.update(per_rank.get(rank, {}))
    return PeerConfig.from_dict(data)


def enter_netns(name: str) -> None:
    """Move this process into network namespace ``name`` (created by deploy/netns-wan.sh; needs root)."""
    import ctypes
    import os

    clone_newnet = 0x40000000
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/var/run/netns/{name}", os.O_RDONLY)
    try:
        if libc.setns(fd, clone_newnet) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns({name}): {os.strerror(err)}")
    finally:
        os.close(fd)


def _child(
    rank: int,
    conn: mp.connection.Connection,
    config: dict[str, Any],
    job: str,
    args: dict[str, Any],
    log_level: int,
    netns: str | None,
) -> None:
    if netns:
        enter_netns(netns)
    logging.basicConfig(level=log_level, format=f"%(asctime)s p{rank} %(name)s %(levelname)s %(message)s")
    import torch

    torch.set_num_threads(1)
    try:
        if config.pop("node_job", False):
            result = _child_node(rank, conn, config, job, args)
        else:
            result = asyncio.run(_child_main(rank, conn, config, job, args))
        conn.send(("ok", result))
    except BaseException as exc:  # report every failure to the parent, then exit non-zero
        # the last frames say where: a bare CancelledError or KeyError names nothing by itself
        where = "".join(traceback.format_exception(exc)[-8:]).rstrip()
        conn.send(("error", f"{type(exc).__name__}: {exc}\n{where}"))
        raise
    finally:
        conn.close()


def _child_node(
    rank: int, conn: mp.connection.Connection, config: dict[str, Any], job: str, args: dict[str, Any]
) -> Any:
    """Run a synchronous training job against a Node (peer on its comm thread)."""
    from dreamp2p.node import Node

    node = Node(node_config(rank, config))
    conn.send(("port", node.comm.port))
    ring = conn.recv()
    try:
        node.connect([PeerInfo(n, a) for n, a in ring])
        result = resolve(job)(node, rank, len(ring), **args)
        conn.send(("done", None))
        conn.recv()
        return result
    finally:
        node.close()


async def _child_main(
    rank: int, conn: mp.connection.Connection, config: dict[str, Any], job: str, args: dict[str, Any]
) -> Any:
    from dreamp2p.peer import Peer

    loop = asyncio.get_running_loop()
    peer = Peer(node_config(rank, config))
    port = await peer.start()
    conn.send(("port", port))
    ring = await loop.run_in_executor(None, conn.recv)
    try:
        await peer.connect([PeerInfo(n, a) for n, a in ring])
        result = await resolve(job)(peer, rank, len(ring), **args)
        conn.send(("done", None))
        # wait until every peer is done before closing: they may still be sending to us
        await loop.run_in_executor(None, conn.recv)
        return result
    finally:
        await peer.close()


# What a child process imports before its job: torch alone is ~2.5 s of CPU per fresh interpreter here (3.5 s
# on a busy host), paid once in the fork server instead of once per child. Not grpc: its core must not be
# initialized before a fork, so every child imports it (and everything network-facing) itself.
PRELOAD = ("torch", "numpy")


def child_context() -> multiprocessing.context.ForkServerContext:
    """The multiprocessing context every local peer process starts from: a fork server that has imported
    ``PRELOAD``, so a child forks from a clean single-threaded process with torch loaded (never from the
    caller, whose threads and sockets a plain fork would copy). Objects shared with children (values,
    barriers) come from this context too."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))
    return ctx


def start_child(
    target: Callable[..., None], args: tuple[Any, ...], pipe_at: int
) -> tuple[Any, mp.connection.Connection]:
    """Start a daemon process ``target(*args)`` (from :func:`child_context`) with the child's pipe end
    inserted at ``pipe_at``.

    Returns the process and our end of its pipe.
    """
    ctx = child_context()
    parent, child = ctx.Pipe()
    p = ctx.Process(target=target, args=(*args[:pipe_at], child, *args[pipe_at:]), daemon=True)
    p.start()
    child.close()  # the child holds its own copy
    return p, parent


def run_local(
    n: int,
    job: str,
    args: Mapping[str, Any] | None = None,
    config: Mapping[str, Any] | None = None,
    timeout: float = 600.0,
    log_level: int = logging.WARNING,
    hosts: list[tuple[str | None, str]] | None = None,
    node_job: bool = False,
) -> list[Any]:
    """Run ``job(peer, rank, world, **args)`` on ``n`` peer processes; return the results in rank order.

    With ``node_job`` the job is synchronous and gets a :class:`~dreamp2p.node.Node` instead of a Peer.

    ``hosts`` optionally gives each rank a (network namespace, IP address) to run in and listen on.
    Raises RuntimeError naming the rank and its error if any child fails or the deadline passes.
    """
    base = dict(config or {})
    if hosts is not None:
        # namespaces on this machine, joined by a private veth pair (deploy/netns-wan.sh): clear text is
        # allowed there unless the caller configures tls
        base.setdefault("allow_insecure", True)
    hosts = hosts or [(None, "127.0.0.1")] * n
    pipes = []
    procs = []
    for rank in range(n):
        netns, host = hosts[rank]
        cfg = {**base, "listen": f"{host}:0", "node_job": node_job}
        p, parent = start_child(_child, (rank, cfg, job, dict(args or {}), log_level, netns), pipe_at=1)
        pipes.append(parent)
        procs.append(p)
    deadline = time.monotonic() + timeout
    try:
        ports = [expect_message(pipes[r], "port", deadline, f"rank {r}") for r in range(n)]
        ring = [(f"p{r}", f"{hosts[r][1]}:{ports[r]}") for r in range(n)]
        for pipe in pipes:
            pipe.send(ring)
        for r in range(n):
            expect_message(pipes[r], "done", deadline, f"rank {r}")
        for pipe in pipes:
            pipe.send("close")
        results = [expect_message(pipes[r], "ok", deadline, f"rank {r}") for r in range(n)]
        for p in procs:
            p.join(max(1.0, deadline - time.monotonic()))
        return results
    finally:
        reap(procs, pipes)


def reap(procs: Sequence[Any], pipes: Sequence[mp.connection.Connection] = ()) -> None:
    """Kill the child processes still running (None: never started) and close their pipes."""
    for p in procs:
        if p is not None and p.is_alive():
            p.kill()
            p.join(5)
    for pipe in pipes:
        pipe.close()


def expect_message(pipe: mp.connection.Connection, kind: str, deadline: float, who: str) -> Any:
    """The next ``(kind, value)`` message of a child process; RuntimeError naming ``who`` otherwise."""
    left = deadline - time.monotonic()
    if left <= 0 or not pipe.poll(left):
        raise RuntimeError(f"{who}: no {kind!r} message before the deadline")
    try:
        got, value = pipe.recv()
    except EOFError:
        raise RuntimeError(f"{who}: process exited before sending {kind!r}") from None
    if got == "error":
        raise RuntimeError(f"{who} failed: {value}")
    if got != kind:
        raise RuntimeError(f"{who}: expected {kind!r}, got {got!r}")
    return value
