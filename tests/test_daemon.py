"""End to end: three `dreamp2p node` daemons from TOML configs on loopback (issue 4 acceptance)."""

from __future__ import annotations

import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from dreamp2p.checkpoint import list_checkpoints
from dreamp2p.daemon import DaemonConfig
from dreamp2p.localrun import last_step, read_records, start_node, wait_until, write_configs

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
    configs = write_configs(tmp_path, 3, rate_Bps=20e6, delay_s=0.002, sync=SYNC, task=TASK, checkpoint_every=10)
    procs = [start_node(c) for c in configs]
    try:
        # everyone trains together
        assert wait_until(lambda: min(last_step(tmp_path, n) for n in ("eu-west", "us-east", "ap-south")) >= 15, 180)

        # metrics endpoint, scraped over HTTP, carries the promised series
        cfg = DaemonConfig.from_toml(configs[0])
        assert cfg.metrics.listen is not None
        body = urllib.request.urlopen(f"http://{cfg.metrics.listen}/metrics", timeout=10).read().decode()
        for series in (
            "dreamp2p_step",
            "dreamp2p_loss",
            "dreamp2p_tokens_per_second",
            "dreamp2p_bytes_sent{",
            "dreamp2p_bytes_received{",
            "dreamp2p_link_goodput_bytes_per_second{",
            "dreamp2p_link_rtt_seconds{",
            "dreamp2p_exposed_wait_seconds_total",
            "dreamp2p_hidden_fraction",
            "dreamp2p_plan_version",
            "dreamp2p_rounds_failed",
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
        assert victim.wait(120) == 0
        stop = [r for r in read_records(tmp_path, "us-east") if r["kind"] == "stop"][-1]
        assert stop["signal"] == "SIGTERM"
        ckpts = list_checkpoints(tmp_path / "us-east" / "checkpoints")
        assert ckpts and ckpts[-1].name == f"ckpt-{stop['step']:010d}.pt"

        # restart with --resume: same step, same parameters, rejoins and the ring finishes the run
        procs[1] = start_node(configs[1], resume=True)
        for p in procs:
            assert p.wait(300) == 0
        resume = [r for r in read_records(tmp_path, "us-east") if r["kind"] == "resume"][-1]
        assert resume["step"] == stop["step"] and resume["digest"] == stop["digest"]
        for name in ("eu-west", "us-east", "ap-south"):
            records = read_records(tmp_path, name)
            assert last_step(tmp_path, name) == TASK["steps"] - 1
            evals = [r["eval_loss"] for r in records if r["kind"] == "eval"]
            assert evals[-1] < evals[0]
    finally:
        stop_all(procs)


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_whole_cluster_stopped_steps_apart_resumes_together(tmp_path: Path) -> None:
    """Nodes stopped at different steps (rounds aborted after the grace) agree on a common checkpoint."""
    configs = write_configs(tmp_path, 3, rate_Bps=20e6, delay_s=0.002, sync=SYNC, task=TASK, checkpoint_every=10)
    for c in configs:  # a short grace: peers that already left will not come back to finish a round
        c.write_text("stop_grace_s = 3\n" + c.read_text())
    names = ("eu-west", "us-east", "ap-south")
    procs = [start_node(c) for c in configs]
    try:
        assert wait_until(lambda: min(last_step(tmp_path, n) for n in names) >= 15, 180)
        procs[0].send_signal(signal.SIGTERM)
        assert procs[0].wait(120) == 0
        for p in procs[1:]:
            p.send_signal(signal.SIGTERM)
        assert [p.wait(120) for p in procs[1:]] == [0, 0]
        stops = {n: [r for r in read_records(tmp_path, n) if r["kind"] == "stop"][-1]["step"] for n in names}
        procs = [start_node(c, resume=True) for c in configs]
        assert [p.wait(300) for p in procs] == [0, 0, 0]
        resumed = {n: [r for r in read_records(tmp_path, n) if r["kind"] == "resume"][-1]["step"] for n in names}
        assert len(set(resumed.values())) == 1, (stops, resumed)
        assert resumed["eu-west"] <= min(stops.values())
        assert all(last_step(tmp_path, n) == TASK["steps"] - 1 for n in names)
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
    from dreamp2p.localrun import dump_toml

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
