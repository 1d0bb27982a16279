"""`dreamp2p bench memory`: the host (and device) bytes per parameter each strategy adds to a one-rank member,
at steady state and at the peak, beyond the model, its gradients and the inner optimizer (AdamW).

Each strategy is attached to a fresh MLP of about ``params`` parameters after one plain training step (so
the gradients and AdamW's state exist before the baseline is read), alone in a ring of one
(`dreamp2p.devtools.bench.memory.solo`, whose rounds copy their buffer once, as the peer's do). It trains
3 periods to settle (3 control intervals where those are longer: DreamDDP adopts its first measured plan
meanwhile), then 2 measured periods. Two routes:

- accounting (``steady_Bpp``, ``buffers``): after every measured step, the storages of the tensors
  `Strategy.held` names, each counted once and none of the model's or the optimizer's; the step where they
  total most. This says which buffer holds what, and why.
- the process (``steady_rss_Bpp``, ``peak_rss_Bpp``): the resident set after each measured step, and its
  high-water mark over the measured steps, less the baseline (`dreamp2p.devtools.bench.memory.process`).
  The peak includes the training step's own transients (activations, AdamW's temporaries), which the
  compute-only run (``none``, always run first) shows; ``peak_Bpp`` is what a strategy reads above that.
  A strategy's own peak lies between the two: its transients may or may not meet the training step's.
  The verdict (``peak_ok``) reads ``peak_Bpp``.

On CUDA the strategies' buffers are pinned host memory (counted above); ``device_steady_Bpp`` and
``device_peak_Bpp`` are CUDA's allocated bytes beyond the baseline (the peak less the compute-only one).
A rank of an FSDP2 region of N ranks: ``--ranks N`` (`dreamp2p.devtools.bench.memory.fsdp`).
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch
from torch import nn

from dreamp2p.config.sync import STRATEGIES, SyncConfig
from dreamp2p.devtools.bench.memory.account import (
    BYTES_PER_ELEMENT,
    account,
    buffer_rows,
    over_target,
    per_param,
    steady_target,
    verdict,
)
from dreamp2p.devtools.bench.memory.process import (
    DeviceMemory,
    peak_rss_bytes,
    reset_peak,
    return_freed_memory,
    rss_bytes,
    settle,
)
from dreamp2p.devtools.bench.memory.solo import SoloCollective
from dreamp2p.sync.model.shardlocal import local_view
from dreamp2p.sync.strategies.registry import strategy_class

log = logging.getLogger(__name__)

MAX_WIDTH = 1024  # wide enough for a few large layers, narrow enough that AdamW's per-layer temporaries stay small
BATCH = 4
SETTLE_PERIODS = 3
MEASURED_PERIODS = 2
FSDP = "not measured: --ranks 2,4 measures a rank of an FSDP2 region of 2 and of 4 ranks (a torchrun job each)"


def model_shape(params: int) -> tuple[int, int]:
    """(width, depth) of an MLP of ``depth`` square Linear layers with about ``params`` parameters."""
    width = min(MAX_WIDTH, max(8, math.isqrt(params // 8)))
    return width, max(2, round(params / (width * width + width)))


def control_every(period: int) -> int:
    """DreamDDP's control rounds once a period, but never sooner than their lead allows."""
    return max(period, SyncConfig.control_lead + 1)


def settle_steps(period: int) -> int:
    """Steps before the measured ones: 3 periods, or 3 control intervals where those are longer (DreamDDP
    adopts its first measured plan two control rounds in)."""
    return SETTLE_PERIODS * control_every(period)


def build_model(width: int, depth: int, device: str, shard: bool = False) -> nn.Module:
    """The MLP; ``shard``: each Linear an FSDP2 unit, then the whole (torch.distributed must be initialized)."""
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.Tanh()]
    model = nn.Sequential(*layers).to(device)
    if shard:
        from torch.distributed.fsdp import fully_shard

        for layer in layers[::2]:
            fully_shard(layer)
        fully_shard(model)
    return model


def _model_side(model: nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The tensors that are the model's or the inner optimizer's: never counted as a strategy's (this rank's
    shards of them under FSDP2)."""
    params = list(model.parameters())
    grads = [p.grad for p in params if p.grad is not None]
    state = [t for st in opt.state.values() for t in st.values() if isinstance(t, torch.Tensor)]
    return [local_view(t) for t in (*params, *grads, *state, *model.buffers())]


def measure(name: str, width: int, depth: int, period: int, device: str, shard: bool = False) -> dict[str, Any]:
    """One strategy's raw figures, in bytes (see the module docstring); ``shard``: as one rank of an FSDP2
    region (`dreamp2p.devtools.bench.memory.fsdp`)."""
    model = build_model(width, depth, device, shard)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(BATCH, width, device=device)

    def backward() -> None:
        model(x).square().mean().backward()

    backward()
    opt.step()  # the gradients and AdamW's state exist from here: the baseline includes them
    opt.zero_grad(set_to_none=False)
    dev = DeviceMemory(device)
    settle()
    base_rss, base_dev = rss_bytes(), dev.allocated()
    comm = SoloCollective()
    cfg = SyncConfig(strategy=name, period=period, warmup_steps=2, control_every=control_every(period))
    s = strategy_class(name)(model, opt, comm, cfg)
    for _ in range(settle_steps(period)):
        backward()
        s.step()
        s.zero_grad(set_to_none=False)
    settle()
    comm.largest = 0  # the rounds of the measured steps only (DreamDDP's warm-up plan has larger ones)
    peak_known = reset_peak()
    dev.reset_peak()
    held: list[Any] = []
    steady = steady_rss = steady_dev = 0
    for _ in range(MEASURED_PERIODS * period):
        backward()
        s.step()
        s.zero_grad(set_to_none=False)
        buffers = account(s.held(), _model_side(model, opt))
        total = sum(b.host for b in buffers)
        if total >= steady:
            steady, held = total, buffers
        steady_rss = max(steady_rss, rss_bytes() - base_rss)
        steady_dev = max(steady_dev, dev.allocated() - base_dev)
    peak = peak_rss_bytes() if peak_known else None
    s.close()
    return {
        "steady": steady,
        "buffers": held,
        "steady_rss": steady_rss,
        # without a resettable high-water mark, the most seen after a step (a lower bound)
        "peak_rss": (peak - base_rss) if peak is not None else steady_rss,
        "peak_measured": peak is not None,
        "largest_round": comm.largest * BYTES_PER_ELEMENT,
        "device_steady": steady_dev,
        "device_peak": dev.peak() - base_dev,
        "local_params": sum(local_view(p).numel() for p in model.parameters()),  # this rank's, under FSDP2
    }


def row(
    name: str, raw: dict[str, Any], compute: dict[str, Any], params: int, cuda: bool, ranks: int = 1
) -> dict[str, Any]:
    """One strategy's JSON row, in bytes per parameter, with its targets (a rank's of an FSDP2 region of ``ranks``)."""
    steady = per_param(raw["steady"], params)
    peak = per_param(raw["peak_rss"] - compute["peak_rss"], params)
    row: dict[str, Any] = {
        "steady_Bpp": steady,
        "peak_Bpp": peak,
        "steady_rss_Bpp": per_param(raw["steady_rss"], params),
        "peak_rss_Bpp": per_param(raw["peak_rss"], params),
        "largest_round_Bpp": per_param(raw["largest_round"], params),
        **verdict(name, steady, peak, per_param(raw["largest_round"], params), ranks),
    }
    if cuda:
        row["device_steady_Bpp"] = per_param(raw["device_steady"], params)
        row["device_peak_Bpp"] = per_param(raw["device_peak"] - compute["device_peak"], params)
    over = over_target(steady, steady_target(name, ranks), raw["buffers"], params)
    if over is not None:
        row["over_target"] = over
    row["buffers"] = buffer_rows(raw["buffers"], params)
    return row


def bench_memory(
    strategies: list[str] | None = None, params: int = 32_000_000, period: int = 4, device: str = "cpu"
) -> dict[str, Any]:
    unknown = [n for n in strategies or () if n not in STRATEGIES]
    if unknown:
        raise ValueError(f"unknown strategies {', '.join(unknown)}; one of {', '.join(STRATEGIES)}")
    # the compute-only run first: the training step's own peak, which every other run reads too
    names = ["none", *(n for n in strategies or STRATEGIES if n != "none")]
    freed = return_freed_memory()
    width, depth = model_shape(params)
    raw: dict[str, dict[str, Any]] = {}
    for name in names:
        raw[name] = measure(name, width, depth, period, device)
        log.info("%s: %.2f B/param held", name, raw[name]["steady"] / params)
    n = sum(p.numel() for p in build_model(width, depth, "meta").parameters())
    cuda = device == "cuda"
    rows = {name: row(name, raw[name], raw["none"], n, cuda) for name in names}
    return {
        "strategies": rows,
        "model": {"params": n, "width": width, "depth": depth, "inner": "AdamW", "batch": BATCH, "device": device},
        "period": period,
        "steps": {"settle": settle_steps(period), "measured": MEASURED_PERIODS * period},
        "member": "one rank, alone in its ring",
        "fsdp_regions": FSDP,
        "peak_measured": all(r["peak_measured"] for r in raw.values()),
        "freed_memory_returned": freed,
        "compute_peak_rss_Bpp": per_param(raw["none"]["peak_rss"], n),
    }
