"""The built wheel: ranged dependencies and the SPDX license in its metadata, installs into a fresh venv (#13).

Offline: the wheel is built without build isolation (this venv's setuptools) from a copy of the sources,
and installed with ``--no-index --no-deps``; ``dreamp2p --version`` needs none of the dependencies.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import venv
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[2]


def build_wheel(dest: Path) -> Path:
    """``pip wheel`` a copy of what the Dockerfile's build stage copies (the shared checkout stays untouched)."""
    src = dest / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy2(ROOT / name, src / name)
    shutil.copytree(ROOT / "dreamp2p", src / "dreamp2p", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    wheels = dest / "wheels"
    offline = ["--no-deps", "--no-build-isolation", "--no-index", "-q"]
    subprocess.run([sys.executable, "-m", "pip", "wheel", *offline, "-w", wheels, src], check=True, timeout=240)
    (wheel,) = wheels.glob("dreamp2p-*.whl")
    return wheel


def wheel_metadata(wheel: Path) -> tuple[dict[str, list[str]], list[str]]:
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        (meta,) = [n for n in names if n.endswith(".dist-info/METADATA")]
        msg = Parser().parsestr(z.read(meta).decode())
    fields = {key: msg.get_all(key) or [] for key in ("Requires-Dist", "License-Expression", "License-File")}
    return fields, names


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_wheel_metadata_and_fresh_venv_install(tmp_path: Path) -> None:
    wheel = build_wheel(tmp_path)
    fields, names = wheel_metadata(wheel)

    assert fields["License-Expression"] == ["Apache-2.0"]
    assert fields["License-File"] == ["LICENSE"]
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    runtime = [Requirement(r) for r in fields["Requires-Dist"]]
    runtime = [r for r in runtime if r.marker is None or "extra" not in str(r.marker)]
    by_name = {r.name: r for r in runtime}
    # ranges, not pins: pip install dreamp2p beside another torch must not fail or swap it out
    assert not [str(r) for r in runtime if any(s.operator in ("==", "===") for s in r.specifier)]
    assert by_name["torch"].specifier.contains("2.4.0") and by_name["torch"].specifier.contains("2.13.0")
    for name in ("grpcio", "grpcio-health-checking"):
        assert by_name[name].specifier.contains("1.85.1") and not by_name[name].specifier.contains("2.0.0")
    # the generated stubs check these floors at import: the ranges must not admit what they refuse
    stubs = (ROOT / "dreamp2p" / "v1" / "peer_pb2_grpc.py").read_text()
    assert "GRPC_GENERATED_VERSION = '1.85.1'" in stubs
    assert not by_name["grpcio"].specifier.contains("1.85.0")
    assert not by_name["protobuf"].specifier.contains("7.35.0") and by_name["protobuf"].specifier.contains("7.35.1")

    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    py, cli = env_dir / "bin" / "python", env_dir / "bin" / "dreamp2p"
    subprocess.run(
        [py, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--find-links", wheel.parent, "dreamp2p"],
        check=True,
        timeout=120,
    )
    # cwd outside the checkout, so the installed package is what imports
    out = subprocess.run(
        [py, "-c", "import importlib.metadata as m, dreamp2p; print(m.version('dreamp2p'), dreamp2p.__file__)"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        check=True,
        timeout=60,
    ).stdout.split()
    assert out[0] == "0.1.0"
    assert Path(out[1]).is_relative_to(env_dir)
    version = subprocess.run([cli, "--version"], capture_output=True, text=True, cwd=tmp_path, timeout=60, check=False)
    assert version.returncode == 0, version.stderr
    assert version.stdout.startswith("dreamp2p 0.1.0 (wire protocol ")
