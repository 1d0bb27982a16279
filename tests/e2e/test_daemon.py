"""End to end: three `dreamp2p node` daemons from TOML configs on loopback (issue 4 acceptance)."""

from __future__ import annotations

import signal
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from dreamp2p.config import DaemonConfig
from dreamp2p.devtools.localrun import (
    last_step,
    metrics_port,
    read_records,
    start_node,
    wait_exits,
    wait_progress,
    write_configs,
)
from dreamp2p.service.checkpoint import list_checkpoints

SYNC = {"strategy": "dreamddp", "period": 4, "warmup_steps": 2, "control_every": 5, "max_delay": 1, "codec": "int8"}
TASK = {
    "steps": 60,
    "batch": 8,
    "context": 32,
    "dim": 64,
    "layers": 1,
    "heads": 2,
    "eval_every": 20,
    "max_corpus_bytes": 1 << 20,
}


def stop_all(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait(10)


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_three_daemons_sigterm_checkpoint_and_resume(tmp_path: Path) -> None:
    # the run ends at a step the test writes once the restarted node is back (the others train on meanwhile)
    task = {**TASK, "steps": 100_000}
    configs = write_configs(tmp_path, 3, rate_Bps=20e6, delay_s=0.002, sync=SYNC, task=task, checkpoint_every=10)
    stop_at = tmp_path / "stop-at"
    procs = [start_node(c, stop_at_file=stop_at) for c in configs]
    names = ("eu-west", "us-east", "ap-south")
    try:
        # everyone trains together
        running = dict(zip(names, procs, strict=True))
        wait_progress(lambda: min(last_step(tmp_path, n) for n in names) >= 15, running, tmp_path)

        # metrics endpoint, scraped over HTTP, carries the promised series
        cfg = DaemonConfig.from_toml(configs[0])
        assert cfg.metrics.listen == "127.0.0.1:0"
        port = metrics_port(tmp_path, "eu-west")
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        for series in (
            "dreamp2p_step",
            "dreamp2p_loss",
            "dreamp2p_tokens_per_second",
            "dreamp2p_bytes_sent_total{",
            "dreamp2p_bytes_received_total{",
            "dreamp2p_link_goodput_bytes_per_second{",
            "dreamp2p_link_rtt_seconds{",
            "dreamp2p_exposed_wait_seconds_total",
            "dreamp2p_hidden_fraction",
            "dreamp2p_plan_version",
            "dreamp2p_rounds_failed_total",
        ):
            assert series in body, series

        # `dreamp2p status` shows peers, links and the plan in force
        address = cfg.node.ring[0].address
        out = subprocess.run(
            [sys.executable, "-m", "dreamp2p.cli", "status", address, "--token", "local-demo-token"],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert out.returncode == 0, out.stderr
        assert "ring: eu-west -> us-east -> ap-south" in out.stdout
        assert "link -> us-east" in out.stdout and "training: dreamddp" in out.stdout and "h0:" in out.stdout

        # SIGTERM: the node finishes its step, drains, checkpoints and exits 0
        victim = procs[1]
        victim.send_signal(signal.SIGTERM)
        wait_exits({"us-east": victim}, tmp_path, 120)
        stop = [r for r in read_records(tmp_path, "us-east") if r["kind"] == "stop"][-1]
        assert stop["signal"] == "SIGTERM"
        ckpts = list_checkpoints(tmp_path / "us-east" / "checkpoints")
        assert ckpts and ckpts[-1].name == f"ckpt-{stop['step']:010d}.pt"

        # the others went on without it (the ring re-formed among the two survivors)
        survivors = {"eu-west": procs[0], "ap-south": procs[2]}
        wait_progress(lambda: min(last_step(tmp_path, n) for n in survivors) > stop["step"] + 20, survivors, tmp_path)

        # restart with --resume: the cluster trained on, so it joins with the live members' state and step
        # instead of its older checkpoint, and the ring of three finishes the run together
        procs[1] = start_node(configs[1], resume=True, stop_at_file=stop_at)

        def joined() -> list[dict[str, Any]]:
            return [r for r in read_records(tmp_path, "us-east") if r["kind"] == "join"]

        wait_progress(lambda: bool(joined()), dict(zip(names, procs, strict=True)), tmp_path)
        join = joined()[-1]
        assert join["resumed"] is True and join["step"] > stop["step"] + 20
        final = max(last_step(tmp_path, n) for n in names) + 40
        stop_at.write_text(str(final))
        wait_exits(dict(zip(names, procs, strict=True)), tmp_path, 300)
        for name in names:
            records = read_records(tmp_path, name)
            assert last_step(tmp_path, name) == final - 1
            evals = [r["eval_loss"] for r in records if r["kind"] == "eval"]
            assert evals[-1] < evals[0]
        assert {[r for r in read_records(tmp_path, n) if r["kind"] == "stop"][-1]["step"] for n in names} == {final}
    finally:
        stop_all(procs)


@pytest.mark.slow
@pytest.mark.timeout(420)
@pytest.mark.parametrize("strategy", ["dreamddp", "streaming"])
def test_whole_cluster_stopped_steps_apart_resumes_together(tmp_path: Path, strategy: str) -> None:
    """Nodes stopped at different steps restart together: the newest saved state wins.

    Two strategies: the flagship, with its plans and control schedule, and one with outer state in
    flight. What differs per strategy is what it saves and what a joiner takes, and every strategy is
    checked there: a checkpoint resumes bit-identically in `tests/unit/test_strategy_logic.py`
    (`test_checkpoint_and_resume_continue_bit_identically`), and a killed member rejoins by state
    transfer in `tests/e2e/test_faults.py`. (Six strategies here cost 70 CPU-seconds of the suite.)

    The first node stopped leaves the other training alone without it, so that one stops later and holds a
    newer checkpoint. On restart the node holding the newest one resumes from it and the other joins it by
    state transfer; then both train on together to the step the test writes. (Two daemons, not three: each
    start costs ~2 CPU-seconds of imports. A third would add a second holder of the newest checkpoint that
    may find the cluster training and join it: `test_three_daemons_sigterm_checkpoint_and_resume` checks
    that a resuming node joins a cluster that trained on.)
    """
    task = {**TASK, "steps": 100_000}
    sync = {**SYNC, "strategy": strategy}
    # a floor on each step: a member left alone steps as fast as its core lets it until the test stops it
    train = {"min_step_s": 0.03}
    configs = write_configs(
        tmp_path, 2, rate_Bps=20e6, delay_s=0.002, sync=sync, task=task, checkpoint_every=10, train=train
    )
    for c in configs:  # a short grace: peers that already left will not come back to finish a round
        c.write_text("stop_grace_s = 3\n" + c.read_text())
    names = ("eu-west", "us-east")
    stop_at = tmp_path / "stop-at"
    procs = [start_node(c, stop_at_file=stop_at) for c in configs]

    def last(n: str, kind: str) -> dict[str, Any] | None:
        records = [r for r in read_records(tmp_path, n) if r["kind"] == kind]
        return records[-1] if records else None

    try:
        wait_progress(
            lambda: min(last_step(tmp_path, n) for n in names) >= 15, dict(zip(names, procs, strict=True)), tmp_path
        )
        procs[0].send_signal(signal.SIGTERM)
        wait_exits({names[0]: procs[0]}, tmp_path, 120)
        for p in procs[1:]:
            p.send_signal(signal.SIGTERM)
        wait_exits(dict(zip(names[1:], procs[1:], strict=True)), tmp_path, 120)
        stops = {n: last(n, "stop")["step"] for n in names}  # type: ignore[index]
        newest = max(stops.values())
        leaders = {n for n in names if stops[n] == newest}
        assert stops["eu-west"] < newest  # the others trained on without the first one

        procs = [start_node(c, resume=True, stop_at_file=stop_at) for c in configs]
        restarted = dict(zip(names, procs, strict=True))
        wait_progress(lambda: all(last(n, "resume") or last(n, "join") for n in names), restarted, tmp_path)
        stop_at.write_text(str(max(last_step(tmp_path, n) for n in names) + 40))
        wait_exits(dict(zip(names, procs, strict=True)), tmp_path, 300)
        final = int(stop_at.read_text())
        resumed = [n for n in names if last(n, "resume") is not None]
        # a node holding the newest checkpoint resumed from it; a second one may instead have found it
        # already training and joined it; a node with an older checkpoint never resumed from it
        assert resumed and set(resumed) <= leaders, (resumed, leaders, stops)
        for n in names:
            records = read_records(tmp_path, n)
            resume, join = last(n, "resume"), last(n, "join")
            if resume is not None:
                # resumed with exactly the parameters it saved at the newest step
                assert resume["step"] == newest
                saved = {r["step"]: r["digest"] for r in records if r["kind"] in ("checkpoint", "stop")}
                assert resume["digest"] == saved[newest], n
            else:
                assert join is not None and join["step"] > newest and join["resumed"] is True
            assert last_step(tmp_path, n) == final - 1
    finally:
        stop_all(procs)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_fresh_cluster_started_with_resume_trains_from_scratch(tmp_path: Path) -> None:
    """The deploy files always pass --resume: on a first start nobody has a checkpoint, so all start fresh.

    Having reached task.steps, the daemons flush (``[train] flush_at_end``): one model everywhere, made so
    through DreamDDP's compressed path (taken only where every member's outer weights agree)."""
    task = {**TASK, "steps": 30}
    configs = write_configs(tmp_path, 3, rate_Bps=20e6, delay_s=0.002, sync=SYNC, task=task, checkpoint_every=10)
    names = ("eu-west", "us-east", "ap-south")
    procs = [start_node(c, resume=True) for c in configs]
    try:
        wait_exits(dict(zip(names, procs, strict=True)), tmp_path, 240)
        stops = []
        for n in names:
            records = read_records(tmp_path, n)
            assert not [r for r in records if r["kind"] in ("resume", "join")]
            assert last_step(tmp_path, n) == task["steps"] - 1
            stops.append([r for r in records if r["kind"] == "stop"][-1])
        assert [s["flushed"] for s in stops] == ["compressed"] * 3
        assert len({s["digest"] for s in stops}) == 1
    finally:
        stop_all(procs)


@pytest.mark.parametrize(
    ("patch", "message"),
    [
        ({"sync": {"strategy": "fastest"}}, "strategy must be one of"),
        ({"sync": {"period": 0}}, "sync.period must be >= 1"),
        ({"task": {"colour": "red"}}, "unknown key task.colour"),
        ({"node": {"transport": {"rate_limit": "warp"}}}, "cannot parse link rate 'warp'"),
        ({"checkpoint": {"keep": 0}}, "checkpoint.every_steps and checkpoint.keep"),
        ({"metrics": {"listen": "9400"}}, "metrics.listen must look like 'host:port'"),
        ({"device": "tpu"}, "device must be one of auto, cpu, cuda"),
        ({"nodes": {}}, "unknown table or key 'nodes'"),
    ],
)
def test_bad_config_fails_at_start_naming_the_key(tmp_path: Path, patch: dict[str, object], message: str) -> None:
    import tomllib

    (config,) = write_configs(tmp_path, 1, rate_Bps=None, delay_s=0.0, sync={}, task={}, metrics=False)
    data = tomllib.loads(config.read_text())
    for key, value in patch.items():
        if isinstance(value, dict) and isinstance(data.get(key), dict):
            for k2, v2 in value.items():
                if isinstance(v2, dict):
                    data[key].setdefault(k2, {}).update(v2)
                else:
                    data[key][k2] = v2
        else:
            data[key] = value
    from dreamp2p.devtools.localrun import dump_toml

    top = {k: v for k, v in data.items() if not isinstance(v, dict)}
    tables = {k: v for k, v in data.items() if isinstance(v, dict)}
    config.write_text(dump_toml(tables, top))
    out = subprocess.run(
        [sys.executable, "-m", "dreamp2p.cli", "node", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 1
    assert message in out.stderr, out.stderr
