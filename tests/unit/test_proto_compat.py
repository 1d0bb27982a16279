"""peer.proto stays wire-compatible: with the committed descriptor snapshot (always) and, through
``buf breaking``, with the previous commit's proto (where buf and git can run).

The snapshot check is pure Python (protoc from grpcio-tools parses the proto; proto_snapshot.problems
compares). ``buf breaking`` (WIRE_JSON rules, buf.yaml) is the second opinion on the last change.
"""

from __future__ import annotations

import copy
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from proto_snapshot import PROTO, ROOT, SNAPSHOT, Snapshot, compile_proto, problems, summarize

BUF = shutil.which("buf", path=str(Path(sys.executable).parent)) or shutil.which("buf")


@pytest.fixture(scope="module")
def current() -> Snapshot:
    return summarize(compile_proto())


def test_current_proto_keeps_the_committed_snapshot(current: Snapshot) -> None:
    old = json.loads(SNAPSHOT.read_text())
    assert old["messages"] and old["enums"] and old["services"]
    assert problems(old, current) == []


def _edit(snap: Snapshot, path: tuple[str, ...], value: Any) -> Snapshot:
    out = copy.deepcopy(snap)
    node = out
    for key in path[:-1]:
        node = node[key]
    if value is None:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    return out


FRAME = ".dreamp2p.v1.DataFrame"
STATUS = ".dreamp2p.v1.StatusCode"
PEER = ".dreamp2p.v1.Peer"


@pytest.mark.parametrize(
    ("path", "value", "expect"),
    [
        (("messages", FRAME, "1"), None, "field 1"),
        (("messages", FRAME, "1", "type"), "TYPE_FIXED64", "type"),
        (("messages", FRAME, "1", "label"), "LABEL_REPEATED", "label"),
        (("messages", FRAME), None, "message"),
        (("enums", STATUS, "1"), None, "value 1"),
        (("enums", STATUS), None, "enum"),
        (("services", PEER, "Push"), None, "Push"),
        (("services", PEER, "Push", "client_streaming"), False, "Push"),
    ],
)
def test_problems_names_each_breaking_change(current: Snapshot, path: tuple[str, ...], value: Any, expect: str) -> None:
    found = problems(current, _edit(current, path, value))
    assert len(found) >= 1 and expect in found[0], found


@pytest.mark.parametrize(
    ("path", "value"),
    [
        (("messages", FRAME, "999"), {"name": "new", "type": "TYPE_BOOL", "label": "LABEL_OPTIONAL", "type_name": ""}),
        (("messages", FRAME, "1", "name"), "renamed"),  # the wire carries numbers
        (("enums", STATUS, "999"), "STATUS_NEW"),
        (("services", PEER, "NewRpc"), {"input": "x", "output": "y"}),
    ],
)
def test_problems_allows_additions_and_renames(current: Snapshot, path: tuple[str, ...], value: Any) -> None:
    assert problems(current, _edit(current, path, value)) == []


def _previous_proto(tmp: Path) -> Path:
    """HEAD~1's proto tree, with this checkout's buf.yaml, in a folder laid out like the repository."""
    rel = PROTO.relative_to(ROOT)
    try:
        text = subprocess.run(
            ["git", "-C", str(ROOT), "show", f"HEAD~1:{rel}"], check=True, capture_output=True, text=True, timeout=60
        ).stdout
    except (OSError, subprocess.CalledProcessError) as exc:
        pytest.skip(f"git cannot show HEAD~1:{rel} (not a git checkout, or a shallow one): {exc}")
    (tmp / rel).parent.mkdir(parents=True)
    (tmp / rel).write_text(text)
    shutil.copy(ROOT / "buf.yaml", tmp / "buf.yaml")
    return tmp


def _buf_breaking(against: Path) -> subprocess.CompletedProcess[str]:
    assert BUF is not None
    return subprocess.run(
        [BUF, "breaking", str(ROOT), "--against", str(against)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


@pytest.mark.skipif(BUF is None, reason="buf is not installed (pip install buf-bin, in the dev dependencies)")
def test_buf_breaking_against_the_previous_commit(tmp_path: Path) -> None:
    res = _buf_breaking(_previous_proto(tmp_path))
    assert res.returncode == 0, res.stdout + res.stderr


@pytest.mark.skipif(BUF is None, reason="buf is not installed (pip install buf-bin, in the dev dependencies)")
def test_buf_breaking_catches_a_renumbered_field(tmp_path: Path) -> None:
    """The check above can fail: a proto whose field 1 of DataFrame has another number is reported."""
    rel = PROTO.relative_to(ROOT)
    (tmp_path / rel).parent.mkdir(parents=True)
    text = PROTO.read_text()
    start = text.index("message DataFrame {")
    body = text[start:]
    line = next(ln for ln in body.splitlines() if ln.rstrip().endswith("= 1;"))
    (tmp_path / rel).write_text(text[:start] + body.replace(line, line.replace("= 1;", "= 9999;"), 1))
    shutil.copy(ROOT / "buf.yaml", tmp_path / "buf.yaml")
    res = _buf_breaking(tmp_path)
    assert res.returncode != 0 and "DataFrame" in res.stdout + res.stderr, res.stdout + res.stderr
