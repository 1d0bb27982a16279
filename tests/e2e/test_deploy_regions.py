"""The region examples (issue 11): a torchrun job per region on Kubernetes (GPUs) and in compose (CPU).

Each local rank k of a region listens on its region's peer, health and metrics ports plus k
(`dreamp2p.sync.comm.shards.rank_config`, `dreamp2p.service.region.rank_daemon_config`), so the examples must
give every rank's ports without collisions, ask for as many GPUs as they start ranks, probe rank 0's
health port, expose every rank's peer port, let torchrun restart a region whose rank died
(``--max-restarts``: it rejoins by state transfer) and resume a restarted container from the region's
checkpoint (``--resume``), never ``--join`` (a restarted region decides that itself).
"""

from __future__ import annotations

import shutil
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml  # type: ignore[import-untyped]

from dreamp2p.config import DaemonConfig

ROOT = Path(__file__).resolve().parents[2]
KUBECTL = shutil.which("kubectl")


def _port(address: str) -> int:
    return int(address.rpartition(":")[2])


def _nproc(argv: list[str]) -> int:
    return int(argv[argv.index("--nproc-per-node") + 1])


def _rank_ports(cfg: DaemonConfig, ranks: int) -> dict[str, list[int]]:
    """Every port the region's ranks listen on, by kind (rank k: the configured port + k)."""
    assert cfg.node.health_listen is not None and cfg.metrics.listen is not None
    bases = {"peer": cfg.node.listen, "health": cfg.node.health_listen, "metrics": cfg.metrics.listen}
    return {kind: [_port(addr) + k for k in range(ranks)] for kind, addr in bases.items()}


def _check_region_command(argv: list[str], cfg: DaemonConfig) -> dict[str, list[int]]:
    m = argv.index("-m")
    assert argv[m : m + 3] == ["-m", "dreamp2p", "node"] and "--standalone" in argv, argv
    assert int(argv[argv.index("--max-restarts") + 1]) >= 1, "a region whose rank died must come back"
    assert "--resume" in argv[m:] and "--join" not in argv, argv
    ports = _rank_ports(cfg, _nproc(argv))
    every = [p for kind in ports.values() for p in kind]
    assert len(every) == len(set(every)), f"two ranks' ports collide: {ports}"
    return ports


def _render(overlay: str) -> dict[str, dict[str, Any]]:
    assert KUBECTL is not None
    out = subprocess.run(
        [KUBECTL, "kustomize", str(ROOT / "deploy" / "k8s" / "overlays" / overlay)],
        check=True,
        capture_output=True,
        text=True,
        timeout=120,
    ).stdout
    docs = [d for d in yaml.safe_load_all(out) if d]
    return {f"{d['kind']}/{d['metadata']['name']}": d for d in docs}


@pytest.mark.skipif(KUBECTL is None, reason="kubectl is not installed (it builds the kustomize overlays)")
def test_gpu_region_runs_one_rank_per_requested_gpu_with_every_rank_reachable(monkeypatch: pytest.MonkeyPatch) -> None:
    objs = _render("region-gpus")
    pod = objs["StatefulSet/dreamp2p"]["spec"]["template"]
    (container,) = pod["spec"]["containers"]
    (config_volume,) = [v for v in pod["spec"]["volumes"] if v["name"] == "config"]
    monkeypatch.setenv("DREAMP2P_TOKEN", "test-token")
    toml = objs[f"ConfigMap/{config_volume['configMap']['name']}"]["data"]["node.toml"]
    cfg = DaemonConfig.from_dict(tomllib.loads(toml))
    assert cfg.device == "cuda"  # each rank: cuda:LOCAL_RANK
    argv = container["command"] + container["args"]
    assert argv[0] == "torchrun"
    ranks = _nproc(argv)
    assert ranks > 1
    resources = container["resources"]
    assert resources["requests"]["nvidia.com/gpu"] == resources["limits"]["nvidia.com/gpu"] == str(ranks)
    ports = _check_region_command(argv, cfg)
    declared = {p["containerPort"] for p in container["ports"]}
    assert set(ports["peer"]) | set(ports["health"]) | set(ports["metrics"]) <= declared
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["grpc"]["port"] == ports["health"][0], probe
    assert int(pod["metadata"]["annotations"]["prometheus.io/port"]) == ports["metrics"][0]
    lb = objs["Service/dreamp2p-peer"]["spec"]["ports"]
    assert sorted(p["port"] for p in lb) == ports["peer"]  # the other regions dial every rank
    assert container["image"].endswith("-cuda")
    assert any(m["mountPath"] == "/dev/shm" for m in container["volumeMounts"])  # NCCL's shared memory


def test_compose_regions_run_torchrun_regions_of_equal_size(monkeypatch: pytest.MonkeyPatch) -> None:
    compose = yaml.safe_load((ROOT / "deploy" / "compose-regions.yaml").read_text())
    monkeypatch.setenv("DREAMP2P_TOKEN", "test-token")
    sizes, ids = set(), set()
    for name, service in compose["services"].items():
        argv = service["entrypoint"] + service["command"]
        assert argv[0] == "torchrun", name
        (mount,) = [v for v in service["volumes"] if v.endswith(":/etc/dreamp2p/node.toml:ro")]
        cfg = DaemonConfig.from_dict(tomllib.loads((ROOT / "deploy" / mount.split(":")[0]).read_text()))
        assert cfg.device == "cpu", name
        ports = _check_region_command(argv, cfg)
        assert service["healthcheck"]["test"][-1].endswith(f":{ports['health'][0]}"), name
        published = {int(p.rsplit(":", 1)[1]) for p in service["ports"]}
        assert published <= set(ports["metrics"]), name
        assert cfg.node.node_id == service["hostname"] == name
        sizes.add(_nproc(argv))
        ids.add(tuple(sorted(p.node_id for p in cfg.node.ring)))
    assert len(sizes) == 1 and sizes != {1}, "every region runs the same number of ranks (more than one)"
    assert ids == {tuple(sorted(compose["services"]))}  # one ring, naming every region
