"""`dreamp2p bench transport`: goodput of the real data path between two peer processes.

Two peers run back-to-back fp32 ring all-reduces of one buffer, so every round moves the buffer once
over the link in each direction through the full path (framing, checksums, validation, reduction).
``goodput_MBps`` is payload bytes one peer sent per second. With ``netns``, the peers run in two
network namespaces joined by a veth pair shaped with tbf (deploy/netns-wan.sh), and ``link_util`` is
goodput over the shaped rate.
"""

from __future__ import annotations

import contextlib
import logging
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from dreamp2p.config import parse_rate
from dreamp2p.launch import run_local

log = logging.getLogger(__name__)

SCRIPT = Path(__file__).resolve().parents[2] / "deploy" / "netns-wan.sh"


@contextlib.contextmanager
def wan_namespaces(rate: str, prefix: str = "dp2pbench") -> Iterator[list[tuple[str | None, str]]]:
    """Create the two shaped namespaces for the duration of the block; always removes them."""
    if not SCRIPT.exists():
        raise FileNotFoundError(f"{SCRIPT} not found: --netns needs a source checkout")
    try:
        out = subprocess.run(
            ["bash", str(SCRIPT), "up", "--prefix", prefix, "--rate", rate],
            check=True, capture_output=True, text=True, timeout=60,
        ).stdout.split()
        yield [(out[0], out[1]), (out[2], out[3])]
    except subprocess.CalledProcessError as exc:
        raise RuntimeError(f"netns-wan.sh up failed: {exc.stderr.strip()}") from None
    finally:
        subprocess.run(["bash", str(SCRIPT), "down", "--prefix", prefix], capture_output=True, timeout=60)


def bench_transport(
    mbytes: float = 64.0,
    seconds: float = 6.0,
    streams: int = 2,
    netns: bool = False,
    rate: str = "100mbit",
) -> dict[str, Any]:
    config = {"transport": {"streams_per_link": streams, "probe_interval_s": 30.0}}
    args = {"mbytes": mbytes, "seconds": seconds}
    if netns:
        with wan_namespaces(rate) as hosts:
            results = run_local(2, "dreamp2p.bench.jobs:stream_timing", args, config, hosts=hosts)
    else:
        results = run_local(2, "dreamp2p.bench.jobs:stream_timing", args, config)
    per_peer = [r["bytes_sent"] / r["seconds"] / 1e6 for r in results]
    out: dict[str, Any] = {
        "goodput_MBps": round(min(per_peer), 1),
        "per_peer_MBps": [round(x, 1) for x in per_peer],
        "duplex": True,
        "buffer_MB": mbytes,
        "rounds": results[0]["rounds"],
        "streams_per_link": streams,
        "links": [r["links"] for r in results],
        "netns": netns,
    }
    if netns:
        rate_MBps = parse_rate(rate) / 1e6
        out["rate"] = rate
        out["link_util"] = round(min(per_peer) / rate_MBps, 3)
    return out
