"""The node daemon's file (``dreamp2p node --config``): its tables ``[node]``, ``[sync]``, ``[task]``,
``[train]``, ``[checkpoint]``, ``[metrics]`` and top-level keys, loaded into one frozen :class:`DaemonConfig`.

What runs a node from it is :mod:`dreamp2p.service.daemon`.
"""

from __future__ import annotations

import dataclasses
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dreamp2p.config.parse import _build, did_you_mean
from dreamp2p.config.peer import PeerConfig
from dreamp2p.config.sync import SyncConfig
from dreamp2p.config.task import TaskConfig
from dreamp2p.config.train import TrainConfig, check_train

# what a node does when the storage fails a checkpoint write (a full disk, an I/O error): "continue" logs
# one warning and trains on, trying again at the next every_steps; "stop" ends the node with the error
ON_WRITE_ERROR = ("continue", "stop")


@dataclass(frozen=True)
class CheckpointConfig:
    """``[checkpoint]``: where checkpoints go, how often, how many are kept, and what a failed write does."""

    dir: str = "checkpoints"
    every_steps: int = 100
    keep: int = 3
    on_write_error: str = "continue"

    def __post_init__(self) -> None:
        if self.every_steps < 1 or self.keep < 1:
            raise ValueError("checkpoint.every_steps and checkpoint.keep must be >= 1")
        if self.on_write_error not in ON_WRITE_ERROR:
            raise ValueError(
                f"checkpoint.on_write_error must be one of {', '.join(ON_WRITE_ERROR)}; got {self.on_write_error!r}"
            )


LOG_FORMATS = ("text", "json")


@dataclass(frozen=True)
class MetricsConfig:
    """``[metrics]``: the Prometheus endpoint, the run log (``metrics.jsonl``) and the daemon's own log lines."""

    listen: str | None = None  # "host:port" of the Prometheus endpoint; None disables it
    # log records on stderr as "text" lines or as "json" objects, one per line (`dreamp2p node --log-format`
    # overrides it); json_logs = true is the older spelling of log_format = "json"
    log_format: str = "text"
    json_logs: bool = False
    progress_every_s: float = 10.0  # seconds between two progress lines of the training loop (0: every step)
    run_dir: str | None = None  # where metrics.jsonl / plan.json go (per node sub-directory)
    log_every: int = 1  # steps between two step records in metrics.jsonl
    # metrics.jsonl keeps at most about jsonl_max_mb over jsonl_files files: metrics.jsonl, then .1 (older)
    # up to .<jsonl_files - 1> (oldest); the oldest is dropped when the current one fills its share
    jsonl_max_mb: float = 100.0
    jsonl_files: int = 5

    def __post_init__(self) -> None:
        if self.listen is not None and ":" not in self.listen:
            raise ValueError(f"metrics.listen must look like 'host:port', got {self.listen!r}")
        if self.log_every < 1:
            raise ValueError("metrics.log_every must be >= 1")
        if self.log_format not in LOG_FORMATS:
            raise ValueError(f"metrics.log_format must be one of {', '.join(LOG_FORMATS)}; got {self.log_format!r}")
        if not self.progress_every_s >= 0:
            raise ValueError(f"metrics.progress_every_s must be >= 0, got {self.progress_every_s}")
        if not 0 < self.jsonl_max_mb < float("inf"):
            raise ValueError(f"metrics.jsonl_max_mb must be a number > 0, got {self.jsonl_max_mb}")
        if self.jsonl_files < 1:
            raise ValueError(f"metrics.jsonl_files must be >= 1, got {self.jsonl_files}")

    @property
    def json_format(self) -> bool:
        """Whether log records go out as JSON objects (log_format = "json", or json_logs = true)."""
        return self.log_format == "json" or self.json_logs


# the top-level keys and tables of a node daemon's file
DAEMON_KEYS = ("node", "sync", "task", "train", "checkpoint", "metrics", "device", "threads", "stop_grace_s")
DEVICES = ("auto", "cpu", "cuda")


@dataclass(frozen=True)
class DaemonConfig:
    node: PeerConfig
    sync: SyncConfig = field(default_factory=SyncConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    device: str = "auto"  # "auto" (cuda when available), "cpu" or "cuda"
    threads: int = 0  # torch CPU threads for training; 0 keeps torch's default
    stop_grace_s: float = 20.0  # on SIGTERM, how long rounds in flight may take to finish before abort

    def __post_init__(self) -> None:
        check_train(self.train, self.task.lr, self.task.steps, self.device)

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
        unknown = sorted(set(data) - set(DAEMON_KEYS))
        if unknown:
            raise ValueError(unknown_top_level_message(unknown[0]))
        if "node" not in data:
            raise ValueError("missing [node] table (node_id, listen, ring, ...)")
        device = check_top_level("device", data.get("device", "auto"))
        ckpt = _build(CheckpointConfig, data.get("checkpoint", {}), "checkpoint")
        if base is not None and not Path(ckpt.dir).is_absolute():
            ckpt = dataclasses.replace(ckpt, dir=str(base / ckpt.dir))
        return DaemonConfig(
            node=PeerConfig.from_dict(data["node"]),
            sync=_build(SyncConfig, data.get("sync", {}), "sync"),
            task=_build(TaskConfig, data.get("task", {}), "task"),
            train=_build(TrainConfig, data.get("train", {}), "train"),
            checkpoint=ckpt,
            metrics=_build(MetricsConfig, data.get("metrics", {}), "metrics"),
            device=device,
            threads=check_top_level("threads", data.get("threads", 0)),
            stop_grace_s=check_top_level("stop_grace_s", data.get("stop_grace_s", 20.0)),
        )


def unknown_top_level_message(key: str) -> str:
    """The message for a top-level key or table a daemon's file may not have, with the closest allowed one."""
    return f"unknown table or key {key!r}{did_you_mean(key, DAEMON_KEYS)}; allowed: {', '.join(sorted(DAEMON_KEYS))}"


def check_top_level(key: str, value: Any) -> Any:
    """One top-level key's value, checked (``device``, ``threads``, ``stop_grace_s``); ValueError names it."""
    if key == "device":
        if value not in DEVICES:
            raise ValueError(f"device must be one of {', '.join(DEVICES)}; got {value!r}")
        return value
    if key == "threads":
        return _nonneg_int(value, "threads")
    return _grace(value)


def _grace(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise ValueError(f"stop_grace_s must be a number > 0, got {value!r}")
    return float(value)


def _nonneg_int(value: Any, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{key} must be an integer >= 0, got {value!r}")
    return value
