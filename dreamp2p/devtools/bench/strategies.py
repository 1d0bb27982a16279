"""`dreamp2p bench strategies`: every strategy on the same model, data and emulated link, 2 peers.

First a compute-only run (strategy ``none``) measures the step rate and model size; unless given, the
link rate is then set so that one full fp32 model all-reduce costs ``H/2`` compute steps, the regime
where DreamDDP is meant to help. Each strategy then trains for the same number of steps over that
link (token-bucket rate + one-way delay per hop, in process). The default batch makes a compute step
about 0.16 s on one CPU core, so the H/2 rule gives a WAN-like link (~30 Mbit/s). With much shorter steps
(``--batch 256``: 10 ms) the comm thread's CPU (framing, checksums, copies) competes with the two trainers
for this machine's two cores and costs utilization that a GPU trainer would not pay; BENCHMARKS.md shows
both. Reported per strategy:

- ``steps_per_s`` and ``compute_utilization`` (= steps_per_s / compute-only steps_per_s; the compute-only
  run is repeated at the end and the faster of the two is used, so a busy moment cannot flatter a strategy);
- ``hidden_fraction`` = 1 - exposed wait / communication time;
- ``bytes_per_step`` sent by one peer;
- ``loss_at_equal_steps``: mean training loss of the last 10 steps (both peers);
- ``time_to_target_s``: wall time until the 10-step running mean loss first reaches the target, which
  is S-SGD's final running mean loss times 1.05 (null if never reached).
"""

from __future__ import annotations

import logging
from typing import Any

from dreamp2p.config import parse_duration, parse_rate
from dreamp2p.config.sync import STRATEGIES
from dreamp2p.devtools.launch import run_local

log = logging.getLogger(__name__)

ALL = [s for s in STRATEGIES if s != "none"]
JOB = "dreamp2p.devtools.bench.jobs.training:train_job"


def _running(losses: list[float], window: int = 10) -> list[float]:
    out, acc = [], 0.0
    for i, x in enumerate(losses):
        acc += x
        if i >= window:
            acc -= losses[i - window]
        out.append(acc / min(i + 1, window))
    return out


def _summarize(
    res: list[dict[str, Any]], steps: int
) -> tuple[dict[str, Any], tuple[list[float], list[float]], float, float]:
    """One strategy's row from both peers' results, its (running loss, time) curve, steps/s and last loss."""
    wall = max(r["wall_s"] for r in res)
    sps = steps / wall
    losses = [sum(r["losses"][i] for r in res) / len(res) for i in range(steps)]
    times = [wall * (i + 1) / steps for i in range(steps)]
    curve = (_running(losses), times)
    comm = sum(r["comm_s"] for r in res)
    exposed = sum(r["exposed_s"] for r in res)
    row = {
        "steps_per_s": round(sps, 3),
        # a blocking wait also covers the other peer's lateness, so exposed can exceed comm: none hidden
        "hidden_fraction": round(max(0.0, 1.0 - exposed / comm), 3) if comm > 0 else 1.0,
        "bytes_per_step": round(sum(r["bytes_sent"] for r in res) / len(res) / steps),
        "loss_at_equal_steps": round(sum(losses[-10:]) / 10, 5),
        "plans": res[0]["plan_history"],
    }
    return row, curve, sps, losses[-1]


def _time_to_target(out: dict[str, Any], curves: dict[str, tuple[list[float], list[float]]]) -> float | None:
    """Set each row's time_to_target_s (to ssgd's final running loss + 5%); the target, None without ssgd."""
    target = None
    if "ssgd" in curves:
        target = curves["ssgd"][0][-1] * 1.05
    for name, (run, times) in curves.items():
        hit = next((t for v, t in zip(run, times, strict=True) if target is not None and v <= target), None)
        out[name]["time_to_target_s"] = round(hit, 3) if hit is not None else None
    return target


def bench_strategies(
    strategies: list[str] | None = None,
    steps: int = 150,
    period: int = 10,
    width: int = 512,
    depth: int = 4,
    batch: int = 4096,
    lr: float = 0.05,
    rate: str | None = None,
    rtt: str = "20ms",
    max_delay: int | None = None,
    codec: str = "fp32",
    device: str = "cpu",
) -> dict[str, Any]:
    names = strategies or ALL
    if max_delay is None:
        max_delay = period - 1  # a sync may overlap up to a whole period of compute
    common = {"steps": steps, "width": width, "depth": depth, "batch_size": batch, "lr": lr, "device": device}
    sync = {"period": period, "codec": codec, "warmup_steps": 5, "control_every": 10, "max_delay": max_delay}

    def compute_only() -> tuple[float, list[Any]]:
        runs = run_local(2, JOB, {**common, "strategy": "none", "sync": sync}, node_job=True, timeout=900)
        return min(steps / r["wall_s"] for r in runs), runs

    compute_sps, base = compute_only()
    log.info("compute only: %.2f steps/s", compute_sps)
    step_s = 1.0 / compute_sps
    nparams = sum(int(p.size) for p in base[0]["params"])
    model_bytes = 4 * nparams
    # one full fp32 ring all-reduce (2 peers) moves the model once per direction: make it cost H/2 steps
    rate_Bps = parse_rate(rate) if rate else model_bytes / (period / 2 * step_s)
    delay_s = parse_duration(rtt) / 2
    transport = {"rate_limit": rate_Bps, "delay_s": delay_s, "probe_interval_s": 2.0}
    out: dict[str, Any] = {}
    curves: dict[str, tuple[list[float], list[float]]] = {}
    for name in names:
        res = run_local(
            2, JOB, {**common, "strategy": name, "sync": sync}, {"transport": transport}, node_job=True, timeout=1800
        )
        out[name], curves[name], sps, last_loss = _summarize(res, steps)
        log.info("%s: %.2f steps/s, hidden %.2f, loss %.5f", name, sps, out[name]["hidden_fraction"], last_loss)
    # measured again at the end: on a shared machine the faster of the two is the fair reference
    compute_sps = max(compute_sps, compute_only()[0])
    for row in out.values():
        row["compute_utilization"] = round(row["steps_per_s"] / compute_sps, 3)
    target = _time_to_target(out, curves)
    return {
        "strategies": out,
        "link": {
            "rate_MBps": round(rate_Bps / 1e6, 3),
            "rtt_ms": round(2 * delay_s * 1e3, 1),
            "peers": 2,
            "full_sync_steps": round(model_bytes / rate_Bps / step_s, 2),
        },
        "compute_only_steps_per_s": round(compute_sps, 3),
        "model": {
            "params": nparams,
            "width": width,
            "depth": depth,
            "batch": batch,
            "period": period,
            "steps": steps,
            "codec": codec,
            "max_delay": max_delay,
            "device": device,
            "lr": lr,
        },
        "target_loss": round(target, 5) if target is not None else None,
    }
