"""systemd integration: the notify protocol on real unix datagram sockets, the daemon's READY/WATCHDOG/
STOPPING messages, and the shipped unit file passing ``systemd-analyze verify``."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from dreamp2p.devtools.localrun import child_env, python_command, write_configs
from dreamp2p.service.sdnotify import Notifier, socket_address, watchdog_interval

UNIT = Path(__file__).resolve().parents[2] / "deploy" / "systemd" / "dreamp2p-node.service"
TASK = {"batch": 4, "context": 32, "dim": 32, "layers": 1, "heads": 2, "eval_every": 50, "max_corpus_bytes": 1 << 18}
SYNC = {"strategy": "dreamddp", "period": 4, "warmup_steps": 2, "control_every": 5, "max_delay": 1}


@pytest.fixture
def listener(tmp_path: Path) -> Iterator[socket.socket]:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(tmp_path / "notify.sock"))
    sock.settimeout(10)
    yield sock
    sock.close()


def drain(sock: socket.socket) -> list[str]:
    """Every message waiting on ``sock`` (nonblocking)."""
    sock.setblocking(False)
    out = []
    while True:
        try:
            out.append(sock.recv(4096).decode())
        except BlockingIOError:
            return out


@pytest.mark.parametrize(
    ("value", "want"),
    [("", None), ("/run/systemd/notify", "/run/systemd/notify"), ("@sd", b"\0sd"), ("vsock:2:9", None)],
)
def test_socket_address(value: str, want: str | bytes | None) -> None:
    assert socket_address(value) == want


@pytest.mark.parametrize(
    ("env", "want"),
    [
        ({}, None),
        ({"WATCHDOG_USEC": "0"}, None),
        ({"WATCHDOG_USEC": "x"}, None),
        ({"WATCHDOG_USEC": "4000000"}, 2.0),
        ({"WATCHDOG_USEC": "4000000", "WATCHDOG_PID": "7"}, 2.0),
        ({"WATCHDOG_USEC": "4000000", "WATCHDOG_PID": "8"}, None),  # meant for another process
    ],
)
def test_watchdog_interval(env: dict[str, str], want: float | None) -> None:
    assert watchdog_interval(env, 7) == want


def test_without_notify_socket_nothing_is_sent() -> None:
    n = Notifier(env={"WATCHDOG_USEC": "1000"})
    assert not n.enabled
    assert (n.ready(), n.watchdog(), n.stopping()) == (False, False, False)


def test_messages_arrive_and_pings_are_rate_limited(listener: socket.socket) -> None:
    now = [100.0]
    n = Notifier(env={"NOTIFY_SOCKET": listener.getsockname(), "WATCHDOG_USEC": "2000000"}, clock=lambda: now[0])
    assert n.ready("training from step 0")
    assert listener.recv(4096) == b"READY=1\nSTATUS=training from step 0"
    sent = []
    for _ in range(10):  # 10 steps 0.25 s apart, pings at most every 1 s (half of WATCHDOG_USEC)
        sent.append(n.watchdog())
        now[0] += 0.25
    assert sent == [True, False, False, False] * 2 + [True, False]
    assert drain(listener) == ["WATCHDOG=1"] * 3
    assert n.stopping()
    assert drain(listener) == ["STOPPING=1"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="abstract unix sockets are Linux-only")
def test_abstract_namespace_socket() -> None:
    name = f"dreamp2p-test-{os.getpid()}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(b"\0" + name.encode())
        sock.settimeout(10)
        assert Notifier(env={"NOTIFY_SOCKET": f"@{name}"}).ready()
        assert sock.recv(4096) == b"READY=1"


def test_a_missing_socket_is_logged_not_raised(tmp_path: Path) -> None:
    assert not Notifier(env={"NOTIFY_SOCKET": str(tmp_path / "gone.sock")}).ready()


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_daemon_notifies_ready_watchdog_and_stopping(tmp_path: Path, listener: socket.socket) -> None:
    steps = 12
    (config,) = write_configs(
        tmp_path, 1, rate_Bps=None, delay_s=0.0, sync=SYNC, task={**TASK, "steps": steps}, metrics=False
    )
    # a 2 µs watchdog: every step pings (the interval is half of it)
    env = {**child_env(), "NOTIFY_SOCKET": listener.getsockname(), "WATCHDOG_USEC": "2"}
    env.pop("WATCHDOG_PID", None)
    received: list[str] = []
    listener.settimeout(0.2)
    stop = threading.Event()

    def read() -> None:  # read as systemd does: a datagram queue holds only a few unread messages
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                received.append(listener.recv(4096).decode())

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        out = subprocess.run(
            python_command("-m", "dreamp2p.cli", "node", "--config", str(config)),
            capture_output=True,
            text=True,
            timeout=400,
            env=env,
            check=False,
        )
    finally:
        stop.set()
        reader.join(10)
    assert out.returncode == 0, out.stderr[-4000:]
    messages = [m.split("\n")[0] for m in [*received, *drain(listener)]]
    assert messages[0] == "READY=1", messages
    assert messages[1:-1] == ["WATCHDOG=1"] * steps
    assert messages[-1] == "STOPPING=1"


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
def test_unit_file_passes_systemd_analyze_verify(tmp_path: Path) -> None:
    # verify wants ExecStart's binary to exist: point it at this venv's console script
    binary = Path(sys.executable).with_name("dreamp2p")
    text = UNIT.read_text()
    assert "ExecStart=/opt/dreamp2p/venv/bin/dreamp2p node --config /etc/dreamp2p/node.toml" in text
    assert "Type=notify" in text and "WatchdogSec=" in text
    unit = tmp_path / UNIT.name
    unit.write_text(text.replace("/opt/dreamp2p/venv/bin/dreamp2p", str(binary)))
    out = subprocess.run(
        ["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, timeout=120, check=False
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert UNIT.name not in out.stderr, out.stderr  # no warnings about our unit either


def test_a_full_queue_never_blocks_the_sender(listener: socket.socket) -> None:
    n = Notifier(env={"NOTIFY_SOCKET": listener.getsockname()})
    sent = [n.send("WATCHDOG=1") for _ in range(2000)]  # nobody reads: the queue fills, sends fail at once
    assert sent[0] and not sent[-1]
