"""`bench memory --ranks N`: what each strategy keeps per rank of an FSDP2 region of N ranks.

One torchrun job of N ranks on this host (gloo, CPU) per region size: every rank shards the same MLP with
FSDP2 (each Linear a unit, then the whole) and measures each strategy exactly as a one-rank member is measured
(`dreamp2p.devtools.bench.memory.run.measure`: accounting of `Strategy.held` and the process's resident set),
for its own shards, alone in a ring of one (which rounds the region's WAN ring would run does not change what
a strategy keeps between steps). Figures are bytes per parameter of the whole model, so a strategy that
keeps 12 bytes per element of its shards reads 12/N on each rank; the targets are the one-rank ones divided
by N. The row of a strategy is its worst rank's (the one holding most), with every rank's steady figure beside.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from dreamp2p.devtools.bench.memory.account import BufferBytes, per_param
from dreamp2p.devtools.bench.memory.process import return_freed_memory
from dreamp2p.devtools.bench.memory.run import MEASURED_PERIODS, build_model, measure, model_shape, row, settle_steps

# a hang guard for one region's job, not a bound on its speed
JOB_TIMEOUT_S = 3600


def bench_regions(strategies: list[str], params: int, period: int, ranks: list[int]) -> dict[str, Any]:
    """Rows per strategy for an FSDP2 region of each size in ``ranks`` (each > 1), keyed by that size."""
    names = ["none", *(n for n in strategies if n != "none")]
    width, depth = model_shape(params)
    n = sum(p.numel() for p in build_model(width, depth, "meta").parameters())
    out: dict[str, Any] = {}
    for size in ranks:
        if size < 2:
            raise ValueError(f"an FSDP2 region has at least 2 ranks, got {size}")
        per_rank = _run_job(names, params, period, size)
        rows = {}
        for name in names:
            each = [row(name, raws[name], raws["none"], n, cuda=False, ranks=size) for raws in per_rank]
            worst = max(range(size), key=lambda k: each[k]["steady_Bpp"])
            rows[name] = {**each[worst], "worst_rank": worst, "steady_Bpp_per_rank": [r["steady_Bpp"] for r in each]}
        out[str(size)] = {
            "strategies": rows,
            "ranks": size,
            "shards": "FSDP2, each Linear a unit",
            "largest_shard_Bpp": per_param(4 * max(raws["none"]["local_params"] for raws in per_rank), n),
            "steps": {"settle": settle_steps(period), "measured": MEASURED_PERIODS * period},
        }
    return out


def _run_job(names: list[str], params: int, period: int, ranks: int) -> list[dict[str, dict[str, Any]]]:
    """One torchrun job of ``ranks`` ranks; each rank's raw figures per strategy."""
    with tempfile.TemporaryDirectory(prefix="dreamp2p-memory-") as tmp:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks)]
        cmd += ["-m", "dreamp2p.devtools.bench.memory.fsdp", "--out", tmp, "--strategies", ",".join(names)]
        cmd += ["--params", str(params), "--period", str(period)]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=JOB_TIMEOUT_S, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"the {ranks}-rank FSDP2 job exited {done.returncode}:\n{done.stderr[-4000:]}")
        return [_load(Path(tmp) / f"rank{k}.json") for k in range(ranks)]


def _load(path: Path) -> dict[str, dict[str, Any]]:
    raws: dict[str, dict[str, Any]] = json.loads(path.read_text())
    for raw in raws.values():
        raw["buffers"] = [BufferBytes(**b) for b in raw["buffers"]]
    return raws


def main(argv: list[str] | None = None) -> int:
    """One rank of the job (`_run_job` starts it under torchrun)."""
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--strategies", required=True)
    p.add_argument("--params", type=int, required=True)
    p.add_argument("--period", type=int, required=True)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    return_freed_memory()
    width, depth = model_shape(args.params)
    raws: dict[str, dict[str, Any]] = {}
    for name in args.strategies.split(","):
        raw = measure(name, width, depth, args.period, "cpu", shard=True)
        raw["buffers"] = [dataclasses.asdict(b) for b in raw["buffers"]]
        raws[name] = raw
    (args.out / f"rank{dist.get_rank()}.json").write_text(json.dumps(raws))
    dist.barrier()  # no rank tears the group down while another still uses it
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
