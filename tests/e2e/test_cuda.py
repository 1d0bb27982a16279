"""The CUDA path: trainers on the GPU, pinned host staging, merges on the device, real multi-process runs.

These need a CUDA device, which CI does not have; they run on a GPU machine (`pytest tests/test_cuda.py`)
and docs/BENCHMARKS.md records what they and `dreamp2p bench strategies --device cuda` measured there.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from dreamp2p.devtools.launch import run_local
from dreamp2p.sync.model.layers import FlatGroup

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run on a GPU machine)")
JOB = "dreamp2p.devtools.bench.jobs.training:train_job"


def _params(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g).cuda() for shape in ((33, 7), (1,), (4096,))]


def test_snapshot_buffers_are_pinned_and_land_after_ready() -> None:
    params = _params(0)
    group = FlatGroup(params, pin=True)
    assert group.snap.is_pinned() and group.work.is_pinned()
    assert group.snap.device.type == "cpu"  # staging costs no GPU memory
    group.snapshot()
    group.ready()
    want = torch.cat([p.detach().cpu().reshape(-1) for p in params])
    assert torch.equal(group.snap, want)


@pytest.mark.parametrize("progress", [False, True])
def test_device_merge_equals_host_merge_bit_for_bit(progress: bool) -> None:
    gpu, cpu = _params(1), [p.cpu() for p in _params(1)]
    g_gpu, g_cpu = FlatGroup(gpu, pin=True), FlatGroup(cpu)
    for g in (g_gpu, g_cpu):
        g.snapshot()
        g.ready()
        g.work.copy_(torch.linspace(-3.0, 3.0, g.numel))  # stands in for the ring's mean
    if progress:  # local steps taken while the round was in flight must survive the merge
        for a, b in zip(gpu, cpu, strict=True):
            a.add_(0.125)
            b.add_(0.125)
    g_gpu.merge()
    g_cpu.merge()
    torch.cuda.synchronize()
    for a, b in zip(gpu, cpu, strict=True):
        assert torch.equal(a.cpu(), b)
    if not progress:  # no local progress: exactly the mean, on every peer
        assert torch.equal(torch.cat([p.cpu().reshape(-1) for p in gpu]), g_gpu.work)


def _train(strategy: str, **args: Any) -> list[dict[str, Any]]:
    return run_local(2, JOB, {"strategy": strategy, "device": "cuda", **args}, node_job=True, timeout=240)


@pytest.mark.timeout(300)
def test_ssgd_on_gpu_keeps_replicas_identical() -> None:
    results = _train("ssgd", steps=30, lr=0.02)
    assert len({r["digest"] for r in results}) == 1
    for r in results:
        assert sum(r["losses"][-5:]) < 0.8 * sum(r["losses"][:5])


@pytest.mark.timeout(300)
def test_dreamddp_on_gpu_overlaps_and_ends_identical_after_a_quiet_period() -> None:
    sync = {"period": 5, "warmup_steps": 3, "control_every": 5, "max_delay": 2, "max_stretch": 1}  # as quiet_steps
    quiet = sync["period"] + sync["max_delay"] + 1
    results = _train("dreamddp", steps=60, sync=sync, quiet_steps=quiet, flush=True)
    assert len({r["trained_digest"] for r in results}) == 2  # partial sync: replicas differed while training
    # one set of outer weights after the quiet period: flush() takes its compressed path
    assert [r["flush_path"] for r in results] == ["compressed", "compressed"]
    assert len({r["digest"] for r in results}) == 1
    for r in results:
        assert r["bytes_sent"] > 0
        assert 0.0 <= r["hidden_fraction"] <= 1.0
        assert sum(r["losses"][-10:]) < 0.6 * sum(r["losses"][:10])
