"""The run folder's files, and reading the nodes' logs from it (`load_run`).

A run directory holds one sub-directory per node, written by the node daemons (``[metrics] run_dir``; the
demo and `bench chaos --run-dir` set it to their folder): ``metrics.jsonl`` (one JSON record per line, by
kind: see `dreamp2p.service.metrics.RecordKind`; with its rotated older parts ``metrics.jsonl.1`` ... when a
long run filled its budget, `dreamp2p.service.jsonl`) and ``plan.json`` (DreamDDP only). One node's own
sub-directory may be given instead: it is a run of that node alone.
Malformed lines are skipped with one warning per file (a daemon may be appending a line while the report is
read); see the package docstring (`dreamp2p.devtools.report`) for the record fields.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dreamp2p.service.jsonl import jsonl_parts
from dreamp2p.service.metrics import RecordKind

log = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
PLAN_FILE = "plan.json"
LOSS_PNG = "loss_vs_time.png"
LINK_PNG = "link_bandwidth.png"
GANTT_PNG = "schedule_gantt.png"
SUMMARY_JSON = "summary.json"
EMPTY_RUN_MESSAGE = (
    "no node logs in {run}: expected metrics.jsonl or plan.json in one sub-directory per node (a demo's folder, "
    "bench chaos --run-dir, a daemon's [metrics] run_dir) or in the folder itself (one node's)"
)


@dataclass
class NodeLog:
    """Parsed records of one node, each list sorted by ``t``; ``plan`` is plan.json as read (None if absent)."""

    steps: list[dict[str, Any]] = field(default_factory=list)
    evals: list[dict[str, Any]] = field(default_factory=list)
    links: list[dict[str, Any]] = field(default_factory=list)
    plan: dict[str, Any] | None = None


def _is_real(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_time(value: object) -> bool:
    return _is_real(value) and math.isfinite(value)  # type: ignore[arg-type]


def _is_peer(value: object) -> bool:
    return isinstance(value, str) and bool(value)


_Check = Callable[[object], bool]
# Fields each kind must have, then fields it may have; numbers are stored as float, ints as int.
_REQUIRED: dict[str, dict[str, _Check]] = {
    RecordKind.STEP: {"t": _is_time, "step": _is_int, "loss": _is_real},
    RecordKind.EVAL: {"t": _is_time, "step": _is_int, "eval_loss": _is_real},
    RecordKind.LINK: {"t": _is_time, "peer": _is_peer, "goodput_Bps": _is_real, "rtt_s": _is_real},
}
_OPTIONAL: dict[str, dict[str, _Check]] = {
    RecordKind.STEP: {
        "tokens_per_s": _is_real,
        "exposed_s": _is_real,
        "comm_s": _is_real,
        "hidden_fraction": _is_real,
        "bytes_sent": _is_real,
        "plan_version": _is_int,
    },
    RecordKind.EVAL: {},
    RecordKind.LINK: {},
}


# Records the daemon writes about its own lifecycle: known, but not plotted.
_LIFECYCLE = frozenset(set(RecordKind) - set(_REQUIRED))


def _parse_record(line: str) -> tuple[str, dict[str, Any] | None, str]:
    """(kind, normalized record or None, why it was refused) of one non-blank line."""
    try:
        raw = json.loads(line)
    except json.JSONDecodeError as exc:
        return "", None, f"not JSON ({exc.msg})"
    except (ValueError, RecursionError) as exc:
        return "", None, f"not JSON ({exc})"
    if not isinstance(raw, dict):
        return "", None, f"a JSON {type(raw).__name__}, not an object"
    kind = raw.get("kind")
    if kind in _LIFECYCLE:
        return "-", None, ""
    if not isinstance(kind, str) or kind not in _REQUIRED:
        return "?", None, f"unknown kind {kind!r}"
    rec: dict[str, Any] = {"kind": kind}
    for name, check in _REQUIRED[kind].items():
        if name not in raw:
            return kind, None, f"{kind} record lacks {name!r}"
        if not check(raw[name]):
            return kind, None, f"{kind} record has a bad {name!r}: {raw[name]!r}"
        rec[name] = raw[name]
    for name, check in _OPTIONAL[kind].items():
        if name in raw and raw[name] is not None:
            if not check(raw[name]):
                return kind, None, f"{kind} record has a bad {name!r}: {raw[name]!r}"
            rec[name] = raw[name]
    for name, value in rec.items():
        if name == "t" or (_is_real(value) and not _is_int(value)):
            rec[name] = float(value)
    return kind, rec, ""


def _read_metrics(path: Path, node: NodeLog) -> None:
    malformed = unknown = total = 0
    first_problem = ""
    with path.open("r", encoding="utf-8", errors="replace") as fh:
        for lineno, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            total += 1
            kind, rec, why = _parse_record(line)
            if kind == "-":
                continue
            if rec is None:
                if kind == "?":
                    unknown += 1
                else:
                    malformed += 1
                if not first_problem:
                    first_problem = f"line {lineno}: {why}"
                continue
            {"step": node.steps, "eval": node.evals, "link": node.links}[kind].append(rec)
    if malformed or unknown:
        log.warning(
            "%s: skipped %d of %d lines (%d malformed, %d of unknown kind); first at %s",
            path,
            malformed + unknown,
            total,
            malformed,
            unknown,
            first_problem,
        )
    for records in (node.steps, node.evals, node.links):
        records.sort(key=lambda r: r["t"])  # stable: equal times keep file order


def _read_plan(path: Path) -> dict[str, Any] | None:
    try:
        raw = json.loads(path.read_text(encoding="utf-8", errors="replace"))
    except (OSError, ValueError) as exc:
        log.warning("%s: unreadable plan, ignored (%s)", path, exc)
        return None
    if not isinstance(raw, dict) or not isinstance(raw.get("plan"), dict):
        log.warning("%s: not a plan file (expected an object with a 'plan' object), ignored", path)
        return None
    return raw


def _read_node(folder: Path) -> NodeLog | None:
    """One node's records and plan from its folder; None when it holds neither file."""
    metrics, plan = folder / METRICS_FILE, folder / PLAN_FILE
    parts = jsonl_parts(metrics)  # the rotated parts first (oldest), then metrics.jsonl itself
    if not parts and not plan.is_file():
        return None
    node = NodeLog()
    for part in parts:
        try:
            _read_metrics(part, node)
        except OSError as exc:
            log.warning("%s: unreadable, node %s has no records from it (%s)", part, folder.name, exc)
    if plan.is_file():
        node.plan = _read_plan(plan)
    return node


def load_run(run_dir: str | Path) -> dict[str, NodeLog]:
    """Parse every ``RUN/<node_id>/metrics.jsonl`` and ``plan.json``; node ids sorted, records sorted by ``t``.

    A folder that holds the files itself is one node's (``RUN/<node_id>`` given directly): the node is named
    after the folder. Raises ValueError when ``run_dir`` is not a directory or holds no node logs.
    """
    run = Path(run_dir)
    if not run.is_dir():
        raise ValueError(f"run directory {run} does not exist or is not a directory")
    own = _read_node(run)
    if own is not None:
        return {run.resolve().name: own}
    logs: dict[str, NodeLog] = {}
    for sub in sorted(p for p in run.iterdir() if p.is_dir()):
        node = _read_node(sub)
        if node is not None:
            logs[sub.name] = node
    if not logs:
        raise ValueError(EMPTY_RUN_MESSAGE.format(run=run))
    return logs


def plan_version(node: NodeLog) -> int | None:
    if node.plan is None:
        return None
    version = node.plan["plan"].get("version")
    return version if _is_int(version) else None


def newest_plan(logs: Mapping[str, NodeLog]) -> tuple[str, dict[str, Any]] | None:
    """(node id, plan.json) of the node with the highest plan version; ties keep the first node id."""
    best: tuple[int, str, dict[str, Any]] | None = None
    for node_id, node in logs.items():
        if node.plan is None:
            continue
        version = plan_version(node)
        key = -1 if version is None else version
        if best is None or key > best[0]:
            best = (key, node_id, node.plan)
    return None if best is None else (best[1], best[2])
