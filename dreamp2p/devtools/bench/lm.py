"""`bench lm`: compare the sync strategies on a byte-level GPT trained across emulated WAN regions.

The workload: a nanoGPT-style byte transformer (`dreamp2p.service.tasks.ByteTransformer`; d_model ``width``,
``layers`` blocks, ``heads`` heads, context ``context``, vocabulary 256; the defaults give 3.3M parameters)
learns the Python standard library's source (`dreamp2p.service.tasks.stdlib_files`, concatenated in path order;
the last 5% of the bytes are held out). Region r samples ``batch`` windows per step from shard r (a
contiguous slice) of the training part, as a pure function of (rank, step). Inner optimizer: AdamW
(lr ``lr``, weight decay 0.1 on every parameter, betas (0.9, 0.95)). One process per region, each with
``torch.set_num_threads(1)``; the library is used only as a user would: ``node.attach(model, opt,
strategy=name, period=period, **extra_sync)`` then ``sync.step()`` / ``sync.zero_grad()`` in the loop.
``sync.flush()`` is never called: the held-out loss is that of each region's own model after the last
step, averaged over regions; ``identical_replicas`` (equal parameter digests then) is information only.

Regions and links. As root (and unless ``netns=False``) every region runs in its own network namespace
and each direction of its link is shaped by ``tc tbf`` to ``rate``: two regions are joined by one veth
pair (deploy/netns-wan.sh), three or more each by a veth to a bridge in a namespace of their own (a star:
every region has an access link of ``rate`` each way). Otherwise the transport's in-process token bucket
(``transport.rate_limit``) emulates the rate. ``rtt_ms`` is always the transport's in-process one-way
delay ``transport.delay_s = rtt / 2`` (this kernel has no netem).

The ceiling: ``regions`` plain processes started together (same model, data, AdamW loop; no dreamp2p,
no network) give the steps/s the hardware allows; ``compute_utilization`` = steps_per_s / that.

Measured per strategy (per region, then combined over regions):

- ``steps_per_s``: steps / wall time of the training loop (attach and the final landing excluded), mean
  over regions;
- ``hidden_fraction`` = 1 - sum(exposed_s) / sum(comm_s) and the mean ``exposed_s`` / ``comm_s`` per
  region, from the strategy's ``totals``;
- ``heldout_loss``: mean over regions of the cross-entropy (nats/byte) on ``eval_batches`` fixed batches
  of the held-out part (the same windows for every strategy and the ceiling);
- ``mb_sent``: MB (1e6 bytes) one region sent during the training loop, mean over regions. With tbf it is
  the region's veth transmit counter (``/proc/net/dev`` read inside its namespace at loop start and end:
  every frame, heartbeats and link probes included); in process it is the strategy's ``totals.bytes_sent``
  (round payload). With tbf, ``mb_sent_run`` adds the whole run as the parent saw the veth counters
  (``ip -s -j link``) before and after it: connect, attach's broadcast of rank 0's model, final landing;
- ``comm_cpu_s``: CPU time of everything but the training thread during the loop (comm thread, gRPC's
  threads): ``time.process_time()`` minus the training thread's ``time.thread_time()``; and
  ``comm_cpu_s_per_mb`` = total comm CPU / total ``mb_sent`` (null below 0.1 MB);
- ``time_to_target_s``: the first loop time (slowest region's clock) at which the region-mean held-out loss,
  evaluated every ``eval_every`` = ceil(steps / 10) steps, is <= ``target_loss`` (default: the final
  held-out loss of ``none``, or of the ceiling if ``none`` is not run, times 1.02). To keep evaluation out
  of the timing, the loop only copies the parameters at those steps (its clock paused meanwhile) and the
  copies are evaluated after the loop: evaluating in the loop would also give in-flight rounds free time;
- ``winner_steps_per_s``: the fastest strategy that synchronizes (``none`` only if it is the only one).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import multiprocessing as mp
import multiprocessing.connection
import os
import subprocess
import time
import tomllib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from dreamp2p.config import parse_rate
from dreamp2p.devtools.launch import expect_message, reap, run_local
from dreamp2p.manifest import param_digest
from dreamp2p.node import Node
from dreamp2p.service.tasks import ByteTransformer, stdlib_files
from dreamp2p.sync.config import STRATEGIES, SyncConfig
from dreamp2p.sync.dreamddp import DreamDDP, plan_summary

log = logging.getLogger(__name__)

JOB = "dreamp2p.devtools.bench.lm:lm_job"
SCRIPT = Path(__file__).resolve().parents[3] / "deploy" / "netns-wan.sh"
HELDOUT_FRACTION = 0.05
EVAL_POINTS = 10  # held-out evaluations per run (plus the final one)
TARGET_MARGIN = 1.02  # default target: reference final held-out loss times this
WEIGHT_DECAY = 0.1
BETAS = (0.9, 0.95)
SEED = 0
VOCAB = 256


# ---------------------------------------------------------------------------------------------- workload


def load_corpus() -> tuple[torch.Tensor, torch.Tensor]:
    """The standard library's source as bytes (uint8): (training part, held-out last 5%)."""
    chunks = []
    for path in stdlib_files():
        try:
            chunks.append(path.read_bytes())
        except OSError:
            continue
    data = torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8)
    cut = int(data.numel() * (1.0 - HELDOUT_FRACTION))
    return data[:cut], data[cut:]


def train_shard(train: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """Shard ``rank`` of ``world``: a contiguous slice of the training part."""
    size = train.numel() // world
    return train[rank * size : (rank + 1) * size]


def windows(data: torch.Tensor, starts: torch.Tensor, context: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and next-byte targets of the windows starting at ``starts``."""
    w = data[starts.unsqueeze(1) + torch.arange(context + 1)].long()
    return w[:, :-1].to(device), w[:, 1:].to(device)


def train_batch(
    shard: torch.Tensor, rank: int, step: int, batch: int, context: int, device: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Region ``rank``'s batch of ``step``: a pure function of (rank, step), the same in every run."""
    g = torch.Generator().manual_seed(SEED * 1_000_003 + rank * 7919 + step)
    starts = torch.randint(0, shard.numel() - context - 1, (batch,), generator=g)
    return windows(shard, starts, context, device)


def eval_set(
    heldout: torch.Tensor, eval_batches: int, batch: int, context: int, device: str
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The fixed held-out batches every strategy, region and the ceiling are evaluated on."""
    g = torch.Generator().manual_seed(SEED + 7)
    starts = torch.randint(0, heldout.numel() - context - 1, (eval_batches, batch), generator=g)
    return [windows(heldout, s, context, device) for s in starts]


def make_model(width: int, layers: int, heads: int, context: int, device: str) -> nn.Module:
    torch.manual_seed(SEED)
    return ByteTransformer(context, width, layers, heads).to(device)


def make_optimizer(model: nn.Module, lr: float) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=lr, betas=BETAS, weight_decay=WEIGHT_DECAY)


def count_params(width: int, layers: int, heads: int, context: int) -> int:
    return sum(p.numel() for p in ByteTransformer(context, width, layers, heads).parameters())


def lm_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1))


@torch.no_grad()
def heldout_loss(model: nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    was = model.training
    model.eval()
    loss = sum(float(lm_loss(model, x, y)) for x, y in batches) / len(batches)
    model.train(was)
    return loss if math.isfinite(loss) else float("inf")


def eval_every(steps: int) -> int:
    return max(1, math.ceil(steps / EVAL_POINTS))


def read_tx_bytes(dev: str) -> int:
    """Bytes ``dev`` transmitted, from /proc/net/dev (this process's network namespace)."""
    with open("/proc/net/dev") as fh:
        for line in fh:
            name, sep, rest = line.partition(":")
            if sep and name.strip() == dev:
                return int(rest.split()[8])
    raise RuntimeError(f"no device {dev!r} in /proc/net/dev of this network namespace")


def _sync_device(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


# ---------------------------------------------------------------------------------------------- one region


class _Workload:
    """Everything one region (or ceiling process) trains on, built identically in every process."""

    def __init__(self, rank: int, world: int, a: dict[str, Any]) -> None:
        torch.set_num_threads(1)
        self.rank = rank
        self.a = a
        train, heldout = load_corpus()
        self.shard = train_shard(train, rank, world)
        self.evals = eval_set(heldout, a["eval_batches"], a["batch"], a["context"], a["device"])
        self.model = make_model(a["width"], a["layers"], a["heads"], a["context"], a["device"])
        self.opt = make_optimizer(self.model, a["lr"])

    def loop(self, step: Callable[[], Any], zero_grad: Callable[[], Any], wire_dev: str | None) -> dict[str, Any]:
        """The timed training loop; parameter copies every ``eval_every`` steps (clock paused meanwhile)."""
        a, model = self.a, self.model
        steps, device, every = a["steps"], a["device"], eval_every(a["steps"])
        snaps: list[tuple[int, float, list[torch.Tensor]]] = []
        losses: list[float] = []
        clock = 0.0
        wire0 = read_tx_bytes(wire_dev) if wire_dev else 0
        cpu0, thread0 = time.process_time(), time.thread_time()
        t = time.perf_counter()
        for k in range(steps):
            x, y = train_batch(self.shard, self.rank, k, a["batch"], a["context"], device)
            loss = lm_loss(model, x, y)
            loss.backward()
            step()
            zero_grad()
            losses.append(loss.item())
            if (k + 1) % every == 0 and k + 1 < steps:
                _sync_device(device)
                clock += time.perf_counter() - t
                snaps.append((k + 1, clock, [p.detach().clone() for p in model.parameters()]))
                t = time.perf_counter()
        _sync_device(device)
        clock += time.perf_counter() - t
        comm_cpu = (time.process_time() - cpu0) - (time.thread_time() - thread0)
        wire = read_tx_bytes(wire_dev) - wire0 if wire_dev else None
        snaps.append((steps, clock, [p.detach().clone() for p in model.parameters()]))
        tail = losses[-10:]
        return {
            "wall_s": clock,
            "comm_cpu_s": max(0.0, comm_cpu),
            "wire_bytes": wire,
            "train_loss_last10": sum(tail) / len(tail) if tail else None,
            "snaps": snaps,
        }

    def evaluate(self, out: dict[str, Any]) -> dict[str, Any]:
        """Replace the parameter copies by their held-out losses: ``curve`` = [[step, loop time, loss], ...]."""
        curve = []
        params = list(self.model.parameters())
        with torch.no_grad():
            for step, clock, values in out.pop("snaps"):
                for p, v in zip(params, values, strict=True):
                    p.copy_(v)
                curve.append([step, clock, heldout_loss(self.model, self.evals)])
        out["curve"] = curve
        out["heldout_loss"] = curve[-1][2]
        return out


def lm_job(
    node: Node,
    rank: int,
    world: int,
    strategy: str,
    period: int,
    extra_sync: dict[str, Any],
    workload: dict[str, Any],
    wire_devs: list[str | None],
) -> dict[str, Any]:
    """One region (a peer process started by `dreamp2p.devtools.launch.run_local`)."""
    w = _Workload(rank, world, workload)
    sync = node.attach(w.model, w.opt, strategy=strategy, period=period, **extra_sync)
    out = w.loop(sync.step, sync.zero_grad, wire_devs[rank])
    tot = sync.totals
    out.update(
        exposed_s=tot.exposed_s,
        comm_s=tot.comm_s,
        compute_s=tot.compute_s,
        bytes_sent=tot.bytes_sent,
        digest=param_digest(w.model),  # before close(): rounds still in flight would change it
        rounds_skipped=sync.rounds_skipped,
        exposed_by_plan=_exposed_by_plan(tot.history),
    )
    if isinstance(sync, DreamDDP):  # its plans, for the report only
        out["plan_history"] = [list(h) for h in sync.plan_history]
        out["plan_summary"] = plan_summary(sync)
    sync.close()
    return w.evaluate(out)


def _exposed_by_plan(history: Sequence[Any]) -> dict[str, list[float]]:
    """Per plan version: [steps, exposed_s, comm_s] of one region (DreamDDP's warm-up plan v0 vs measured ones)."""
    out: dict[str, list[float]] = {}
    for s in history:
        row = out.setdefault(str(s.plan_version), [0, 0.0, 0.0])
        row[0] += 1
        row[1] += s.exposed_s
        row[2] += s.comm_s
    return out


def ceiling_child(
    rank: int, world: int, workload: dict[str, Any], barrier: Any, conn: mp.connection.Connection
) -> None:
    """One ceiling process: the same loop with a plain AdamW step, no dreamp2p, no network."""
    try:
        w = _Workload(rank, world, workload)
        barrier.wait(300)
        out = w.loop(w.opt.step, w.opt.zero_grad, None)
        conn.send(("ok", w.evaluate(out)))
    except BaseException as exc:  # report every failure to the parent
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        raise
    finally:
        conn.close()


def run_ceiling(n: int, workload: dict[str, Any], timeout: float) -> list[dict[str, Any]]:
    """``n`` concurrent plain training processes (started together); their results in rank order."""
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(n)
    pipes, procs = [], []
    for rank in range(n):
        parent, child = ctx.Pipe()
        p = ctx.Process(target=ceiling_child, args=(rank, n, workload, barrier, child), daemon=True)
        p.start()
        child.close()
        pipes.append(parent)
        procs.append(p)
    deadline = time.monotonic() + timeout
    try:
        results = [expect_message(pipes[r], "ok", deadline, f"ceiling rank {r}") for r in range(n)]
        for p in procs:
            p.join(max(1.0, deadline - time.monotonic()))
        return results
    finally:
        reap(procs, pipes)


# ---------------------------------------------------------------------------------------------- network


def _ip(*args: str) -> str:
    res = subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)
    return res.stdout


class Namespaces:
    """Network namespaces for the regions, each link direction shaped by tbf; use as a context manager.

    ``hosts``: (namespace, address) per rank for `run_local`; ``devs``: (namespace, device) per rank, the
    region's own end of its link (its transmit counter is what the region sent).
    """

    def __init__(self, n: int, rate: str) -> None:
        self.n = n
        self.bps = parse_rate(rate) * 8.0
        tag = os.getpid() % 100000
        self.prefix = f"dpm{tag}"
        self.subnet = f"10.204.{tag % 200 + 20}"
        self.hosts: list[tuple[str | None, str]] = []
        self.devs: list[tuple[str, str]] = []
        self._created: list[str] = []

    def __enter__(self) -> Namespaces:
        try:
            if self.n == 2:
                self._up_pair()
            else:
                self._up_star()
        except BaseException:
            self.down()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.down()

    def _up_pair(self) -> None:
        p, s = self.prefix, self.subnet
        self._created = [f"{p}-a", f"{p}-b"]
        subprocess.run(
            ["bash", str(SCRIPT), "up", "--prefix", p, "--rate", f"{int(self.bps)}bit", "--subnet", s],
            check=True,
            capture_output=True,
            text=True,
            timeout=60,
        )
        self.hosts = [(f"{p}-a", f"{s}.1"), (f"{p}-b", f"{s}.2")]
        self.devs = [(f"{p}-a", f"{p}-va"), (f"{p}-b", f"{p}-vb")]

    def _shape(self, ns: str, dev: str) -> None:
        # tbf's bucket must hold at least rate/HZ: 4 ms worth of bytes, never under 32 KiB (as netns-wan.sh)
        burst = max(32768, int(self.bps / 8 / 1000 * 4))
        rate = f"{int(self.bps)}bit"
        tbf = ["tbf", "rate", rate, "burst", str(burst), "latency", "100ms"]
        _ip("netns", "exec", ns, "tc", "qdisc", "replace", "dev", dev, "root", *tbf)

    def _up_star(self) -> None:
        p, s = self.prefix, self.subnet
        hub, bridge = f"{p}-x", f"{p}-br"
        _ip("netns", "add", hub)
        self._created.append(hub)
        _ip("-n", hub, "link", "add", bridge, "type", "bridge")
        _ip("-n", hub, "link", "set", bridge, "up")
        for i in range(self.n):
            ns, dev, far = f"{p}-r{i}", f"{p}-v{i}", f"{p}-p{i}"
            _ip("netns", "add", ns)
            self._created.append(ns)
            _ip("link", "add", dev, "type", "veth", "peer", "name", far)
            _ip("link", "set", dev, "netns", ns)
            _ip("link", "set", far, "netns", hub)
            _ip("-n", hub, "link", "set", far, "master", bridge)
            _ip("-n", hub, "link", "set", far, "up")
            _ip("-n", ns, "addr", "add", f"{s}.{i + 1}/24", "dev", dev)
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", ns, "link", "set", dev, "up")
            self._shape(ns, dev)  # region -> hub
            self._shape(hub, far)  # hub -> region
            self.hosts.append((ns, f"{s}.{i + 1}"))
            self.devs.append((ns, dev))

    def down(self) -> None:
        """Remove every namespace (and any veth left in this one) created here; never raises."""
        if self.n == 2:
            subprocess.run(
                ["bash", str(SCRIPT), "down", "--prefix", self.prefix], capture_output=True, timeout=60, check=False
            )
        for ns in self._created:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30, check=False)
        for i in range(self.n if self.n != 2 else 0):
            subprocess.run(["ip", "link", "del", f"{self.prefix}-v{i}"], capture_output=True, timeout=30, check=False)
        self._created = []

    def tx_bytes(self) -> list[int]:
        """Per rank: bytes its link end has transmitted so far (``ip -s -j link``)."""
        out = []
        for ns, dev in self.devs:
            info = json.loads(_ip("-n", ns, "-s", "-j", "link", "show", "dev", dev))
            out.append(int(info[0]["stats64"]["tx"]["bytes"]))
        return out


# ---------------------------------------------------------------------------------------------- report


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs)


def _r(x: float | None, nd: int = 4) -> float | None:
    return None if x is None or not math.isfinite(x) else round(x, nd)


def _region_curve(res: list[dict[str, Any]]) -> list[list[float]]:
    """[[step, slowest region's loop time, region-mean held-out loss], ...]."""
    return [
        [pts[0][0], max(p[1] for p in pts), _mean([p[2] for p in pts])]
        for pts in zip(*(r["curve"] for r in res), strict=True)
    ]


def _time_to(curve: list[list[float]], target: float) -> float | None:
    return next((t for _, t, loss in curve if loss <= target), None)


def _summarize(res: list[dict[str, Any]], steps: int, wire_run: list[int] | None) -> dict[str, Any]:
    sps = [steps / r["wall_s"] for r in res]
    comm, exposed = sum(r["comm_s"] for r in res), sum(r["exposed_s"] for r in res)
    wire = [r["wire_bytes"] if r["wire_bytes"] is not None else r["bytes_sent"] for r in res]
    mb = sum(wire) / 1e6
    cpu = sum(r["comm_cpu_s"] for r in res)
    row: dict[str, Any] = {
        "steps_per_s": _r(_mean(sps)),
        "steps_per_s_regions": [_r(x) for x in sps],
        "hidden_fraction": _r(max(0.0, 1.0 - exposed / comm) if comm > 0 else 1.0, 3),
        "exposed_s": _r(exposed / len(res), 3),
        "comm_s": _r(comm / len(res), 3),
        "heldout_loss": _r(_mean([r["heldout_loss"] for r in res])),
        "heldout_loss_regions": [_r(r["heldout_loss"]) for r in res],
        "train_loss_last10": _r(_mean([r["train_loss_last10"] for r in res])),
        "mb_sent": _r(mb / len(res), 3),
        "payload_mb_sent": _r(sum(r["bytes_sent"] for r in res) / 1e6 / len(res), 3),
        "comm_cpu_s": _r(cpu / len(res), 3),
        "comm_cpu_s_per_mb": _r(cpu / mb, 4) if mb >= 0.1 else None,
        "identical_replicas": len({r["digest"] for r in res}) == 1,
        "rounds_skipped": [r["rounds_skipped"] for r in res],
        "exposed_by_plan": {v: [n, _r(e, 3), _r(c, 3)] for v, (n, e, c) in res[0]["exposed_by_plan"].items()},
        "curve": [[s, _r(t, 3), _r(loss)] for s, t, loss in _region_curve(res)],
    }
    if wire_run is not None:
        row["mb_sent_run"] = _r(sum(wire_run) / 1e6 / len(res), 3)
    if "plan_history" in res[0]:
        row["plan_history"] = res[0]["plan_history"]
        row["plan"] = res[0]["plan_summary"]
    return row


# ---------------------------------------------------------------------------------------------- entry point


def parse_variant(entry: str) -> tuple[str, dict[str, Any]]:
    """``"dreamddp:error_feedback=true,delta_codec=e3m0"`` -> the strategy and its own SyncConfig overrides.

    Values are read as TOML (true, 3, 0.5, "int8"); a bare word that is not TOML is taken as a string.
    A plain strategy name has no overrides. Lets one run compare settings of a strategy side by side.
    """
    strategy, _, spec = entry.partition(":")
    own: dict[str, Any] = {}
    for item in filter(None, spec.split(",")):
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise ValueError(f"strategy variant {entry!r}: expected key=value, got {item!r}")
        try:
            own[key.strip()] = tomllib.loads(f"v = {value.strip()}")["v"]
        except tomllib.TOMLDecodeError:
            own[key.strip()] = value.strip()
    return strategy, own


def bench_lm(
    strategies: Sequence[str] | None = None,
    regions: int = 2,
    rate: str = "20mbit",
    rtt_ms: float = 0.0,
    steps: int = 200,
    period: int = 20,
    width: int = 256,
    layers: int = 4,
    heads: int = 4,
    context: int = 128,
    batch: int = 8,
    lr: float = 3e-4,
    eval_batches: int = 8,
    device: str = "cpu",
    netns: bool | None = None,
    extra_sync: dict[str, Any] | None = None,
    target_loss: float | None = None,
) -> dict[str, Any]:
    """Run the ceiling, then every strategy, on ``regions`` region processes; a JSON-serialisable report.

    ``netns``: None = namespaces with tbf when root, else in-process shaping; True = namespaces (needs root);
    False = in-process shaping. ``extra_sync``: SyncConfig overrides for every strategy (not ``strategy`` or
    ``period``). Invalid settings raise ValueError before anything starts.
    """
    names = list(strategies) if strategies is not None else list(STRATEGIES)
    variants = {name: parse_variant(name) for name in names}
    extra = dict(extra_sync or {})
    if regions < 1 or steps < 1 or batch < 1 or eval_batches < 1 or context < 1:
        raise ValueError("regions, steps, batch, eval_batches and context must be >= 1")
    if width % heads:
        raise ValueError(f"width ({width}) must be a multiple of heads ({heads})")
    if rtt_ms < 0:
        raise ValueError(f"rtt_ms must be >= 0, got {rtt_ms}")
    if {"strategy", "period"} & set(extra):
        raise ValueError("give strategy and period as arguments, not in extra_sync")
    if not names:
        raise ValueError("no strategies to run")
    for strategy, own in variants.values():  # fail early on a bad name or knob
        if {"strategy", "period"} & set(own):
            raise ValueError("a variant may not set strategy or period")
        SyncConfig.from_dict({"strategy": strategy, "period": period, **extra, **own})
    rate_Bps = parse_rate(rate)
    root = os.geteuid() == 0
    if netns and not root:
        raise ValueError("netns=True needs root (network namespaces, tc)")
    use_netns = root if netns is None else netns
    workload = {
        "steps": steps,
        "width": width,
        "layers": layers,
        "heads": heads,
        "context": context,
        "batch": batch,
        "lr": lr,
        "eval_batches": eval_batches,
        "device": device,
    }
    params = count_params(width, layers, heads, context)
    transport: dict[str, Any] = {"delay_s": rtt_ms / 2000.0}
    if not use_netns:
        transport["rate_limit"] = rate_Bps
    # the slowest strategy (ssgd) moves about twice the model per step over the link
    timeout = 600.0 + steps * (2.0 * 4 * params / rate_Bps + 2.0 * rtt_ms / 1000.0 + 5.0)
    t_start = time.perf_counter()

    ceiling_res = run_ceiling(regions, workload, timeout=600.0 + 10.0 * steps)
    ceiling_curve = _region_curve(ceiling_res)
    ceiling_sps = _mean([steps / r["wall_s"] for r in ceiling_res])
    log.info("ceiling: %.3f steps/s, held-out loss %.4f", ceiling_sps, ceiling_curve[-1][2])

    rows: dict[str, dict[str, Any]] = {}
    curves: dict[str, list[list[float]]] = {}
    with contextlib.ExitStack() as stack:
        ns_ctx = stack.enter_context(Namespaces(regions, rate)) if use_netns else None
        for name in names:
            strategy, own = variants[name]
            args = {
                "strategy": strategy,
                "period": period,
                "extra_sync": {**extra, **own},
                "workload": workload,
                "wire_devs": [dev for _, dev in ns_ctx.devs] if ns_ctx is not None else [None] * regions,
            }
            before = ns_ctx.tx_bytes() if ns_ctx is not None else None
            t0 = time.perf_counter()
            res = run_local(
                regions,
                JOB,
                args,
                {"transport": transport},
                timeout=timeout,
                node_job=True,
                hosts=ns_ctx.hosts if ns_ctx is not None else None,
            )
            total = time.perf_counter() - t0
            wire_run = None
            if ns_ctx is not None and before is not None:
                wire_run = [a - b for a, b in zip(ns_ctx.tx_bytes(), before, strict=True)]
            row = _summarize(res, steps, wire_run)
            row["compute_utilization"] = _r(row["steps_per_s"] / ceiling_sps, 3)
            row["run_s"] = _r(total, 1)
            rows[name] = row
            curves[name] = _region_curve(res)
            log.info(
                "%s: %.3f steps/s (%.0f%% of ceiling), hidden %.2f, held-out loss %.4f, %.1f MB/region",
                name,
                row["steps_per_s"],
                100 * row["compute_utilization"],
                row["hidden_fraction"],
                row["heldout_loss"],
                row["mb_sent"],
            )

    if target_loss is None:
        reference = curves["none"][-1][2] if "none" in curves else ceiling_curve[-1][2]
        target = reference * TARGET_MARGIN
        target_from = "none" if "none" in curves else "ceiling"
    else:
        target, target_from = target_loss, "given"
    for name, curve in curves.items():
        rows[name]["time_to_target_s"] = _r(_time_to(curve, target), 3)
    syncing = [n for n in rows if n != "none"] or list(rows)
    winner = max(syncing, key=lambda n: rows[n]["steps_per_s"])
    ceiling = {
        "steps_per_s": _r(ceiling_sps),
        "steps_per_s_regions": [_r(steps / r["wall_s"]) for r in ceiling_res],
        "heldout_loss": _r(ceiling_curve[-1][2]),
        "heldout_loss_regions": [_r(r["heldout_loss"]) for r in ceiling_res],
        "train_loss_last10": _r(_mean([r["train_loss_last10"] for r in ceiling_res])),
        "time_to_target_s": _r(_time_to(ceiling_curve, target), 3),
        "curve": [[s, _r(t, 3), _r(loss)] for s, t, loss in ceiling_curve],
    }
    if "none" in rows:
        ceiling["none_steps_per_s"] = rows["none"]["steps_per_s"]
        ceiling["none_utilization"] = rows["none"]["compute_utilization"]
    return {
        "bench": "lm",
        "regions": regions,
        "rate": rate,
        "rtt_ms": float(rtt_ms),
        "steps": steps,
        "period": period,
        "params": params,
        "shaping": "tbf" if use_netns else "in-process",
        "model": {"width": width, "layers": layers, "heads": heads, "context": context, "vocab": VOCAB},
        "batch": batch,
        "lr": lr,
        "device": device,
        "extra_sync": extra,
        "eval_every": eval_every(steps),
        "eval_tokens": eval_batches * batch * context,
        "target_loss": _r(target),
        "target_from": target_from,
        "ceiling": ceiling,
        "strategies": rows,
        "winner_steps_per_s": winner,
        "total_s": _r(time.perf_counter() - t_start, 1),
    }
