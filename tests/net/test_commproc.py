"""Nodes whose peer runs in a comm process of its own (``comm = "process"``), on loopback.

Each Node here is a trainer on a thread of the test process with a real child process for its peer:
training with a strategy that fills its buffers in ``prepare`` (DreamDDP) and a baseline, rings that mix
thread and process nodes, a joiner taking state from process-mode donors, a killed comm process, close().
"""

from __future__ import annotations

import concurrent.futures
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
from torch import nn

from dreamp2p.config import PeerConfig, PeerInfo
from dreamp2p.devtools.localrun import free_ports
from dreamp2p.manifest import param_digest
from dreamp2p.messages import TrainingInfo
from dreamp2p.node import Node
from dreamp2p.sync.comm.process import CommProcess
from dreamp2p.sync.comm.wire import CommProcessError
from dreamp2p.sync.model.layers import FlatGroup
from dreamp2p.sync.strategies.base import Strategy

SYNC: dict[str, Any] = {"period": 4, "warmup_steps": 2, "control_every": 4}


def model(seed: int) -> nn.Module:
    torch.manual_seed(seed)  # every replica starts different: attach() must broadcast rank 0's parameters
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))


def train_steps(s: Strategy, m: nn.Module, rank: int, until: Callable[[], bool]) -> None:
    while not until():
        g = torch.Generator().manual_seed(1000 * rank + s.step_count)
        x = torch.randn(16, 8, generator=g)
        nn.functional.mse_loss(m(x), x[:, :2]).backward()
        s.step()
        s.zero_grad()


def ring_of(modes: Sequence[str]) -> tuple[list[PeerConfig], list[PeerInfo]]:
    ports = free_ports(len(modes))
    ring = [PeerInfo(f"n{i}", f"127.0.0.1:{p}") for i, p in enumerate(ports)]
    configs = [
        PeerConfig(node_id=f"n{i}", listen=f"127.0.0.1:{p}", ring=tuple(ring), comm=mode)
        for i, (p, mode) in enumerate(zip(ports, modes, strict=True))
    ]
    return configs, ring


def on_threads(fn: Callable[[int], Any], n: int) -> list[Any]:
    with concurrent.futures.ThreadPoolExecutor(n) as ex:
        return list(ex.map(fn, range(n)))


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie left to a parent that does not reap it counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    ("strategy", "modes"),
    [
        ("dreamddp", ("process", "process", "process")),
        ("diloco", ("process", "process", "process")),
        ("dreamddp", ("thread", "process", "thread")),
    ],
)
def test_nodes_train_and_end_identical(strategy: str, modes: tuple[str, ...]) -> None:
    configs, ring = ring_of(modes)
    nodes = [Node(c) for c in configs]
    pids = [n.comm.pid for n in nodes if isinstance(n.comm, CommProcess)]
    assert len(pids) == modes.count("process")
    try:
        on_threads(lambda i: nodes[i].connect(ring), 3)
        models = [model(i) for i in range(3)]

        def run(i: int) -> tuple[str, str, int, int]:
            opt = torch.optim.SGD(models[i].parameters(), lr=0.05)
            s = nodes[i].attach(models[i], opt, strategy=strategy, **SYNC)
            start = param_digest(models[i])
            train_steps(s, models[i], i, lambda: s.step_count >= 20)
            s.flush()
            return start, param_digest(models[i]), s.rounds_skipped, s.totals.bytes_sent

        results = on_threads(run, 3)
    finally:
        for n in nodes:
            n.close()
    assert len({r[0] for r in results}) == 1  # the broadcast went through every comm path
    assert len({r[1] for r in results}) == 1  # bit-identical after flush()
    assert results[0][1] != results[0][0]  # and they trained
    for _, _, skipped, sent in results:
        assert skipped == 0 and sent > 0
    # close() left no comm process behind
    assert not [p for p in pids if alive(p)]


@pytest.mark.timeout(240)
def test_joiner_takes_state_from_process_mode_donors() -> None:
    configs, ring = ring_of(("process", "process", "process"))
    members = [Node(c) for c in configs[:2]]
    joiner: Node | None = None
    final: list[int] = []
    joined = threading.Event()
    models = [model(i) for i in range(3)]
    sync: dict[str, Any] = {"strategy": "diloco", **SYNC}
    try:
        on_threads(lambda i: members[i].connect(ring, require_all=False), 2)

        def finish(s: Strategy, i: int) -> str:
            """Train to ``final``, then a full period without local progress: only averaging moves them."""
            train_steps(s, models[i], i, lambda: s.step_count >= final[0])
            for group in s.optimizer.param_groups:
                group["lr"] = 0.0
            train_steps(s, models[i], i, lambda: s.step_count >= final[0] + SYNC["period"] + 2)
            s.close()
            return param_digest(models[i])

        def member(i: int) -> str:
            s = members[i].attach(models[i], torch.optim.SGD(models[i].parameters(), lr=0.05), **sync)
            train_steps(s, models[i], i, joined.is_set)
            return finish(s, i)

        def join() -> str:
            nonlocal joiner
            joiner = Node(configs[2], joining=True)
            joiner.connect(ring, require_all=False)
            s = joiner.attach(models[2], torch.optim.SGD(models[2].parameters(), lr=0.05), join=True, **sync)
            final.append(s.step_count + 12)
            joined.set()
            return finish(s, 2)

        with concurrent.futures.ThreadPoolExecutor(3) as ex:
            futs = [ex.submit(member, 0), ex.submit(member, 1), ex.submit(join)]
            digests = [f.result() for f in futs]
        assert joined.is_set()
        assert len(set(digests)) == 1
        donors = [n.donor for n in members]
        assert sum(d.publications for d in donors) >= 1  # the state came through a process-mode donor
    finally:
        for n in [*members, joiner]:
            if n is not None:
                n.close()


@pytest.mark.timeout(180)
def test_a_killed_comm_process_fails_the_round_and_every_later_call() -> None:
    configs, ring = ring_of(("process", "process"))
    nodes = [Node(c) for c in configs]
    try:
        on_threads(lambda i: nodes[i].connect(ring), 2)
        comm = nodes[0].comm
        assert isinstance(comm, CommProcess)
        group = FlatGroup([torch.ones(32)])
        group.snapshot()
        # only n0 starts this round, so it waits on n1 until the comm process dies under it
        fut = comm.allreduce_group(group, 77, "fp32", round_id=5)
        os.kill(comm.pid, signal.SIGKILL)
        with pytest.raises(CommProcessError, match=rf"comm process \(pid {comm.pid}\) of n0 exited \(code -9\)"):
            fut.result(timeout=120)
        with pytest.raises(CommProcessError, match="exited"):
            comm.status()
        with pytest.raises(CommProcessError, match="exited"):
            comm.allreduce_group(group, 78, "fp32", round_id=6).result(timeout=120)
        with pytest.raises(CommProcessError, match="exited"):
            comm.set_training_info(TrainingInfo("ssgd", 1))  # the training thread learns at its next step
    finally:
        for n in nodes:
            n.close()
    assert not [n for n in nodes if isinstance(n.comm, CommProcess) and alive(n.comm.pid)]


@pytest.mark.timeout(120)
def test_the_comm_process_ignores_sigterm_and_sigint() -> None:
    """A signal to the whole process group (systemd, Ctrl-C) leaves the trainer to decide when its peer stops."""
    (config,), _ = ring_of(("process",))
    node = Node(config)
    try:
        comm = node.comm
        assert isinstance(comm, CommProcess)
        os.kill(comm.pid, signal.SIGTERM)
        os.kill(comm.pid, signal.SIGINT)
        assert comm.status().node_id == "n0"  # answered after both signals arrived
        assert alive(comm.pid)
    finally:
        node.close()
    assert not alive(comm.pid)


def test_a_shared_buffer_is_the_same_memory_on_both_ends() -> None:
    """share_memory_() in place keeps the strategy's views valid; the child's tensor writes into them."""
    from dreamp2p.sync.comm.child import _receive_buffer
    from dreamp2p.sync.comm.wire import ShareBuffer

    base = torch.arange(10, dtype=torch.float32)
    buf = base[2:8]  # a view, as a strategy might hold into a buffer
    before = buf.view(2, 3)
    buf.share_memory_()
    fd, size = buf.untyped_storage()._share_fd_cpu_()
    a, b = socket.socketpair()
    try:
        socket.send_fds(a, [b"F"], [fd])
        theirs = _receive_buffer(b, ShareBuffer(1, int(size), int(buf.storage_offset()), buf.numel()))
    finally:
        a.close()
        b.close()
    assert theirs.tolist() == [2.0, 3.0, 4.0, 5.0, 6.0, 7.0]
    theirs.mul_(-1)
    assert before.flatten().tolist() == [-2.0, -3.0, -4.0, -5.0, -6.0, -7.0]
    assert base[:2].tolist() == [0.0, 1.0] and base[8:].tolist() == [8.0, 9.0]


@pytest.mark.timeout(120)
def test_the_comm_process_leaves_when_its_trainer_is_killed() -> None:
    """No orphan: a trainer killed with SIGKILL closes its end of the socket, and the comm process exits."""
    script = (
        "import sys, time\n"
        "from dreamp2p.config import PeerConfig\n"
        "from dreamp2p.node import Node\n"
        "node = Node(PeerConfig(node_id='t0'), comm='process')\n"
        "print(node.comm.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    trainer = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE)
    try:
        assert trainer.stdout is not None
        child = int(trainer.stdout.readline())
        assert alive(child)
        trainer.kill()
        trainer.wait(30)
        while alive(child):  # a hang here is pytest-timeout's to report
            time.sleep(0.05)
    finally:
        if trainer.poll() is None:
            trainer.kill()
            trainer.wait(10)
