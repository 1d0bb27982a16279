"""The committed stubs must be exactly what grpcio-tools generates from proto/: stale stubs cannot ship."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import grpc

import dreamp2p.v1.peer_pb2 as pb

ROOT = Path(__file__).resolve().parents[2]
STUBS = ["peer_pb2.py", "peer_pb2.pyi", "peer_pb2_grpc.py"]


def test_stubs_match_proto(tmp_path: Path) -> None:
    subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            f"-I{ROOT / 'proto'}",
            f"--python_out={tmp_path}",
            f"--pyi_out={tmp_path}",
            f"--grpc_python_out={tmp_path}",
            str(ROOT / "proto/dreamp2p/v1/peer.proto"),
        ],
        check=True,
    )
    for name in STUBS:
        fresh = (tmp_path / "dreamp2p/v1" / name).read_text()
        committed = (ROOT / "dreamp2p/v1" / name).read_text()
        assert fresh == committed, f"dreamp2p/v1/{name} is stale: run `make proto`"


def test_grpc_tools_pinned_to_grpcio() -> None:
    import grpc_tools

    version = getattr(grpc_tools, "__version__", None)
    if version is None:
        from importlib.metadata import version as dist_version

        version = dist_version("grpcio-tools")
    assert version == grpc.__version__


def test_status_enum_mirrors_proto() -> None:
    from dreamp2p.errors import Status

    for status in Status:
        assert pb.StatusCode.Value(f"STATUS_{status.name}") == status.value
    assert len(pb.StatusCode.keys()) == len(Status)
