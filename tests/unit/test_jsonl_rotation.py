"""metrics.jsonl stays within its budget: parts rotate, the newest records stay, readers see them in order."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dreamp2p.service.jsonl import RotatingJsonl, jsonl_parts


def records(path: Path) -> list[int]:
    return [json.loads(line)["i"] for part in jsonl_parts(path) for line in part.read_text().splitlines()]


@pytest.mark.parametrize(("max_bytes", "files"), [(1000, 4), (1000, 1), (300, 3), (5000, 2)])
def test_the_newest_records_stay_within_the_budget(tmp_path: Path, max_bytes: int, files: int) -> None:
    path = tmp_path / "metrics.jsonl"
    log = RotatingJsonl(path, max_bytes, files)
    for i in range(500):
        log.write({"i": i, "pad": "x" * 20})
    log.close()
    parts = jsonl_parts(path)
    assert 1 <= len(parts) <= files and parts[-1] == path
    assert sum(p.stat().st_size for p in parts) <= max_bytes
    kept = records(path)
    # the newest records, in order, without a gap: only the oldest were dropped
    assert kept == list(range(500 - len(kept), 500)) and len(kept) > 0
    record_bytes = len(json.dumps({"i": 499, "pad": "x" * 20})) + 1
    if files > 1:  # all but the part being filled are full: nearly the whole budget is kept
        assert len(kept) * record_bytes >= max_bytes * (files - 1) / files - files * record_bytes


def test_a_reopened_log_counts_what_is_already_there(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    log = RotatingJsonl(path, 400, 2)
    for i in range(5):
        log.write({"i": i})
    log.close()
    size = path.stat().st_size
    log = RotatingJsonl(path, 400, 2)  # a restarted node appends to the same file
    for i in range(5, 100):
        log.write({"i": i})
    log.close()
    assert size > 0 and records(path)[-1] == 99
    assert all(p.stat().st_size <= 200 for p in jsonl_parts(path))


def test_a_record_larger_than_a_part_still_gets_written(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    log = RotatingJsonl(path, 20, 2)
    log.write({"i": 0, "pad": "y" * 100})
    log.write({"i": 1, "pad": "y" * 100})
    log.close()
    assert records(path) == [0, 1]  # each in a part of its own


def test_parts_are_listed_oldest_first_and_strangers_ignored(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    for name in ("metrics.jsonl", "metrics.jsonl.1", "metrics.jsonl.2", "metrics.jsonl.10", "metrics.jsonl.tmp"):
        (tmp_path / name).write_text("")
    assert [p.name for p in jsonl_parts(path)] == [
        "metrics.jsonl.10",
        "metrics.jsonl.2",
        "metrics.jsonl.1",
        "metrics.jsonl",
    ]
    assert jsonl_parts(tmp_path / "absent.jsonl") == []


def test_bad_budgets_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        RotatingJsonl(tmp_path / "m.jsonl", 0, 1)
    with pytest.raises(ValueError):
        RotatingJsonl(tmp_path / "m.jsonl", 100, 0)


def test_the_report_and_the_local_runner_read_every_part(tmp_path: Path) -> None:
    from dreamp2p.devtools.localrun import last_step, read_records
    from dreamp2p.devtools.report.runlog import load_run
    from dreamp2p.service.metrics import NodeMetrics, RecordKind

    metrics = NodeMetrics("n0", tmp_path, max_bytes=2000, files=3)
    for step in range(40):
        metrics.record(RecordKind.STEP, step=step, loss=1.0 / (step + 1))
    metrics.close()
    parts = jsonl_parts(tmp_path / "n0" / "metrics.jsonl")
    assert len(parts) == 3  # rotated: the oldest steps are gone, the newest are spread over every part
    steps = [r["step"] for r in read_records(tmp_path, "n0")]
    assert steps == list(range(40 - len(steps), 40)) and len(steps) < 40
    assert last_step(tmp_path, "n0") == 39
    assert [r["step"] for r in load_run(tmp_path)["n0"].steps] == steps
