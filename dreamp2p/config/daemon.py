"""The node daemon's file (``dreamp2p node --config``): its tables ``[node]``, ``[sync]``, ``[task]``,
``[checkpoint]``, ``[metrics]`` and top-level keys, loaded into one frozen :class:`DaemonConfig`.

What runs a node from it is :mod:`dreamp2p.service.daemon`.
"""

from __future__ import annotations

import dataclasses
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dreamp2p.config.parse import _build
from dreamp2p.config.peer import PeerConfig
from dreamp2p.config.sync import SyncConfig
from dreamp2p.config.task import TaskConfig


@dataclass(frozen=True)
class CheckpointConfig:
    dir: str = "checkpoints"
    every_steps: int = 100
    keep: int = 3

    def __post_init__(self) -> None:
        if self.every_steps < 1 or self.keep < 1:
            raise ValueError("checkpoint.every_steps and checkpoint.keep must be >= 1")


@dataclass(frozen=True)
class MetricsConfig:
    listen: str | None = None  # "host:port" of the Prometheus endpoint; None disables it
    json_logs: bool = False  # log records as JSON lines on stderr
    run_dir: str | None = None  # where metrics.jsonl / plan.json go (per node sub-directory)
    log_every: int = 1

    def __post_init__(self) -> None:
        if self.listen is not None and ":" not in self.listen:
            raise ValueError(f"metrics.listen must look like 'host:port', got {self.listen!r}")
        if self.log_every < 1:
            raise ValueError("metrics.log_every must be >= 1")


@dataclass(frozen=True)
class DaemonConfig:
    node: PeerConfig
    sync: SyncConfig = field(default_factory=SyncConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    device: str = "auto"  # "auto" (cuda when available), "cpu" or "cuda"
    threads: int = 0  # torch CPU threads for training; 0 keeps torch's default
    stop_grace_s: float = 20.0  # on SIGTERM, how long rounds in flight may take to finish before abort

    @staticmethod
    def from_toml(path: str | Path) -> DaemonConfig:
        p = Path(path)
        try:
            with open(p, "rb") as fh:
                data = tomllib.load(fh)
        except tomllib.TOMLDecodeError as exc:
            raise ValueError(f"{p}: not valid TOML: {exc}") from None
        return DaemonConfig.from_dict(data, base=p.parent)

    @staticmethod
    def from_dict(data: Mapping[str, Any], base: Path | None = None) -> DaemonConfig:
        allowed = {"node", "sync", "task", "checkpoint", "metrics", "device", "threads", "stop_grace_s"}
        unknown = sorted(set(data) - allowed)
        if unknown:
            raise ValueError(f"unknown table or key {unknown[0]!r}; allowed: {', '.join(sorted(allowed))}")
        if "node" not in data:
            raise ValueError("missing [node] table (node_id, listen, ring, ...)")
        device = data.get("device", "auto")
        if device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device must be one of auto, cpu, cuda; got {device!r}")
        ckpt = _build(CheckpointConfig, data.get("checkpoint", {}), "checkpoint")
        if base is not None and not Path(ckpt.dir).is_absolute():
            ckpt = dataclasses.replace(ckpt, dir=str(base / ckpt.dir))
        return DaemonConfig(
            node=PeerConfig.from_dict(data["node"]),
            sync=_build(SyncConfig, data.get("sync", {}), "sync"),
            task=_build(TaskConfig, data.get("task", {}), "task"),
            checkpoint=ckpt,
            metrics=_build(MetricsConfig, data.get("metrics", {}), "metrics"),
            device=device,
            threads=_nonneg_int(data.get("threads", 0), "threads"),
            stop_grace_s=_grace(data.get("stop_grace_s", 20.0)),
        )


def _grace(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise ValueError(f"stop_grace_s must be a number > 0, got {value!r}")
    return float(value)


def _nonneg_int(value: Any, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{key} must be an integer >= 0, got {value!r}")
    return value
