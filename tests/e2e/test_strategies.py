"""Every strategy trains a real model across 3 peer processes on loopback (issue 3 acceptance)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from conftest import SYNC_STRATEGIES

from dreamp2p.devtools.bench.jobs.training import reference_ssgd
from dreamp2p.devtools.launch import run_local

JOB = "dreamp2p.devtools.bench.jobs.training:train_job"
# max_stretch 1: the quiet stretches and step counts below assume the configured period (a loaded host can make
# these tiny models read as link-bound, and a measured plan would then lengthen it: dreamp2p.schedule.stretch)
SMALL_SYNC = {"period": 5, "warmup_steps": 3, "control_every": 5, "max_stretch": 1}


def train(world: int, strategy: str, config: dict[str, Any] | None = None, **args: Any) -> list[dict[str, Any]]:
    return run_local(world, JOB, {"strategy": strategy, **args}, config, node_job=True, timeout=240)


def mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy", SYNC_STRATEGIES)
def test_strategy_trains_with_falling_loss(strategy: str) -> None:
    results = train(3, strategy, steps=80, sync=SMALL_SYNC)
    # attach() starts every replica from rank 0's parameters
    assert len({r["init_digest"] for r in results}) == 1
    for r in results:
        losses = r["losses"]
        assert all(np.isfinite(losses))
        assert mean(losses[-10:]) < 0.6 * mean(losses[:10]), f"{strategy}: {mean(losses[:10])} -> {mean(losses[-10:])}"
        assert r["bytes_sent"] > 0


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_ssgd_matches_single_process_on_union_batch() -> None:
    steps, lr = 25, 0.02
    results = train(3, "ssgd", steps=steps, lr=lr)
    ref = [p.detach().numpy() for p in reference_ssgd(3, steps, lr).parameters()]
    assert len({r["digest"] for r in results}) == 1  # S-SGD keeps replicas identical
    for got, want in zip(results[0]["params"], ref, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("max_delay", "outer"),
    [
        (0, {}),
        (2, {}),
        (2, {"group_outer_lr": 0.8, "group_outer_momentum": 0.5}),  # Nesterov outer step per layer group
    ],
)
def test_dreamddp_full_period_makes_replicas_identical(max_delay: int, outer: dict[str, float]) -> None:
    """After a full period (plus the longest delay) with no local progress, every layer was averaged: every
    member holds the same outer weights, so flush() ends identical replicas through its compressed path
    (which it takes only where those agree). Without the flush replicas may still differ by what their 2-bit
    or sparse syncs did not carry (keep_unsent)."""
    sync = {**SMALL_SYNC, "max_delay": max_delay, **outer}
    results = train(3, "dreamddp", steps=40, sync=sync, quiet_steps=sync["period"] + max_delay + 1, flush=True)
    assert len({r["trained_digest"] for r in results}) == 3  # partial sync: replicas differed while training
    assert len({r["digest"] for r in results}) == 1
    assert [r["flush_path"] for r in results] == ["compressed"] * 3
    assert len({tuple(map(tuple, r["plan_history"])) for r in results}) == 1
    for r in results:
        assert mean(r["losses"][-10:]) < 0.6 * mean(r["losses"][:10])


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_slowed_link_replans_everywhere_at_the_same_step() -> None:
    config = {
        "transport": {
            "probe_interval_s": 0.5,
            "probe_burst_bytes": 32768,
            "chunk_min_bytes": 16384,
            "chunk_max_bytes": 65536,
        }
    }
    # int4 pseudo-gradients throughout (no int2 fallback): this small model's int2 rounds are a few 16 KB frames,
    # the in-process limiter's burst; under load, with them, the planner read 1.2-3.5 MB/s on the 0.4 MB/s link
    # or saw no change at all, so the re-plan this test is about did not follow (issue 34's note)
    sync = {
        **{"period": 4, "warmup_steps": 3, "control_every": 4, "replan_sustain": 2, "max_stretch": 1},
        "delta_fallbacks": [],
    }
    # the slowed rate sits far below what a loaded loopback measures (1-4 MB/s): a slowdown within the re-plan
    # threshold of the measured basis rightly changes nothing. At 0.4 MB/s CI once saw no re-plan (aa70bf0): a run
    # here read 1.83 MB/s before, still 0.53 (a falling moving average) 23 steps after; a basis read near 1 MB/s
    # under load leaves that inside the threshold. At 0.2 MB/s it reads 0.3 by then
    results = train(3, "dreamddp", config, steps=90, width=256, sync=sync, slow_at=30, slow_rate=2e5, step_sleep=0.005)
    histories = [tuple(map(tuple, r["plan_history"])) for r in results]
    assert len(set(histories)) == 1, histories  # the same plans, adopted at the same steps
    history = histories[0]
    seen = (history, results[0]["controls"])  # the plans and the bandwidths each control round measured
    assert any(step > 30 for _, step in history), seen  # re-planned after the slowdown
    assert [v for v, _ in history] == sorted(v for v, _ in history)
    basis = results[0]["basis_bw"]
    assert basis is not None and basis < 1e6, (basis, seen)  # the final plan was made for the slow link
    for r in results:
        assert mean(r["losses"][-10:]) < mean(r["losses"][:10])


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_slow_link_gets_a_more_compressive_codec_and_replicas_still_agree() -> None:
    """Bandwidth-aware compression per link (arXiv 2408.14736): the slow link sends fewer bytes, fast ones keep
    the base codec, every member picks the same codecs, and the lossy mix still ends bit-identical."""
    config = {
        "transport": {
            "rate_limit": 40e6,
            "probe_interval_s": 0.5,
            "probe_burst_bytes": 32768,
            "chunk_min_bytes": 16384,
            "chunk_max_bytes": 65536,
        }
    }
    order = ["fp32", "bf16", "int8", "int4"]  # least to most lossy
    # parameters on every layer sync (no 4-bit pseudo-gradients between anchors): link codecs apply to all
    sync = {
        **{"period": 4, "warmup_steps": 3, "control_every": 4, "max_delay": 2, "max_stretch": 1},
        **{"link_codecs": order, "delta_codec": ""},
    }
    results = train(
        3,
        "dreamddp",
        config,
        steps=90,
        width=256,
        sync=sync,
        slow_at=10,
        # only rank 2's link (to rank 0) is slow: 100x under the others' cap, since a fast link's goodput
        # is measured by short probes and CPU-bound transfers, and on a busy 2-core host it reads a few MB/s
        slow_rate=4e5,
        slow_ranks=[2],
        step_sleep=0.005,
        quiet_steps=4 + 2 + 1,  # a period plus the longest delay
        flush=True,
    )
    choices = {tuple(r["link_codecs"]) for r in results}
    assert len(choices) == 1, choices  # the same choice everywhere (from the same control round)
    (send,) = choices
    seen = (send, results[0]["link_bandwidths"])  # the codecs and the goodputs they were chosen from
    # the slow link compresses hard; a fast link keeps a less lossy codec (which one: measurement noise)
    assert order.index(send[2]) >= order.index("int8"), seen
    assert min(order.index(send[0]), order.index(send[1])) < order.index(send[2]), seen
    # the slow link's sender moves fewer bytes than the fast links' senders
    sent = [r["bytes_sent"] for r in results]
    assert sent[2] < 0.8 * max(sent[0], sent[1]), sent
    # lossy frames on some links, identical replicas: parameter-averaging syncs leave nothing apart after the
    # quiet stretch, so flush() finds them identical already
    assert [r["flush_path"] for r in results] == ["agreed"] * 3
    assert len({r["digest"] for r in results}) == 1
    for r in results:
        assert mean(r["losses"][-10:]) < 0.6 * mean(r["losses"][:10])


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_stalled_peer_holds_the_others_only_for_a_bounded_wait() -> None:
    """A peer whose trainer stops for 8 s (its process alive, answering heartbeats) must not stop the
    others for 8 s: their rounds with it time out after ``round_timeout_s`` (retried once) and are skipped
    everywhere, they keep stepping, and after it is back and a quiet period all replicas hold one set of outer
    weights again: flush() takes its compressed path and ends them identical."""
    config = {"transport": {"round_timeout_s": 1.0, "heartbeat_s": 0.5}}
    sync = {"period": 4, "warmup_steps": 3, "control_every": 4, "max_delay": 2}
    stall_at, stall_s = 20, 8.0
    results = train(
        3,
        "dreamddp",
        config,
        steps=60,
        sync=sync,
        step_sleep=0.01,
        stall=(2, stall_at, stall_s),
        step_times=True,
        quiet_steps=4 + 2 + 1,  # a period plus the longest delay
        flush=True,
    )
    # the stalled peer's last step before its stall and its first after it: the stall lies between them
    stalled = results[2]["step_times"]
    stall_from, stall_end = stalled[stall_at - 1], stalled[stall_at]
    for r in results[:2]:
        # bounded by the order of events, not by a clock: had the others waited for the stalled peer, none
        # of their steps would fall between those two of its steps; they kept stepping, skipping its rounds
        assert sum(1 for t in r["step_times"] if stall_from < t < stall_end) >= 3
        assert r["rounds_skipped"] > 0
    for r in results:
        assert all(np.isfinite(r["losses"]))
        assert mean(r["losses"][-10:]) < 0.6 * mean(r["losses"][:10])
    assert [r["flush_path"] for r in results] == ["compressed"] * 3  # the skipped rounds were skipped everywhere
    assert len({r["digest"] for r in results}) == 1
