"""Every strategy keeps all model state consistent, and nodes that disagree refuse each other at start.

Issue: attach() used to broadcast and average only trainable parameters (frozen ones kept each rank's
init, BatchNorm statistics drifted), and nodes with different settings started and then hung on rounds
that could never match. Real processes on loopback, real gRPC.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from conftest import SYNC_STRATEGIES

from dreamp2p.devtools.launch import run_local

STATE_JOB = "dreamp2p.devtools.bench.jobs.state:model_state_job"
ATTACH_JOB = "dreamp2p.devtools.bench.jobs.state:attach_job"
SYNC = {"period": 4, "warmup_steps": 2, "control_every": 4}


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("strategy", SYNC_STRATEGIES)
def test_parameters_frozen_parameters_and_buffers_agree(strategy: str) -> None:
    results = run_local(3, STATE_JOB, {"strategy": strategy, "sync": SYNC}, node_job=True, timeout=200)
    assert len({r["before"] for r in results}) == 3  # each rank started from its own init, buffers too
    assert len({r["attached"] for r in results}) == 1  # attach broadcast rank 0's whole state
    if strategy == "ssgd":
        # gradients and buffers are averaged every step, as under DDP
        assert len({r["trained"] for r in results}) == 1
    assert len({r["flushed"] for r in results}) == 1
    # BatchNorm saw per-rank input scales; after averaging every rank holds the same running statistics
    assert len({tuple(r["running_mean"]) for r in results}) == 1
    assert {r["batches_tracked"] for r in results} == {12}
    assert all(r["rounds_skipped"] == 0 for r in results)


def _attach(sync_by_rank: list[dict[str, Any]], channels: list[int] | None = None) -> list[dict[str, Any]]:
    # a long round timeout: only the up-front agreement can make this return quickly
    config = {"transport": {"round_timeout_s": 300.0, "connect_timeout_s": 60.0}}
    args = {"sync_by_rank": sync_by_rank, "channels_by_rank": channels or [4] * len(sync_by_rank)}
    return run_local(len(sync_by_rank), ATTACH_JOB, args, config, node_job=True, timeout=120)


@pytest.mark.timeout(150)
@pytest.mark.parametrize(
    ("sync_by_rank", "channels", "named"),
    [
        (
            [{"strategy": "dreamddp", "period": 5}, {"strategy": "dreamddp", "period": 10}],
            None,
            ["sync.period", "5", "10"],
        ),
        ([{"strategy": "ssgd"}, {"strategy": "dreamddp"}], None, ["sync.strategy", "ssgd", "dreamddp"]),
        (
            [{"link_codecs": ["fp32", "int8"]}, {"link_codecs": ["fp32", "int4"]}],
            None,
            ["sync.link_codecs", "int8", "int4"],
        ),
        ([{}, {}], [4, 6], ["model.manifest", "model.trainable_elements"]),
    ],
    ids=["period", "strategy", "codec-list", "model"],
)
def test_nodes_with_different_settings_refuse_each_other_at_start(
    sync_by_rank: list[dict[str, Any]], channels: list[int] | None, named: list[str]
) -> None:
    results = _attach(sync_by_rank, channels)
    for rank, r in enumerate(results):
        assert r["status"] == "CONFIG_MISMATCH", (rank, r)
        for word in named:
            assert word in r["error"], (rank, word, r["error"])


@pytest.mark.timeout(150)
def test_nodes_with_equal_settings_attach() -> None:
    results = _attach([{"strategy": "diloco", "period": 5}] * 2)
    assert [r["status"] for r in results] == ["OK", "OK"]


async def test_peers_with_different_models_both_fail_fast_naming_both_manifests() -> None:
    """Each side refuses the other's manifest; neither waits out its connect timeout on a peer that left."""
    from dreamp2p.config import PeerConfig, PeerInfo, TransportConfig
    from dreamp2p.errors import PeerError, Status
    from dreamp2p.peer import Peer

    transport = TransportConfig(connect_timeout_s=120.0, probe_interval_s=3600.0, heartbeat_s=0.0)
    peers = [Peer(PeerConfig(node_id=f"p{i}", manifest_hash=bytes([i]) * 32, transport=transport)) for i in range(2)]
    for p in peers:
        await p.start()
    ring = [PeerInfo(p.config.node_id, p.address) for p in peers]

    async def connect_or_leave(peer: Peer) -> None:
        try:
            await peer.connect(ring)
        except PeerError:
            await peer.close(grace=0)  # as a daemon exits: its port is gone for the other side's retries
            raise

    try:
        outcomes = await asyncio.wait_for(
            asyncio.gather(*(connect_or_leave(p) for p in peers), return_exceptions=True), timeout=60
        )
    finally:
        for p in peers:
            await p.close()
    for out in outcomes:
        assert isinstance(out, PeerError) and out.status == Status.MANIFEST_MISMATCH, out
        assert "p0's model manifest" in str(out) or "p1's model manifest" in str(out)


@pytest.mark.parametrize("route", ["checkpoint", "state-transfer"])
def test_checkpoints_and_state_transfer_carry_buffers_and_frozen_parameters(route: str, tmp_path: Any) -> None:
    """What a resumed or joining node loads holds BatchNorm statistics, frozen parameters and buffers."""
    import torch

    from dreamp2p.config.sync import SyncConfig
    from dreamp2p.devtools.bench.jobs.state import BatchNormNet
    from dreamp2p.manifest import state_digest
    from dreamp2p.service.checkpoint import load_step, save_checkpoint
    from dreamp2p.state.snapshot import flatten_state, unflatten_state
    from dreamp2p.sync.comm.inprocess import InProcessHub
    from dreamp2p.sync.strategies.baselines import NoSync

    comm = InProcessHub(1).member(0)
    source, target = BatchNormNet(seed=1), BatchNormNet(seed=2)
    strategies = [NoSync(m, torch.optim.SGD(m.parameters(), lr=0.1), comm, SyncConfig()) for m in (source, target)]
    for _ in range(3):  # moves the running statistics and num_batches_tracked
        source(torch.randn(8, 1, 8, 8) * 3).sum().backward()
        strategies[0].step()
    assert state_digest(source) != state_digest(target)
    state = strategies[0].state_dict()
    if route == "checkpoint":
        save_checkpoint(tmp_path, 3, state)
        _, loaded = load_step(tmp_path, 3)
    else:
        skeleton, tensors = flatten_state(state)
        loaded = unflatten_state(skeleton, dict(tensors))
    strategies[1].load_state_dict(loaded)
    assert state_digest(target) == state_digest(source)
    assert int(target.bn.get_buffer("num_batches_tracked")) == 3
