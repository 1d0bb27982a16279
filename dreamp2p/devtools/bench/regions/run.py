"""`bench regions`: WAN goodput of regions of many local ranks against regions of one, over tbf-shaped links.

Issue 11's claim is that a region of N ranks spreads its WAN traffic over N links (each local rank k
runs its own peer and ring with local rank k of the other regions: `dreamp2p.sync.comm.sharded`), so it moves
about N times the bytes per second of a one-rank region when every link has the same rate. This bench
measures that on one machine, as root.

Topology (`dreamp2p.devtools.bench.regions.net`): every local rank in a network namespace of its own; the
ranks of a region share an unshaped LAN (a bridge), over which their process group runs (gloo: DDP's
gradient all-reduce, the shard gathers, the rendezvous); shard k's WAN link joins local rank k of every
region (a veth pair for two regions, a bridge for more) and every direction of it is shaped by ``tc tbf``
to ``rate``. The bench starts each rank itself, inside its namespace, with torchrun's variables (RANK,
WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT at local rank 0's LAN address, as torchrun's static
rendezvous): torchrun's agent and its workers must share one network namespace, and here each rank has
its own. The ranks are the same code a torchrun region runs (`dreamp2p.devtools.bench.regions.work`).

Two phases in one run, on the same namespaces: ``regions`` regions of one rank (each in its rank-0
namespace: one shard link each), then ``regions`` regions of ``ranks`` ranks. The workload is `bench lm`'s
byte-level GPT (AdamW, the standard library's source), each rank reading its own shard of the corpus;
the default strategy is ``ssgd``, which syncs the whole gradient every step, so the link never idles
for want of bytes and goodput measures what the region can push (DreamDDP sends what its plan needs per
period whatever the link, so its bytes per second say little about the link). The model is sized so a
step's sync takes seconds on one link while its compute takes a fraction of a second.

Reported per phase: per region, ``steps_per_s`` = timed steps / the slowest rank's loop time (step 0,
connections and chunk sizing, is not timed); ``goodput_MBps`` = the region's round payload
(``totals.bytes_sent``, summed over its ranks) / that time, and ``wire_goodput_MBps`` the same from its
ranks' WAN devices' transmit counters (frames, heartbeats and probes included); ``link_util`` = the mean
shard link's wire bytes per second / its rate; bytes per local rank (payload and wire); ``identical``:
whether every rank of every region holds the same parameter digest after ``quiet_steps`` steps at
learning rate 0 and ``sync.close()``. Then ``goodput_ratio`` = the many-rank regions' goodput / the
one-rank regions' (issue 11's target: >= 1.7 at 2 x 2, 20 Mbit/s per shard link), its wire twin, and
``bytes_per_rank_ratio`` = a many-rank region's payload per rank / a one-rank region's (about 1/ranks).

``fsdp``: the many-rank regions shard the model with FSDP2 (each transformer block a unit, then the whole;
`dreamp2p.service.region.fully_sharded`) instead of replicating it with DDP: each rank then holds and
averages only its own shards, so its WAN bytes are again about 1/ranks of a one-rank region's, with no
gather inside the region (issue 36).

``hosts``: every rank of a many-rank region is a host of its own, started as one would start it: a torchrun
agent per host (``--nnodes N --node-rank k``, static rendezvous at rank 0's LAN address), each rank local rank
0 of its host, its region's ring entry listing every rank's address (``ranks``): a region spanning hosts.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dreamp2p.config import parse_rate
from dreamp2p.config.sync import STRATEGIES, SyncConfig
from dreamp2p.devtools.bench.lm.work import count_params
from dreamp2p.devtools.bench.regions.net import LAN_DEV, WAN_DEV, RegionNet, lan_host, wan_host
from dreamp2p.devtools.localrun import child_env

log = logging.getLogger(__name__)

TARGET_RATIO = 1.7  # issue 11: region goodput >= 1.7x a one-rank region's at 2 x 2, 20 Mbit/s per link
PEER_PORT = {1: 29400, 0: 29500}  # the regions' WAN port: one-rank phase, many-rank phase (rank k: + k)
MASTER_PORT = 29600  # the region's rendezvous, on local rank 0's LAN address
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs)


def _r(x: float, nd: int = 4) -> float:
    return round(x, nd)


def quiet_default(strategy: str, sync: dict[str, Any]) -> int:
    """Steps at learning rate 0 that leave every replica equal: a period and its landing delay, plus one
    (S-SGD averages every step: two suffice)."""
    if strategy in ("ssgd", "none"):
        return 2
    cfg = SyncConfig.from_dict({"strategy": strategy, **sync})
    delay = cfg.max_delay if cfg.max_delay is not None else cfg.period - 1
    return cfg.period + delay + 1


# ---------------------------------------------------------------------------------------------- one phase


def _rank_env(region: int, rank: int, ranks: int) -> dict[str, str]:
    """A rank's environment: torchrun's variables in a region of many ranks, none in a region of one."""
    env = {k: v for k, v in child_env().items() if k not in TORCHRUN_VARS}
    env["OMP_NUM_THREADS"] = "1"
    if ranks > 1:
        env.update(
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(ranks),
            LOCAL_WORLD_SIZE=str(ranks),
            MASTER_ADDR=lan_host(region, 0),
            MASTER_PORT=str(MASTER_PORT),
            GLOO_SOCKET_IFNAME=LAN_DEV,  # gloo's own address: the LAN, not the host name's
        )
    return env


def _wait_all(
    procs: dict[tuple[int, int], subprocess.Popen[bytes]], logs: dict[tuple[int, int], Path], timeout: float
) -> None:
    """Wait for every rank; the first that fails (or the hang guard) stops the others and raises."""
    deadline = time.monotonic() + timeout
    try:
        while any(p.poll() is None for p in procs.values()):
            failed = [(key, p.returncode) for key, p in procs.items() if p.returncode not in (None, 0)]
            if failed:
                (r, k), code = failed[0]
                raise RuntimeError(f"region {r} rank {k} exited {code}:\n{logs[(r, k)].read_text()[-4000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"bench regions: ranks still running after {timeout:.0f} s (hang guard)")
            time.sleep(0.5)
        for (r, k), p in procs.items():
            if p.returncode != 0:
                raise RuntimeError(f"region {r} rank {k} exited {p.returncode}:\n{logs[(r, k)].read_text()[-4000:]}")
    finally:
        for p in procs.values():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


def _host_cmd(region: int, rank: int, ranks: int, path: Path) -> tuple[list[str], dict[str, str]]:
    """``hosts``: rank ``rank`` started as a host of its own would start it, by a torchrun agent of its own
    (``--nnodes ranks --node-rank rank``, one process, static rendezvous at rank 0's LAN address)."""
    env = {k: v for k, v in child_env().items() if k not in TORCHRUN_VARS}
    env.update(OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME=LAN_DEV)
    cmd = [sys.executable, "-P", "-m", "torch.distributed.run", "--nnodes", str(ranks), "--nproc-per-node", "1"]
    cmd += ["--node-rank", str(rank), "--master-addr", lan_host(region, 0), "--master-port", str(MASTER_PORT)]
    return [*cmd, "-m", "dreamp2p.devtools.bench.regions.work", str(path), str(region)], env


def run_phase(net: RegionNet, ranks: int, spec: dict[str, Any], folder: Path, timeout: float) -> list[dict[str, Any]]:
    """Every region with ``ranks`` local ranks, trained to the end; each rank's result."""
    folder.mkdir(parents=True)
    port = PEER_PORT[1] if ranks == 1 else PEER_PORT[0]
    hosts = bool(spec.get("hosts")) and ranks > 1
    ring: list[dict[str, Any]] = [{"node_id": f"r{r}", "address": f"{wan_host(r)}:{port}"} for r in range(net.regions)]
    if hosts:  # every rank is local rank 0 of a host of its own: listens on the port itself, named in ranks
        for entry in ring:
            entry["ranks"] = [entry["address"]] * ranks
    path = folder / "spec.json"
    path.write_text(json.dumps({**spec, "ring": ring, "out": str(folder), "wan_dev": WAN_DEV}))
    procs: dict[tuple[int, int], subprocess.Popen[bytes]] = {}
    logs: dict[tuple[int, int], Path] = {}
    try:
        for r in range(net.regions):
            for k in range(ranks):
                logs[(r, k)] = folder / f"{r}.{k}.log"
                if hosts:
                    cmd, env = _host_cmd(r, k, ranks, path)
                else:
                    cmd = [sys.executable, "-P", "-m", "dreamp2p.devtools.bench.regions.work", str(path), str(r)]
                    env = _rank_env(r, k, ranks)
                with logs[(r, k)].open("wb") as out:
                    procs[(r, k)] = subprocess.Popen(
                        ["ip", "netns", "exec", net.ns(r, k), *cmd],
                        env=env,
                        stdout=out,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,  # killed with its children (a torchrun agent's worker)
                    )
    except BaseException:
        for p in procs.values():
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
        raise
    _wait_all(procs, logs, timeout)
    return [json.loads((folder / f"{r}.{k}.json").read_text()) for r in range(net.regions) for k in range(ranks)]


def summarize_phase(results: list[dict[str, Any]], regions: int, ranks: int, rate_Bps: float) -> dict[str, Any]:
    """One phase's report (see the module docstring) from its ranks' results."""
    per_region = []
    for r in range(regions):
        rs = [x for x in results if x["region"] == r]
        wall = max(x["loop_s"] for x in rs)
        payload, wire = sum(x["payload_bytes"] for x in rs), sum(x["wire_bytes"] for x in rs)
        per_region.append(
            {
                "steps_per_s": _r(rs[0]["timed_steps"] / wall),
                "goodput_MBps": _r(payload / wall / 1e6),
                "wire_goodput_MBps": _r(wire / wall / 1e6),
                "loop_s": _r(wall, 3),
            }
        )
    return {
        "ranks": ranks,
        "steps_per_s": _r(_mean([x["steps_per_s"] for x in per_region])),
        "goodput_MBps": _r(_mean([x["goodput_MBps"] for x in per_region])),
        "wire_goodput_MBps": _r(_mean([x["wire_goodput_MBps"] for x in per_region])),
        "link_util": _r(_mean([x["wire_bytes"] / x["loop_s"] / rate_Bps for x in results]), 3),
        "per_region": per_region,
        "bytes_per_rank": {x["node_id"]: x["payload_bytes"] for x in results},
        "wire_bytes_per_rank": {x["node_id"]: x["wire_bytes"] for x in results},
        "bytes_sent_per_rank_run": {x["node_id"]: x["bytes_sent"] for x in results},
        "rounds_skipped": {x["node_id"]: x["rounds_skipped"] for x in results},
        "loss_first": _r(_mean([x["losses"][0] for x in results])),
        "loss_last": _r(_mean([x["losses"][-1] for x in results])),
        "identical": len({x["digest"] for x in results}) == 1,
    }


# ---------------------------------------------------------------------------------------------- entry point


def _check(regions: int, ranks: int, strategy: str, workload: dict[str, Any], steps: int) -> None:
    """bench_regions' settings: a ValueError before anything starts."""
    if os.geteuid() != 0:
        raise ValueError("bench regions needs root: every rank runs in a network namespace shaped by tc tbf")
    if regions < 2 or ranks < 2:
        raise ValueError(
            f"need >= 2 regions of >= 2 ranks (a one-rank baseline runs beside them), got {regions} x {ranks}"
        )
    if steps < 2:
        raise ValueError("steps must be >= 2 (step 0 is a warm-up, not timed)")
    if strategy not in STRATEGIES or strategy == "none":
        raise ValueError(f"strategy must be one of {', '.join(s for s in STRATEGIES if s != 'none')}, got {strategy!r}")
    if workload["width"] % workload["heads"]:
        raise ValueError(f"width ({workload['width']}) must be a multiple of heads ({workload['heads']})")
    if min(workload["batch"], workload["context"], workload["layers"]) < 1:
        raise ValueError("batch, context and layers must be >= 1")


def bench_regions(
    regions: int = 2,
    ranks: int = 2,
    rate: str = "20mbit",
    strategy: str = "ssgd",
    steps: int = 12,
    width: int = 256,
    layers: int = 4,
    heads: int = 4,
    context: int = 64,
    batch: int = 4,
    lr: float = 3e-4,
    rtt_ms: float = 0.0,
    quiet_steps: int | None = None,
    extra_sync: dict[str, Any] | None = None,
    fsdp: bool = False,
    hosts: bool = False,
) -> dict[str, Any]:
    """Regions of one rank, then of ``ranks`` ranks (``fsdp``, ``hosts``: see the module docstring), over the
    same shaped links; a JSON-serialisable report."""
    workload = {"width": width, "layers": layers, "heads": heads, "context": context, "batch": batch, "lr": lr}
    sync = dict(extra_sync or {})
    _check(regions, ranks, strategy, workload, steps)
    quiet = quiet_default(strategy, sync) if quiet_steps is None else quiet_steps
    rate_Bps = parse_rate(rate)
    params = count_params(width, layers, heads, context)
    spec = {
        **{"regions": regions, "strategy": strategy, "sync": sync},
        "workload": workload,
        "steps": steps,
        "quiet_steps": quiet,
        "transport": {"delay_s": rtt_ms / 2000.0},
        "fsdp": fsdp,
        "hosts": hosts,
    }
    # hang guard: two full-model syncs per step over one link, plus start-up and slack
    timeout = 600.0 + (steps + quiet) * (2.0 * 4 * params / rate_Bps + 2.0 * rtt_ms / 1000.0 + 10.0)
    t_start = time.perf_counter()
    with RegionNet(regions, ranks, rate) as net, tempfile.TemporaryDirectory(prefix="dreamp2p-regions-") as tmp:
        one = summarize_phase(run_phase(net, 1, spec, Path(tmp) / "one", timeout), regions, 1, rate_Bps)
        log.info("regions of one rank: %.3f MB/s per region, %.3f steps/s", one["goodput_MBps"], one["steps_per_s"])
        many = summarize_phase(run_phase(net, ranks, spec, Path(tmp) / "many", timeout), regions, ranks, rate_Bps)
        log.info(
            "regions of %d ranks: %.3f MB/s per region, %.3f steps/s", ranks, many["goodput_MBps"], many["steps_per_s"]
        )
    ratio = many["goodput_MBps"] / one["goodput_MBps"] if one["goodput_MBps"] > 0 else float("nan")
    one_bytes = _mean(list(one["bytes_per_rank"].values()))
    many_bytes = _mean(list(many["bytes_per_rank"].values()))
    return {
        "bench": "regions",
        "regions": regions,
        "ranks": ranks,
        "rate": rate,
        "rtt_ms": float(rtt_ms),
        "shaping": "tbf",
        "strategy": strategy,
        "region_model": "fsdp2" if fsdp else "ddp",  # how a region of many ranks holds its model
        "hosts": "a host per rank" if hosts else "one host per region",
        "extra_sync": sync,
        "steps": steps,
        "timed_steps": steps - 1,
        "quiet_steps": quiet,
        "params": params,
        "model": {"width": width, "layers": layers, "heads": heads, "context": context, "vocab": 256},
        "batch": batch,
        "lr": lr,
        "one_rank": one,
        "sharded": many,
        "goodput_ratio": _r(ratio, 3),
        "wire_goodput_ratio": _r(many["wire_goodput_MBps"] / one["wire_goodput_MBps"], 3)
        if one["wire_goodput_MBps"] > 0
        else None,
        "steps_per_s_ratio": _r(many["steps_per_s"] / one["steps_per_s"], 3),
        "bytes_per_rank_ratio": _r(many_bytes / one_bytes, 4) if one_bytes > 0 else None,
        "target_ratio": TARGET_RATIO,
        "meets_target": bool(ratio >= TARGET_RATIO),
        "identical": many["identical"] and one["identical"],
        "total_s": _r(time.perf_counter() - t_start, 1),
    }
