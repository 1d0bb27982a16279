"""The node's Prometheus endpoint over HTTP on 127.0.0.1: counters, histograms, process metrics (#13 deliver 3).

The endpoint is started the way the daemon starts it (`NodeMetrics.serve` on ``[metrics] listen``) and fed
what the daemon feeds it: each step's `StepStats` and the peer's `PeerStatus`.
"""

from __future__ import annotations

import dataclasses
import urllib.request
from collections.abc import Iterator

import pytest
from prometheus_client.parser import text_string_to_metric_families

from dreamp2p.messages import LinkSnapshot, PeerStatus
from dreamp2p.service.metrics import NodeMetrics
from dreamp2p.sync.strategies.base import StepStats

RING = ("eu-west", "us-east", "ap-south")


def status(rounds: int, live: tuple[str, ...] = ()) -> PeerStatus:
    link = LinkSnapshot("us-east", 0.08, 2.5e6, 1000 * rounds, 900 * rounds, 4, 1 << 16)
    return PeerStatus(
        node_id="eu-west",
        cluster_id="c",
        protocol_version=2,
        ring=RING,
        links=(link,),
        rounds_completed=rounds,
        rounds_failed=2,
        frames_rejected=3,
        contributions_refused=1,
        live=live,
    )


@pytest.fixture
def metrics() -> Iterator[NodeMetrics]:
    m = NodeMetrics("eu-west")
    yield m
    m.close()


def scrape(port: int) -> tuple[str, dict[str, float]]:
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    samples = {}
    for fam in text_string_to_metric_families(body):
        for s in fam.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            samples[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return body, samples


def test_endpoint_serves_counters_histograms_and_process_metrics(metrics: NodeMetrics) -> None:
    port = metrics.serve("127.0.0.1:0")
    metrics.step_stats(StepStats(step=0, exposed_s=0.0, comm_s=0.0, syncs=0))
    metrics.step_stats(StepStats(step=1, exposed_s=0.3, comm_s=3.0, syncs=2))  # two rounds of 1.5 s
    metrics.step_stats(StepStats(step=2, exposed_s=0.02, comm_s=0.2, syncs=1))
    metrics.peer_status(status(rounds=7))
    metrics.peer_status(status(rounds=9, live=("eu-west", "ap-south")))  # us-east dropped out of the view

    body, s = scrape(port)
    # running totals are counters, mirrored from the last status (not added up across reads)
    assert "# TYPE dreamp2p_rounds_completed_total counter" in body
    assert s["dreamp2p_rounds_completed_total"] == 9
    assert s["dreamp2p_rounds_failed_total"] == 2
    assert s["dreamp2p_frames_rejected_total"] == 3
    assert s["dreamp2p_contributions_withheld_total"] == 1
    assert s["dreamp2p_bytes_sent_total{peer=us-east}"] == 9000
    assert s["dreamp2p_bytes_received_total{peer=us-east}"] == 8100
    assert s["dreamp2p_exposed_wait_seconds_total"] == pytest.approx(0.32)
    assert s["dreamp2p_comm_seconds_total"] == pytest.approx(3.2)
    # liveness per ring member
    assert [s[f"dreamp2p_peer_up{{peer={p}}}"] for p in RING] == [1.0, 0.0, 1.0]
    assert s["dreamp2p_live_members"] == 2
    # histograms: one observation per landed round (sum and count exact), one per step for exposed wait
    assert s["dreamp2p_round_duration_seconds_count"] == 3
    assert s["dreamp2p_round_duration_seconds_sum"] == pytest.approx(3.2)
    assert s["dreamp2p_round_duration_seconds_bucket{le=1.0}"] == 1
    assert s["dreamp2p_round_duration_seconds_bucket{le=2.5}"] == 3
    assert s["dreamp2p_step_exposed_wait_seconds_count"] == 3
    assert s["dreamp2p_step_exposed_wait_seconds_bucket{le=0.0}"] == 1
    assert s["dreamp2p_step_exposed_wait_seconds_bucket{le=+Inf}"] == 3
    assert 'dreamp2p_round_duration_seconds_bucket{le="0.5"}' in body
    # what the default registry would carry
    assert s["process_cpu_seconds_total"] > 0
    assert s["process_resident_memory_bytes"] > 0
    assert any(k.startswith("python_info{") for k in s)
    assert any(k.startswith("python_gc_collections_total{") for k in s)


def test_a_node_without_a_peer_status_yet_exports_no_peer_series(metrics: NodeMetrics) -> None:
    port = metrics.serve("127.0.0.1:0")
    _, s = scrape(port)
    assert not [k for k in s if k.startswith(("dreamp2p_rounds_", "dreamp2p_peer_up"))]
    assert s["dreamp2p_round_duration_seconds_count"] == 0


def test_before_the_first_view_every_ring_member_counts_as_up(metrics: NodeMetrics) -> None:
    port = metrics.serve("127.0.0.1:0")
    metrics.peer_status(status(rounds=1))
    _, s = scrape(port)
    assert [s[f"dreamp2p_peer_up{{peer={p}}}"] for p in RING] == [1.0, 1.0, 1.0]


def test_a_straggler_counts_as_up_and_excluded(metrics: NodeMetrics) -> None:
    port = metrics.serve("127.0.0.1:0")
    st = dataclasses.replace(
        status(rounds=5, live=("eu-west", "ap-south")),
        excluded=("us-east",),
        straggler_evictions=2,
        straggler_returns=1,
    )
    metrics.peer_status(st)
    _, s = scrape(port)
    assert s["dreamp2p_straggler_evictions_total"] == 2
    assert s["dreamp2p_straggler_returns_total"] == 1
    # alive (it answers heartbeats) but out of the rounds' view
    assert [s[f"dreamp2p_peer_up{{peer={p}}}"] for p in RING] == [1.0, 1.0, 1.0]
    assert [s[f"dreamp2p_peer_excluded{{peer={p}}}"] for p in RING] == [0.0, 1.0, 0.0]
    assert s["dreamp2p_live_members"] == 2
