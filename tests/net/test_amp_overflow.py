"""GradScaler on the sync object across real members (issue 13, deliver 4): two processes on loopback, real
gRPC; member 1's gradients overflow at step 3. Both end on the same step with no skipped round, member 1
skipped only its local update (S-SGD: the peer's contribution guard left its gradients out of the mean, so
nobody skipped anything), and the replicas agree after the quiet stretch: S-SGD's and local SGD's are
identical already (flush() finds them so), DreamDDP's hold one set of outer weights (its flush takes its
compressed path) and differ only by what their sparse syncs did not carry until the flush."""

from __future__ import annotations

import pytest

from dreamp2p.devtools.launch import run_local

JOB = "ampjob:amp_job"  # tests/net/ampjob.py: the spawned members import it from the same sys.path


@pytest.mark.timeout(240)
@pytest.mark.parametrize("strategy", ["ssgd", "localsgd", "dreamddp"])
def test_an_overflow_on_one_real_member_keeps_both_on_the_same_step(strategy: str) -> None:
    args = {"strategy": strategy, "steps": 16, "quiet_from": 8, "overflow": [1, 3]}
    results = run_local(2, JOB, args, node_job=True, timeout=200)
    assert [r["steps"] for r in results] == [16, 16]
    assert [r["rounds_skipped"] for r in results] == [0, 0]
    assert [r["skipped_local"] for r in results] == ([0, 0] if strategy == "ssgd" else [0, 1])
    assert results[1]["scale"] < results[0]["scale"]  # only member 1's scaler backed off
    assert all(r["finite"] for r in results)
    assert results[0]["digest"] == results[1]["digest"]
    path = "compressed" if strategy == "dreamddp" else "agreed"
    assert [r["flush_path"] for r in results] == [path, path]
