"""The kustomize overlays (deploy/k8s/overlays/*) render, and what they render hangs together.

Each overlay is built with ``kubectl kustomize`` (skipped where kubectl is absent); the rendered
StatefulSet's gRPC probes target the port of ``health_listen`` in the ConfigMap's node.toml it mounts, its
Prometheus annotations name the ``[metrics] listen`` port, it has requests and limits, and the gpu overlay
asks for a GPU with the CUDA image. The compose rehearsal shapes its links in-process by default.
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
OVERLAYS = ROOT / "deploy" / "k8s" / "overlays"
KUBECTL = shutil.which("kubectl")


def _render(overlay: str) -> dict[str, dict[str, Any]]:
    assert KUBECTL is not None
    out = subprocess.run(
        [KUBECTL, "kustomize", str(OVERLAYS / overlay)], check=True, capture_output=True, text=True, timeout=120
    ).stdout
    docs = [d for d in yaml.safe_load_all(out) if d]
    return {f"{d['kind']}/{d['metadata']['name']}": d for d in docs}


def _port(address: str) -> int:
    return int(address.rpartition(":")[2])


@pytest.mark.skipif(KUBECTL is None, reason="kubectl is not installed (it builds the kustomize overlays)")
@pytest.mark.parametrize("overlay", ["region-a", "region-b", "gpu"])
def test_overlay_renders_a_consistent_node(overlay: str, monkeypatch: pytest.MonkeyPatch) -> None:
    objs = _render(overlay)
    sts = objs["StatefulSet/dreamp2p"]
    pod = sts["spec"]["template"]
    (container,) = pod["spec"]["containers"]
    (config_volume,) = [v for v in pod["spec"]["volumes"] if v["name"] == "config"]
    config_map = objs[f"ConfigMap/{config_volume['configMap']['name']}"]  # the hashed name kustomize wrote
    monkeypatch.setenv("DREAMP2P_TOKEN", "test-token")
    cfg = DaemonConfig.from_dict(tomllib.loads(config_map["data"]["node.toml"]))
    assert cfg.node.health_listen is not None
    health = _port(cfg.node.health_listen)
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["grpc"]["port"] == health, probe
    annotations = pod["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert cfg.metrics.listen is not None
    assert int(annotations["prometheus.io/port"]) == _port(cfg.metrics.listen)
    resources = container["resources"]
    assert {"cpu", "memory"} <= set(resources["requests"]) and {"cpu", "memory"} <= set(resources["limits"])
    secrets = {v["secret"]["secretName"] for v in pod["spec"]["volumes"] if "secret" in v}
    secrets |= {e["valueFrom"]["secretKeyRef"]["name"] for e in container["env"] if "valueFrom" in e}
    assert secrets == {"dreamp2p-tls", "dreamp2p-token"}
    assert not any(k.startswith("Secret/") for k in objs), "secrets are referenced, never rendered"
    gpu = resources["limits"].get("nvidia.com/gpu")
    assert (gpu == "1") == (overlay == "gpu"), resources
    assert container["image"].endswith("-cuda") == (overlay == "gpu"), container["image"]


@pytest.mark.skipif(KUBECTL is None, reason="kubectl is not installed (it builds the kustomize overlays)")
def test_region_overlays_differ_in_node_and_admitted_peers() -> None:
    a, b = _render("region-a"), _render("region-b")

    def node_id(objs: dict[str, dict[str, Any]]) -> str:
        (cm,) = [v for k, v in objs.items() if k.startswith("ConfigMap/dreamp2p-config")]
        return str(tomllib.loads(cm["data"]["node.toml"])["node"]["node_id"])

    assert node_id(a) != node_id(b)
    ranges = [o["Service/dreamp2p-peer"]["spec"]["loadBalancerSourceRanges"] for o in (a, b)]
    assert ranges[0] != ranges[1]


def test_compose_rehearsal_shapes_links_and_restarts_on_failure(monkeypatch: pytest.MonkeyPatch) -> None:
    compose = yaml.safe_load((ROOT / "deploy" / "compose.yaml").read_text())
    monkeypatch.setenv("DREAMP2P_TOKEN", "test-token")
    for name, service in compose["services"].items():
        assert service["restart"] == "on-failure", name
        (mount,) = [v for v in service["volumes"] if v.endswith(":/etc/dreamp2p/node.toml:ro")]
        path = ROOT / "deploy" / mount.split(":")[0]
        cfg = DaemonConfig.from_dict(tomllib.loads(path.read_text()))
        assert cfg.node.transport.rate_limit is not None and cfg.node.transport.rate_limit > 0, name
        assert cfg.node.transport.delay_s > 0, name
