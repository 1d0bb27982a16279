"""A region of two ranks (two processes, gloo over a file store): its own agreements and the shared join.

What a region needs beside the shard rounds: every rank learning local rank 0's bytes, a barrier that
tells every rank whether all passed, a join where rank 0 alone fetches and every rank loads the same state
and start step (or all fail), and a round whose ranks packed groups of different sizes failing on all.
"""

from __future__ import annotations

import json
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dreamp2p.errors import RoundFailed
from dreamp2p.state.snapshot import flatten_state
from dreamp2p.sync.comm.inprocess import InProcessHub
from dreamp2p.sync.comm.regionjoin import decode_fetched, encode_fetched, join_region
from dreamp2p.sync.comm.sharded import ShardedCollective
from dreamp2p.sync.model.layers import FlatGroup

STATE: dict[str, Any] = {
    "model": {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3)},
    "step": 7,
    "lr": [0.1, None],
}


def _join(region: ShardedCollective, fail_fetch: bool) -> dict[str, Any]:
    loaded: list[tuple[Any, int]] = []

    def fetch() -> tuple[int, bytes, dict[str, torch.Tensor]]:
        if fail_fetch:
            raise RuntimeError("no donor answered")
        skeleton, tensors = flatten_state(STATE)
        return 12, skeleton, dict(tensors)

    try:
        start = join_region(region, lambda: None, fetch, lambda s, k: loaded.append((s, k)), timeout=60)
    except RuntimeError as exc:
        return {"error": str(exc)}
    state, step = loaded[0] if loaded else (STATE, start)
    return {"start": start, "step": step, "w": state["model"]["w"].tolist(), "lr": state["lr"]}


def _mismatch(region: ShardedCollective) -> str:
    group = FlatGroup([torch.ones(6 + 2 * region.local_rank)])  # as a control round packed for another view
    group.snapshot()
    try:
        region.allreduce_group(group, 3, "fp32", round_id=1).result(60)
    except RoundFailed as exc:
        return str(exc)
    return "no failure"


def _worker(rank: int, store: str, out: str) -> None:
    result: dict[str, Any] = {}
    try:
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
        assert dist.group.WORLD is not None
        region = ShardedCollective(InProcessHub(1).member(0), dist.group.WORLD)
        try:
            result["bytes"] = region.broadcast_bytes(b"rank 0's" if rank == 0 else None, 60).decode()
            result["empty"] = region.broadcast_bytes(b"" if rank == 0 else None, 60).decode()
            result["all_ok"] = region.all_ok(True, 60)
            result["one_failed"] = region.all_ok(rank == 0, 60)
            result["join"] = _join(region, fail_fetch=False)
            result["failed_join"] = _join(region, fail_fetch=True)
            result["mismatch"] = _mismatch(region)
        finally:
            region.close()
            dist.destroy_process_group()
    except Exception:
        result["crash"] = traceback.format_exc()
    Path(out, f"{rank}.json").write_text(json.dumps(result))


@pytest.mark.timeout(180)
def test_a_region_of_two_ranks_agrees_joins_from_rank_0_and_fails_mismatched_rounds(tmp_path: Path) -> None:
    mp.start_processes(_worker, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=2, start_method="spawn")
    results = [json.loads((tmp_path / f"{rank}.json").read_text()) for rank in range(2)]
    for r in results:
        assert "crash" not in r, r["crash"]
        assert r["bytes"] == "rank 0's" and r["empty"] == ""
        assert r["all_ok"] is True and r["one_failed"] is False  # every rank hears that rank 1 failed
        # rank 0 fetched and loaded itself; rank 1 loaded the very same state and start step
        assert r["join"] == {"start": 12, "step": 12, "w": [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]], "lr": [0.1, None]}
        assert "no donor answered" in r["failed_join"]["error"] or "could not fetch" in r["failed_join"]["error"]
        assert "sizes [6, 8]" in r["mismatch"]


def test_the_shared_state_round_trips_bit_exactly_and_refuses_tampered_bytes() -> None:
    skeleton, tensors = flatten_state(STATE)
    buf = encode_fetched(5, skeleton, dict(tensors))
    start, skel, got = decode_fetched(buf)
    assert (start, skel) == (5, skeleton)
    assert all(torch.equal(got[n], t) for n, t in tensors)
    tampered = bytearray(buf)
    tampered[-1] ^= 1  # the last tensor byte
    with pytest.raises(ValueError):
        decode_fetched(bytes(tampered))
    with pytest.raises(ValueError):
        decode_fetched(buf + b"x")
