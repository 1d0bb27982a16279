"""Regions of many local ranks (torchrun jobs, gloo on loopback) averaging shards over the WAN ring (issue 11).

Two regions of two ranks each: DDP inside each region, a dreamp2p strategy between them, where local rank k
of each region rings with local rank k of the other and carries shard k of every group.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import port_range

from dreamp2p.devtools.bench.jobs.training import student
from dreamp2p.devtools.localrun import child_env
from dreamp2p.devtools.regionjob import free_port_block

TORCHRUN = Path(sys.executable).parent / "torchrun"
REGIONS = ("a", "b")
# max_stretch 1: the quiet period assumes the configured period (dreamp2p.schedule.stretch may lengthen it)
DREAMDDP_SYNC = {"period": 4, "warmup_steps": 3, "control_every": 4, "max_delay": 1, "max_stretch": 1}


def mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def launch(
    out: Path,
    ranks: tuple[int, ...],
    strategy: str,
    sync: dict[str, Any],
    steps: int,
    quiet_steps: int,
    extra: tuple[tuple[str, ...], ...] = (),
) -> dict[str, tuple[int, str]]:
    """One torchrun per region (``ranks[i]`` local ranks in region i, ``extra[i]`` more arguments for its
    job); each region's exit code and log."""
    return finish(*start(out, ranks, strategy, sync, steps, quiet_steps, extra))


Started = tuple[dict[str, subprocess.Popen[bytes]], dict[str, Path]]


def start(
    out: Path,
    ranks: tuple[int, ...],
    strategy: str,
    sync: dict[str, Any],
    steps: int,
    quiet_steps: int,
    extra: tuple[tuple[str, ...], ...] = (),
    restarts: tuple[int, ...] = (),
) -> Started:
    """Start :func:`launch`'s torchruns (``restarts[i]``: torchrun's --max-restarts for region i)."""
    out.mkdir(parents=True, exist_ok=True)
    base = free_port_block(sum(ranks), *port_range())
    starts = [base + sum(ranks[:i]) for i in range(len(ranks))]
    names = ("a", "b", "c")[: len(ranks)]
    ring = ",".join(f"{r}=127.0.0.1:{p}" for r, p in zip(names, starts, strict=True))
    env = {**child_env(), "OMP_NUM_THREADS": "1"}
    procs: dict[str, subprocess.Popen[bytes]] = {}
    logs = {r: out / f"{r}.log" for r in names}
    for i, (region, n) in enumerate(zip(names, ranks, strict=True)):
        cmd = [str(TORCHRUN), "--standalone", "--nproc-per-node", str(n)]
        cmd += ["--max-restarts", str(restarts[i])] if restarts else []
        cmd += ["-m", "dreamp2p.devtools.regionjob"]
        cmd += ["--region", region, "--ring", ring, "--strategy", strategy, "--sync", json.dumps(sync)]
        cmd += ["--steps", str(steps), "--quiet-steps", str(quiet_steps), "--out", str(out)]
        cmd += extra[i] if extra else ()
        with logs[region].open("wb") as log:
            # a session of its own: a hung run is killed with its ranks (torchrun's children outlive a SIGKILL)
            procs[region] = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    return procs, logs


def kill_all(procs: dict[str, subprocess.Popen[bytes]]) -> None:
    """Kill every torchrun still running, and its ranks."""
    for proc in procs.values():
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def finish(procs: dict[str, subprocess.Popen[bytes]], logs: dict[str, Path]) -> dict[str, tuple[int, str]]:
    """Wait for the torchruns :func:`start` started; each region's exit code and log."""
    deadline = time.monotonic() + 300  # a hang guard, not a bound on speed
    try:
        return {
            r: (p.wait(timeout=max(1.0, deadline - time.monotonic())), logs[r].read_text()) for r, p in procs.items()
        }
    finally:
        kill_all(procs)


def run_regions(
    out: Path, ranks: int, strategy: str, sync: dict[str, Any], steps: int, quiet_steps: int, flush: bool = False
) -> dict[str, dict[str, Any]]:
    """Two regions of ``ranks`` local ranks each, trained to the end (then flushed when asked); each rank's
    result by node id."""
    extra = (("--flush",), ("--flush",)) if flush else ()
    for region, (code, log) in launch(out, (ranks, ranks), strategy, sync, steps, quiet_steps, extra).items():
        assert code == 0, f"region {region} exited {code}:\n{log[-4000:]}"
    results = {}
    for path in sorted(out.glob("*.json")):
        r = json.loads(path.read_text())
        results[r["node_id"]] = r
    assert len(results) == len(REGIONS) * ranks, sorted(results)
    return results


@pytest.mark.slow
@pytest.mark.timeout(700)
def test_ssgd_regions_of_two_ranks_train_alike_and_halve_each_ranks_wan_bytes(tmp_path: Path) -> None:
    steps = 40
    sharded = run_regions(tmp_path / "2x2", 2, "ssgd", {}, steps, quiet_steps=2)
    whole = run_regions(tmp_path / "2x1", 1, "ssgd", {}, steps, quiet_steps=2)
    assert sorted(sharded) == ["a", "a.1", "b", "b.1"]  # each local rank its own peer and node id
    assert sorted(whole) == ["a", "b"]  # a one-rank region takes the one-process path
    for r in sharded.values():
        assert r["rounds_skipped"] == 0
        assert mean(r["losses"][-5:]) < 0.6 * mean(r["losses"][:5]), r["losses"]
    # attach broadcast region a's rank 0; S-SGD keeps every rank of every region bit-identical
    assert len({r["init_digest"] for r in sharded.values()}) == 1
    assert len({r["trained_digest"] for r in sharded.values()}) == 1
    assert len({r["digest"] for r in sharded.values()}) == 1
    # each local rank carries half of the region's WAN traffic (the same rounds, half the elements)
    one_rank = mean([r["bytes_sent"] for r in whole.values()])
    assert one_rank > 0
    for node, r in sharded.items():
        assert abs(r["bytes_sent"] / one_rank - 0.5) <= 0.05, (node, r["bytes_sent"], one_rank)


@pytest.mark.slow
@pytest.mark.timeout(500)
def test_dreamddp_regions_of_two_ranks_end_bit_identical_after_a_quiet_period(tmp_path: Path) -> None:
    sync = DREAMDDP_SYNC
    quiet = sync["period"] + sync["max_delay"] + 1
    results = run_regions(tmp_path, 2, "dreamddp", sync, 40, quiet_steps=quiet, flush=True)
    for r in results.values():
        assert r["rounds_skipped"] == 0
        assert mean(r["losses"][-5:]) < 0.6 * mean(r["losses"][:5]), r["losses"]
    # the ranks of a region hold one replica (DDP plus identical gathers); the regions differ while training
    for region in REGIONS:
        assert results[region]["trained_digest"] == results[f"{region}.1"]["trained_digest"]
    assert results["a"]["trained_digest"] != results["b"]["trained_digest"]
    # every rank adopted the same plans at the same steps, and a full quiet period averaged every layer: the
    # outer weights agree everywhere, so flush() ends identical replicas through its compressed path (it takes
    # it only where they agree); without it replicas keep what their 2-bit or sparse syncs did not carry
    assert len({json.dumps(r["plan_history"]) for r in results.values()}) == 1
    assert len({r["digest"] for r in results.values()}) == 1
    assert {r["flush_path"] for r in results.values()} == {"compressed"}


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_regions_of_different_rank_counts_or_models_are_refused_at_start(tmp_path: Path) -> None:
    # a: 2 ranks, FSDP2; b: 1 rank (no region). Ring 0 (a, the region's rank 0, and b) refuses at attach, on both
    # sides, naming every setting that differs: the rank count and how the region holds its model
    exits = launch(tmp_path, (2, 1), "ssgd", {}, steps=5, quiet_steps=0, extra=(("--fsdp",), ()))
    for region, (code, log) in exits.items():
        assert code != 0, f"region {region} trained beside a region of another size or kind:\n{log[-4000:]}"
        assert "region.ranks" in log and "region.model" in log and "fsdp2" in log, log[-4000:]
    assert not list(tmp_path.glob("*.json"))  # no rank trained


STRATEGIES = ("ssgd", "localsgd", "diloco", "streaming", "co2", "dreamddp")
STUDENT_ELEMENTS = sum(p.numel() for p in student().parameters())  # the regionjob's model, whole


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_fsdp2_regions_of_two_ranks_end_bit_identical_after_flush_under_every_strategy(tmp_path: Path) -> None:
    # issue 36 item 1: the student sharded with fully_shard (one unit per Linear, AdamW) in two regions of two
    # ranks; every strategy in turn, each on a fresh model with different inits per rank, then flush()
    sync = {"period": 4, "warmup_steps": 3, "control_every": 4, "max_delay": 1, "max_stretch": 1}
    fsdp = ("--fsdp", "--lr", "0.003")
    exits = launch(tmp_path, (2, 2), ",".join(STRATEGIES), sync, steps=30, quiet_steps=0, extra=(fsdp, fsdp))
    for region, (code, log) in exits.items():
        assert code == 0, f"region {region} exited {code}:\n{log[-4000:]}"
    for strategy in STRATEGIES:
        results = {r["node_id"]: r for r in (json.loads(p.read_text()) for p in tmp_path.glob(f"{strategy}.*.json"))}
        assert sorted(results) == ["a", "a.1", "b", "b.1"], (strategy, sorted(results))
        for node, r in results.items():
            assert r["rounds_skipped"] == 0, (strategy, node)
            assert r["bytes_sent"] > 0, (strategy, node)
            assert mean(r["losses"][-5:]) < 0.7 * mean(r["losses"][:5]), (strategy, node, r["losses"])
        # each rank holds and averages its own shards only: the region's ranks together hold the model once
        for region in REGIONS:
            mine = [results[region]["local_elements"], results[f"{region}.1"]["local_elements"]]
            assert sum(mine) == STUDENT_ELEMENTS and max(mine) < STUDENT_ELEMENTS, (strategy, mine)
        # attach gave every rank of region b region a's shards (the whole model gathered is the same)
        assert len({r["init_digest"] for r in results.values()}) == 1, strategy
        if strategy != "ssgd":  # the regions trained apart between syncs, so the flush had work to do
            assert results["a"]["trained_digest"] != results["b"]["trained_digest"], strategy
        # flush(): the whole model, gathered from each region's shards, bit-identical in both regions
        assert len({r["digest"] for r in results.values()}) == 1, strategy
        assert len({r["state_digest"] for r in results.values()}) == 1, strategy


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_an_fsdp2_region_whose_rank_was_killed_comes_back_by_itself_and_ends_bit_identical(tmp_path: Path) -> None:
    # issue 36: local rank 1 of region b SIGKILLs itself at step 20; torchrun (--max-restarts 1) restarts b's
    # ranks, which join the running cluster, each taking its own shards from its ring; a trains on meanwhile
    sync = {"period": 4, "warmup_steps": 3, "control_every": 4, "max_delay": 1, "max_stretch": 1}
    stop = tmp_path / "stop"
    common = ("--fsdp", "--lr", "0.003", "--stop-file", str(stop), "--min-step", "0.03")
    extra = (common, (*common, "--kill-at", "20", "--kill-rank", "1"))
    procs, logs = start(tmp_path, (2, 2), "dreamddp", sync, 100_000, 0, extra, restarts=(0, 1))
    try:
        joined = [tmp_path / "joined.b", tmp_path / "joined.b.1"]
        deadline = time.monotonic() + 240  # a hang guard, not a bound on speed
        while not all(p.exists() and p.read_text() for p in joined):
            assert all(p.poll() is None for p in procs.values()), {r: logs[r].read_text()[-3000:] for r in procs}
            assert time.monotonic() < deadline, "region b never joined again"
            time.sleep(0.2)
        starts = {int(p.read_text()) for p in joined}
        assert len(starts) == 1, starts  # every rank of b starts at the same step
        # both regions stop and flush at one step, well past where a is now (it waits on b's rounds)
        stop.write_text(str(starts.pop() + 40))
        exits = finish(procs, logs)
    finally:
        kill_all(procs)
    for region, (code, log) in exits.items():
        assert code == 0, f"region {region} exited {code}:\n{log[-4000:]}"
    results = {r["node_id"]: r for r in (json.loads(p.read_text()) for p in tmp_path.glob("dreamddp.*.json"))}
    assert sorted(results) == ["a", "a.1", "b", "b.1"]
    assert results["b"]["joined_at"] == results["b.1"]["joined_at"] > 20  # restarted, joined past the kill
    assert results["a"]["joined_at"] is None  # a was never restarted
    assert len({r["final_step"] for r in results.values()}) == 1
    # a's model learned on through it all; after flush every rank of both regions holds the same model
    a = results["a"]["losses"]
    assert mean(a[-10:]) < 0.7 * mean(a[:10]), a
    assert len({r["digest"] for r in results.values()}) == 1


CGROUP_MEMORY = Path("/sys/fs/cgroup/memory")
# a 5.27M-parameter student (Linear 16->1024, five 1024x1024, 1024->1): each rank may add 42 bytes per parameter
# of the whole model once it starts (its cgroup's limit). Measured on this host: a rank of a 2-rank FSDP2
# region peaks near 30, a one-rank region (the whole replica: weights, gradients, AdamW, DreamDDP's state, the
# flush) near 54
BIG = ("--width", "1024", "--depth", "6", "--memory-budget", "42")
LR = "0.0002"  # AdamW on the wide student: larger steps make its loss jump about within 20 steps


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.skipif(os.geteuid() != 0 or not CGROUP_MEMORY.is_dir(), reason="memory cgroups (v1) need root")
def test_a_model_too_big_for_one_rank_trains_in_fsdp2_regions_of_two(tmp_path: Path) -> None:
    # issue 36 item 6: every rank confined to a memory cgroup; one replica does not fit a rank's budget, a
    # shard of it does; DreamDDP between the regions, flush at the end
    prefix = f"dreamp2p-test-{os.getpid()}-{time.monotonic_ns()}"
    sync = {"period": 4, "warmup_steps": 3, "control_every": 4, "max_delay": 1, "max_stretch": 1}
    # each launch its cgroups of its own: a cgroup's high-water mark outlives the process that made it
    whole_args = ("--fsdp", "--lr", LR, "--cgroup-prefix", f"{prefix}-whole", *BIG)
    sharded_args = ("--fsdp", "--lr", LR, "--cgroup-prefix", f"{prefix}-sharded", *BIG)
    try:
        whole = launch(tmp_path / "whole", (1, 1), "dreamddp", sync, 12, 0, extra=(whole_args, whole_args))
        sharded = launch(tmp_path / "sharded", (2, 2), "dreamddp", sync, 20, 0, extra=(sharded_args, sharded_args))
    finally:
        for group in CGROUP_MEMORY.glob(f"{prefix}-*"):
            group.rmdir()
    # one rank holding the whole replica is killed by its cgroup's limit (the kernel's OOM killer: SIGKILL)
    assert any("exitcode: -9" in log for _, log in whole.values()), {r: log[-2000:] for r, (_, log) in whole.items()}
    for region, (code, log) in sharded.items():
        assert code == 0, f"region {region} exited {code}:\n{log[-4000:]}"
    results = {r["node_id"]: r for r in (json.loads(p.read_text()) for p in (tmp_path / "sharded").glob("*.json"))}
    assert sorted(results) == ["a", "a.1", "b", "b.1"]
    for node, r in results.items():
        memory = r["memory"]
        assert memory["peak"] - memory["start"] <= memory["budget"], (node, memory)
        assert mean(r["losses"][-5:]) < mean(r["losses"][:5]), (node, r["losses"])
    assert len({r["digest"] for r in results.values()}) == 1  # flush: the whole model alike in both regions


def run_alone(out: Path, ranks: int, strategy: str, sync: dict[str, Any], args: tuple[str, ...]) -> dict[str, Any]:
    """Region a alone (its ring only itself) with ``ranks`` FSDP2 ranks; local rank 0's result."""
    port = free_port_block(ranks, *port_range())
    cmd = [str(TORCHRUN), "--standalone", "--nproc-per-node", str(ranks), "-m", "dreamp2p.devtools.regionjob"]
    cmd += ["--region", "a", "--ring", f"a=127.0.0.1:{port}", "--strategy", strategy, "--sync", json.dumps(sync)]
    cmd += ["--fsdp", "--out", str(out), *args]
    env = {**child_env(), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    return dict(json.loads((out / f"{strategy}.a.0.json").read_text()))


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_sharded_checkpoint_of_two_ranks_resumes_with_one_and_with_four(tmp_path: Path) -> None:
    # issue 36 item 4: torch.distributed.checkpoint, saved asynchronously at step 6 by a region of 2 FSDP2 ranks
    # training on to step 26; read back by regions of 1 and 4 ranks (DCP reshards model, AdamW and DiLoCo's
    # global copy and outer momentum), whose steps 6..25 must retrace the uninterrupted run's. Every run sees
    # the same 16 samples per step, split among its ranks
    sync = {"period": 4}
    common = ("--lr", "0.003", "--steps", "26", "--global-batch", "16", "--dcp", str(tmp_path / "ckpt"))
    whole = run_alone(tmp_path / "uninterrupted", 2, "diloco", sync, (*common, "--dcp-save-at", "6"))
    assert (whole["first_step"], whole["final_step"]) == (0, 26)
    for ranks in (1, 4):
        resumed = run_alone(tmp_path / f"resumed-{ranks}", ranks, "diloco", sync, (*common, "--dcp-load"))
        assert (resumed["resumed_at"], resumed["first_step"], resumed["final_step"]) == (6, 6, 26)
        # the whole model after step 26, gathered: the same up to the order FSDP2 sums gradients in
        assert resumed["trained_norm"] == pytest.approx(whole["trained_norm"], rel=1e-6), ranks
        assert resumed["trained_digest"] != whole["init_digest"]
