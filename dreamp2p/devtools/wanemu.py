"""The packet-level WAN emulator's process: builds ``wanemu.c`` with gcc at first use, runs it, reads its counters.

The forwarder joins network namespaces through TUN devices it creates (one per namespace, removed when it
exits) and applies the :mod:`dreamp2p.devtools.wanmodel` path model to every packet of every direction. This
module only compiles, starts, queries and stops it; the namespaces themselves are `dreamp2p.devtools.netns`'s.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dreamp2p.devtools.wanmodel import WanPath

log = logging.getLogger(__name__)

SOURCE = Path(__file__).resolve().with_name("wanemu.c")
# the repository's ignored build folder when this is a checkout, else a folder of this user's under /tmp
# 250 µs late at most: a third of the forwarder's CPU at 100 Mbit/s (fewer timer wakeups), < 1% of a WAN RTT
DEFAULT_SLACK_S = 0.00025
_REPO_BUILD = Path(__file__).resolve().parents[2] / "build" / "wanemu"


def _cache_dirs() -> list[Path]:
    return [_REPO_BUILD, Path(tempfile.gettempdir()) / f"dreamp2p-wanemu-{os.getuid()}"]


def binary() -> Path:
    """The forwarder's executable for the current source, compiled with gcc (``$CC``) the first time."""
    source = SOURCE.read_bytes()
    tag = hashlib.sha256(source).hexdigest()[:16]
    for folder in _cache_dirs():
        exe = folder / f"wanemu-{tag}"
        if exe.exists():
            return exe
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        raise RuntimeError("the WAN emulator needs a C compiler (gcc) to build dreamp2p/devtools/wanemu.c")
    errors = []
    for folder in _cache_dirs():
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            errors.append(f"{folder}: {exc}")
            continue
        exe = folder / f"wanemu-{tag}"
        tmp = folder / f".wanemu-{tag}.{os.getpid()}"
        res = subprocess.run(
            [cc, "-O2", "-Wall", "-Wextra", "-o", str(tmp), str(SOURCE), "-lm"],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        if res.returncode != 0:
            raise RuntimeError(f"compiling {SOURCE} failed:\n{res.stderr.strip()}")
        os.replace(tmp, exe)  # atomic: a concurrent build of the same source writes the same file
        log.info("built the WAN emulator: %s", exe)
        return exe
    raise RuntimeError(f"no writable folder for the WAN emulator's build: {'; '.join(errors)}")


def model_args(path: WanPath) -> list[str]:
    """The forwarder's model options for ``path`` (the queue resolved, so both sides use the same number)."""
    return [
        "--rate",
        repr(path.rate_bps),
        "--delay",
        repr(path.delay_s),
        "--jitter",
        repr(path.jitter_s),
        "--loss",
        repr(path.loss),
        "--burst",
        repr(path.loss_burst),
        "--queue",
        str(path.queue_limit),
        "--reorder",
        str(int(path.reorder)),
        "--seed",
        str(path.seed),
    ]


def simulate_native(path: WanPath, packets: Sequence[tuple[float, int]]) -> list[tuple[int, float]]:
    """Run the C model over (arrival, size) packets: (fate, departure) per packet, as `wanmodel.simulate`."""
    trace = "".join(f"{t!r} {size}\n" for t, size in packets)
    out = subprocess.run(
        [str(binary()), *model_args(path), "--simulate"],
        input=trace,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    return [(int(f), float(d)) for f, d in (line.split() for line in out.splitlines())]


class WanEmulator:
    """The forwarder joining ``ports`` (namespace, TUN device name, IPv4 address), every direction ``path``.

    Start it (context manager or :meth:`start`) before giving the devices addresses: they exist once it has
    started. Stopping it removes them. :meth:`stats` reads its counters without stopping it. ``slack_s``: how
    late it may wake for a departure, sending every packet due by then at once (each at most that late).
    """

    def __init__(self, ports: Sequence[tuple[str, str, str]], path: WanPath, slack_s: float = DEFAULT_SLACK_S) -> None:
        if len(ports) < 2:
            raise ValueError(f"WanEmulator needs at least 2 ports, got {len(ports)}")
        self.ports = list(ports)
        self.path = path
        self.slack_s = slack_s
        if not 0.0 <= self.slack_s <= 0.01:
            raise ValueError(f"WanEmulator.slack_s must be in [0, 0.01] seconds, got {self.slack_s}")
        self.proc: subprocess.Popen[str] | None = None
        self.final: dict[str, Any] | None = None

    def __enter__(self) -> WanEmulator:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        args = [str(binary()), *model_args(self.path), "--slack", repr(self.slack_s)]
        for ns, dev, ip in self.ports:
            args += ["--port", f"{ns},{dev},{ip}"]
        self.proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().strip()
        if line != "ready":
            self.proc.wait(10)
            err = self.proc.stderr.read().strip() if self.proc.stderr else ""
            self.proc = None
            raise RuntimeError(f"the WAN emulator did not start: {err or line or 'no output'}")
        log.info("WAN emulator pid %d: %s across %d ports", self.proc.pid, self.path, len(self.ports))

    def stats(self) -> dict[str, Any]:
        """Counters per directed path (src, dst: port indices), the forwarder's CPU seconds (``cpu_s``)."""
        if self.proc is None:
            if self.final is None:
                raise RuntimeError("the WAN emulator is not running")
            return self.final
        assert self.proc.stdout is not None
        self.proc.send_signal(signal.SIGUSR1)
        return dict(json.loads(self.proc.stdout.readline()))

    def stop(self) -> dict[str, Any] | None:
        """Stop the forwarder (its devices go with it); its last counters, or None if it was not running."""
        proc, self.proc = self.proc, None
        if proc is None:
            return self.final
        assert proc.stdout is not None
        proc.send_signal(signal.SIGTERM)
        try:
            out, err = proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate(timeout=10)
        lines = out.strip().splitlines()
        if proc.returncode != 0 or not lines:
            log.warning("WAN emulator exited %s: %s", proc.returncode, err.strip())
            return None
        self.final = dict(json.loads(lines[-1]))
        return self.final


def summary(stats: dict[str, Any]) -> dict[str, Any]:
    """The forwarder's totals: packets and MB in/out, drops, losses, CPU seconds and ms of CPU per MB."""
    paths = stats["paths"]
    total = {k: sum(int(p[k]) for p in paths) for k in ("in_pkts", "in_bytes", "queue_drops", "lost", "out_pkts")}
    mb = total["in_bytes"] / 1e6
    return {
        "packets": total["in_pkts"],
        "MB": round(mb, 3),
        "queue_drops": total["queue_drops"],
        "lost": total["lost"],
        "delivered": total["out_pkts"],
        "cpu_s": round(float(stats["cpu_s"]), 3),
        "user_s": round(float(stats["user_s"]), 3),
        "sys_s": round(float(stats["sys_s"]), 3),  # with the receiving stack's work: a TUN write runs it
        "wakeups": int(stats["wakeups"]),
        "cpu_ms_per_MB": round(float(stats["cpu_s"]) * 1e3 / mb, 2) if mb > 0 else None,
    }
