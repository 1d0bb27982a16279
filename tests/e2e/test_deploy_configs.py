"""The shipped node configs load, and their TLS files are exactly what deploy/tls/make-certs.sh writes.

Configs: nodes/*.toml, deploy/nodes-compose/*.toml (the files deploy/compose.yaml mounts), the node.toml in
the kustomize base's and overlays' node.toml files (deploy/k8s/) and the example in deploy/README.md, each through
:meth:`DaemonConfig.from_dict` (what ``dreamp2p node --config`` runs). A node's certificate is made for the
host it is dialled by (the host of ``advertise``), so its ``[node.tls]`` files must be the ones the script
writes for that host, under the script's names: no renaming step between the two.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest

from dreamp2p.config import DaemonConfig

ROOT = Path(__file__).resolve().parents[2]
MAKE_CERTS = ROOT / "deploy" / "tls" / "make-certs.sh"
COMPOSE = ROOT / "deploy" / "compose.yaml"
K8S = ROOT / "deploy" / "k8s"
README = ROOT / "deploy" / "README.md"


def _readme_toml(text: str) -> list[str]:
    return re.findall(r"```toml\n(.*?)```", text, flags=re.DOTALL)


def shipped_configs() -> dict[str, str]:
    """Every node config the repository ships, by where it lives: name -> TOML text."""
    out = {str(p.relative_to(ROOT)): p.read_text() for p in sorted((ROOT / "nodes").glob("*.toml"))}
    mounted = re.findall(r"\./(nodes-compose/[\w.-]+\.toml):", COMPOSE.read_text())
    assert mounted, "deploy/compose.yaml mounts no node config"
    for rel in mounted:
        path = ROOT / "deploy" / rel
        assert path.exists(), f"deploy/compose.yaml mounts {rel}, which does not exist"
        out[str(path.relative_to(ROOT))] = path.read_text()
    extra = set((ROOT / "deploy" / "nodes-compose").glob("*.toml")) - {ROOT / "deploy" / r for r in mounted}
    assert not extra, f"not mounted by deploy/compose.yaml: {sorted(map(str, extra))}"
    k8s = sorted(K8S.rglob("node.toml"))
    assert len(k8s) >= 2, "deploy/k8s has no node.toml for its base and region overlays"
    out.update({str(p.relative_to(ROOT)): p.read_text() for p in k8s})
    blocks = _readme_toml(README.read_text())
    assert blocks, "deploy/README.md has no toml example"
    for i, block in enumerate(blocks):
        out[f"deploy/README.md (toml example {i})"] = block
    return out


def _host(address: str) -> str:
    if address.startswith("["):
        return address[1:].partition("]")[0]
    return address.rpartition(":")[0] if ":" in address else address


def _files_from_running(host: str, tmp: Path) -> set[str]:
    out = tmp / host
    subprocess.run(
        ["bash", str(MAKE_CERTS), "--out", str(out), "--days", "2", host],
        check=True,
        capture_output=True,
        timeout=60,
    )
    return {p.name for p in out.iterdir()}


def _files_from_script(host: str) -> set[str]:
    """Without openssl: the names the script's final ``mv ... "$out/NAME"`` commands write."""
    targets = re.findall(r'^\s*mv "\$tmp/[^"]+" "\$out/([^"]+)"', MAKE_CERTS.read_text(), flags=re.MULTILINE)
    assert targets, "no output file names found in make-certs.sh"
    return {t.replace("$first", host.replace(":", "_")) for t in targets}


def test_shipped_configs_load_and_name_the_tls_files_make_certs_writes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DREAMP2P_TOKEN", "test-token")  # the configs read the token from it
    have_openssl = shutil.which("openssl") is not None
    produced: dict[str, set[str]] = {}
    with_tls = 0
    for where, text in shipped_configs().items():
        cfg = DaemonConfig.from_dict(tomllib.loads(text))
        tls = cfg.node.tls
        if tls is None:
            assert cfg.node.allow_insecure, f"{where}: no [node.tls] and no allow_insecure"
            continue
        with_tls += 1
        assert cfg.node.advertise, f"{where}: a TLS node should advertise the name its certificate carries"
        host = _host(cfg.node.advertise)
        if host not in produced:
            produced[host] = _files_from_running(host, tmp_path) if have_openssl else _files_from_script(host)
        files = produced[host]
        assert tls.ca_file is not None, where
        named = {"cert_file": tls.cert_file, "key_file": tls.key_file, "ca_file": tls.ca_file}
        assert len({Path(p).parent for p in named.values()}) == 1, f"{where}: TLS files in different folders"
        for key, path in named.items():
            assert Path(path).name in files, f"{where}: {key} {path!r}; make-certs.sh {host} writes {sorted(files)}"
        assert len({Path(p).name for p in named.values()}) == 3, f"{where}: {named}"
        # the one file left over is the CA's private key, which stays off the nodes
        (left,) = files - {Path(p).name for p in named.values()}
        if have_openssl:
            out = tmp_path / host
            assert "PRIVATE KEY" in (out / left).read_text()
            assert "BEGIN CERTIFICATE" in (out / Path(tls.cert_file).name).read_text()
            assert "PRIVATE KEY" in (out / Path(tls.key_file).name).read_text()
            assert "BEGIN CERTIFICATE" in (out / Path(tls.ca_file).name).read_text()
            # the node's certificate is the one issued to the host, not the CA's
            subject = subprocess.run(
                ["openssl", "x509", "-noout", "-subject", "-in", str(out / Path(tls.cert_file).name)],
                check=True,
                capture_output=True,
                text=True,
                timeout=30,
            ).stdout
            assert host in subject, f"{where}: {tls.cert_file} is not {host}'s certificate ({subject.strip()})"
    assert with_tls >= 3, "expected the nodes/ configs, the k8s node.toml files and the README example to use TLS"
