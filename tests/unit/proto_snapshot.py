"""The wire-relevant shape of peer.proto as plain data, and the pure check that a new shape keeps an old one.

A snapshot names, per message, each field's number, type, label and message/enum type; per enum, each
value's number; per service, each method's types and streaming flags. ``problems(old, new)`` lists what in
``new`` would break a peer built from ``old``: a field number gone or changed in type/label/type name, an
enum number gone, a method gone or changed. Field and value names may change (the wire carries numbers).
The committed snapshot is proto/dreamp2p/v1/peer.descriptor.json; after a compatible change, rewrite it
with ``.venv/bin/python tests/unit/proto_snapshot.py`` and commit it beside the proto.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from google.protobuf import descriptor_pb2

ROOT = Path(__file__).resolve().parents[2]
PROTO = ROOT / "proto" / "dreamp2p" / "v1" / "peer.proto"
SNAPSHOT = ROOT / "proto" / "dreamp2p" / "v1" / "peer.descriptor.json"

Snapshot = dict[str, dict[str, Any]]


def compile_proto(proto: Path = PROTO, include: Path = ROOT / "proto") -> descriptor_pb2.FileDescriptorProto:
    """protoc (grpcio-tools, a dev dependency) parses the proto into a descriptor."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "set.pb"
        subprocess.run(
            [sys.executable, "-m", "grpc_tools.protoc", f"-I{include}", f"--descriptor_set_out={out}", str(proto)],
            check=True,
            capture_output=True,
            timeout=120,
        )
        fds = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes())
    (fd,) = fds.file
    return fd


def _messages(prefix: str, msgs: Any, out: dict[str, Any], enums: dict[str, Any]) -> None:
    for m in msgs:
        name = f"{prefix}.{m.name}"
        out[name] = {
            str(f.number): {
                "name": f.name,
                "type": descriptor_pb2.FieldDescriptorProto.Type.Name(f.type),
                "label": descriptor_pb2.FieldDescriptorProto.Label.Name(f.label),
                "type_name": f.type_name,
            }
            for f in m.field
        }
        _enums(name, m.enum_type, enums)
        _messages(name, m.nested_type, out, enums)


def _enums(prefix: str, items: Any, out: dict[str, Any]) -> None:
    for e in items:
        out[f"{prefix}.{e.name}"] = {str(v.number): v.name for v in e.value}


def summarize(fd: descriptor_pb2.FileDescriptorProto) -> Snapshot:
    """The snapshot of one file descriptor (JSON-ready: keys are strings)."""
    prefix = f".{fd.package}"
    messages: dict[str, Any] = {}
    enums: dict[str, Any] = {}
    _enums(prefix, fd.enum_type, enums)
    _messages(prefix, fd.message_type, messages, enums)
    services = {
        f"{prefix}.{s.name}": {
            m.name: {
                "input": m.input_type,
                "output": m.output_type,
                "client_streaming": m.client_streaming,
                "server_streaming": m.server_streaming,
            }
            for m in s.method
        }
        for s in fd.service
    }
    return {"messages": messages, "enums": enums, "services": services}


def problems(old: Snapshot, new: Snapshot) -> list[str]:
    """What in ``new`` breaks a peer built from ``old`` (empty: compatible)."""
    out: list[str] = []
    for msg, fields in old["messages"].items():
        if msg not in new["messages"]:
            out.append(f"message {msg} removed")
            continue
        for number, field in fields.items():
            now = new["messages"][msg].get(number)
            if now is None:
                out.append(f"{msg} field {number} ({field['name']}) removed")
                continue
            for key in ("type", "label", "type_name"):
                if now[key] != field[key]:
                    out.append(f"{msg} field {number} ({field['name']}): {key} {field[key]} -> {now[key]}")
    for enum, values in old["enums"].items():
        if enum not in new["enums"]:
            out.append(f"enum {enum} removed")
            continue
        out.extend(f"{enum} value {n} ({name}) removed" for n, name in values.items() if n not in new["enums"][enum])
    for svc, methods in old["services"].items():
        for method, sig in methods.items():
            now = new["services"].get(svc, {}).get(method)
            if now != sig:
                out.append(f"{svc}.{method}: {sig} -> {now}")
    return out


def main() -> None:
    SNAPSHOT.write_text(json.dumps(summarize(compile_proto()), indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
