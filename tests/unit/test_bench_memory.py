"""`bench memory` (issue 36, item 5): its accounting (each storage once, the model's never, host and device
apart), its verdicts against the targets, the model it sizes, and one run at a tiny size through the console
script, whose JSON names every strategy with finite figures and DiLoCo's 12 bytes per parameter."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from dreamp2p.config.sync import STRATEGIES
from dreamp2p.devtools.bench.memory.account import (
    PEAK_TOLERANCE_BPP,
    BufferBytes,
    account,
    buffer_rows,
    over_target,
    per_param,
    steady_target,
    verdict,
)
from dreamp2p.devtools.bench.memory.run import MAX_WIDTH, model_shape
from dreamp2p.sync.strategies.base import Held

ROOT = Path(__file__).resolve().parents[2]

A = torch.zeros(100)  # 400 bytes
B = torch.zeros(50)  # 200 bytes
MODEL = torch.zeros(25)  # 100 bytes: the model's


@pytest.mark.parametrize(
    ("held", "exclude", "expected"),
    [
        ([], [], []),
        ([Held("a", "why", (A,))], [], [("a", 400)]),
        # a view names its whole storage; two views of one storage count once
        ([Held("a", "why", (A[:10], A[50:]))], [], [("a", 400)]),
        # one buffer under two names (a one-buffer group's snap and work): the first name has it
        ([Held("snap", "why", (A,)), Held("work", "why", (A,))], [], [("snap", 400), ("work", 0)]),
        ([Held("a", "why", (A, B))], [], [("a", 600)]),
        ([Held("a", "why", (A,)), Held("b", "why", (B, A[3:]))], [], [("a", 400), ("b", 200)]),
        # the model's own memory is never a strategy's, whatever holds it
        ([Held("a", "why", (A, MODEL))], [MODEL], [("a", 400)]),
        ([Held("a", "why", (MODEL[5:],))], [MODEL], [("a", 0)]),
        ([Held("empty", "why", ())], [], [("empty", 0)]),
    ],
)
def test_account_counts_each_storage_once_and_the_models_never(
    held: list[Held], exclude: list[torch.Tensor], expected: list[tuple[str, int]]
) -> None:
    got = account(held, exclude)
    assert [(b.name, b.host) for b in got] == expected
    assert all(b.device == 0 for b in got)


def test_account_keeps_device_memory_apart() -> None:
    other = torch.empty(10, device="meta")  # a device other than the host's (its storage says 40 bytes)
    (b,) = account([Held("a", "why", (A, other))])
    assert (b.host, b.device) == (400, 40)


@pytest.mark.parametrize(
    ("nbytes", "params", "expected"),
    [(0, 10, 0.0), (40, 10, 4.0), (10, 3, 3.333), (-5, 10, 0.0), (1 << 30, 1 << 28, 4.0)],
)
def test_per_param(nbytes: float, params: int, expected: float) -> None:
    assert per_param(nbytes, params) == expected


@pytest.mark.parametrize(
    ("strategy", "steady", "peak", "largest", "target", "steady_ok", "peak_ok"),
    [
        ("ssgd", 4.0, 8.0, 4.0, 4.0, True, True),
        ("ssgd", 8.0, 12.0, 4.0, 4.0, False, True),
        ("diloco", 12.0, 16.0, 4.0, 12.0, True, True),
        ("diloco", 12.0, 16.0 + PEAK_TOLERANCE_BPP, 4.0, 12.0, True, True),
        ("diloco", 12.0, 16.5, 4.0, 12.0, True, False),
        ("streaming", 12.0, 14.0, 2.0, 12.0, True, True),
        ("dreamddp", 16.0, 16.4, 2.0, 12.0, False, True),
        ("co2", 16.0, 28.0, 4.0, None, None, False),
        ("none", 0.0, 0.0, 0.0, None, None, True),
        ("localsgd", 8.0, 12.0, 4.0, None, None, True),
    ],
)
def test_verdict_against_the_targets(
    strategy: str,
    steady: float,
    peak: float,
    largest: float,
    target: float | None,
    steady_ok: bool | None,
    peak_ok: bool,
) -> None:
    got = verdict(strategy, steady, peak, largest)
    assert got == {
        "steady_target_Bpp": target,
        "steady_ok": steady_ok,
        "peak_limit_Bpp": steady + largest,
        "peak_ok": peak_ok,
    }


def test_over_target_names_each_buffer_with_why() -> None:
    buffers = [BufferBytes("theta", "outer weights", 40, 0), BufferBytes("snaps", "the merge", 40, 8)]
    assert over_target(8.0, 12.0, buffers, 10) is None
    assert over_target(8.0, None, buffers, 10) is None
    assert over_target(8.0, 4.0, buffers, 10) == "steady 8 B/param > 4: theta 4 (outer weights); snaps 4 (the merge)"
    rows = buffer_rows(buffers, 10)
    assert rows == [
        {"name": "theta", "Bpp": 4.0, "why": "outer weights"},
        {"name": "snaps", "Bpp": 4.0, "device_Bpp": 0.8, "why": "the merge"},
    ]


@pytest.mark.parametrize("params", [1000, 20_000, 1_000_000, 32_000_000, 200_000_000])
def test_model_shape_comes_near_the_asked_size(params: int) -> None:
    width, depth = model_shape(params)
    assert 8 <= width <= MAX_WIDTH and depth >= 2
    got = depth * (width * width + width)
    assert abs(got - params) <= max(0.1 * params, width * width + width)


def run_bench(*argv: str) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, "-m", "dreamp2p", "bench", "memory", "--json", *argv],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def figures(row: dict[str, Any]) -> list[float]:
    nums = [v for k, v in row.items() if k.endswith("_Bpp") and v is not None]
    return nums + [b["Bpp"] for b in row["buffers"]]


@pytest.mark.slow  # seconds, not milliseconds: started with the long tests, not last
def test_a_tiny_run_names_every_strategy_with_finite_figures_and_diloco_holds_12_bytes() -> None:
    result = run_bench("--params", "20000")
    rows = result["strategies"]
    assert list(rows) == list(STRATEGIES)  # none first: the compute-only reference
    for name, row in rows.items():
        assert all(isinstance(x, int | float) and math.isfinite(x) and x >= 0 for x in figures(row)), name
        assert sum(b["Bpp"] for b in row["buffers"]) == pytest.approx(row["steady_Bpp"], abs=0.01), name
    n = result["model"]["params"]
    assert n == result["model"]["depth"] * (result["model"]["width"] ** 2 + result["model"]["width"])
    # by hand: DiLoCo over AdamW keeps its pseudo-gradient, global copy and Nesterov momentum, 4 bytes each,
    # and its one round carries the whole model; Streaming the same over 2 fragments of half the layers each
    diloco = rows["diloco"]
    assert [(b["name"], b["Bpp"]) for b in diloco["buffers"]] == [
        ("pseudo-gradient", 4.0),
        ("global copy", 4.0),
        ("outer momentum", 4.0),
    ]
    assert (diloco["steady_Bpp"], diloco["largest_round_Bpp"], diloco["steady_ok"]) == (12.0, 4.0, True)
    assert (rows["streaming"]["steady_Bpp"], rows["streaming"]["largest_round_Bpp"]) == (12.0, 2.0)
    assert (rows["ssgd"]["steady_Bpp"], rows["ssgd"]["steady_ok"]) == (4.0, True)
    assert rows["none"]["steady_Bpp"] == 0.0 and rows["none"]["buffers"] == []
    assert "FSDP2" in result["fsdp_regions"] and "--ranks" in result["fsdp_regions"]  # not measured, and said so


@pytest.mark.slow  # seconds, not milliseconds: started with the long tests, not last
def test_one_strategy_asked_runs_with_the_compute_only_reference_also_per_rank_of_an_fsdp2_region() -> None:
    result = run_bench("--params", "5000", "--strategies", "diloco", "--period", "2", "--ranks", "1,2")
    assert list(result["strategies"]) == ["none", "diloco"]
    assert result["period"] == 2 and result["steps"] == {"settle": 9, "measured": 4}  # control rounds 3 apart
    # a rank of a 2-rank FSDP2 region (a torchrun job) keeps DiLoCo's buffers for its own shards: together the
    # two hold what one rank holds (FSDP2 splits each Linear's rows; the shares differ by at most a row a layer)
    region = result["fsdp_regions"]["2"]
    assert region["ranks"] == 2 and list(region["strategies"]) == ["none", "diloco"]
    per_rank = region["strategies"]["diloco"]["steady_Bpp_per_rank"]
    assert sum(per_rank) == pytest.approx(result["strategies"]["diloco"]["steady_Bpp"], rel=0.02), per_rank
    assert max(per_rank) < 0.6 * result["strategies"]["diloco"]["steady_Bpp"], per_rank
    assert region["strategies"]["diloco"]["steady_target_Bpp"] == 6.0


@pytest.mark.parametrize(
    ("strategy", "ranks", "target"),
    [("diloco", 1, 12.0), ("diloco", 2, 6.0), ("dreamddp", 4, 3.0), ("ssgd", 3, 1.333), ("co2", 2, None)],
)
def test_a_rank_of_an_fsdp2_region_is_held_to_its_share_of_the_target(
    strategy: str, ranks: int, target: float | None
) -> None:
    assert steady_target(strategy, ranks) == target
    judged = verdict(strategy, steady=5.0, peak=5.0, largest_round=1.0, ranks=ranks)
    assert judged["steady_target_Bpp"] == target
    assert judged["steady_ok"] is (None if target is None else target >= 5.0)
