"""Every configuration type of a node and the TOML loaders, in one place (a leaf: it imports no other dreamp2p package).

- :mod:`dreamp2p.config.parse`: link rates, durations, and dataclasses built from TOML tables with precise errors;
- :mod:`dreamp2p.config.peer`: the peer, its transport and TLS (``[node]`` of a daemon's file);
- :mod:`dreamp2p.config.sync`: the synchronization strategies' knobs (``[sync]``) and the strategy names;
- :mod:`dreamp2p.config.task`: the built-in training task of ``dreamp2p node`` (``[task]``);
- :mod:`dreamp2p.config.train`: how a daemon computes each step: accumulation, clipping, AMP, LR schedule (``[train]``);
- :mod:`dreamp2p.config.daemon`: a node daemon's whole file (``dreamp2p node --config``);
- :mod:`dreamp2p.config.codecs`: the codec names the checks accept (held equal to the codec registry by a test);
- :mod:`dreamp2p.config.check`: every error of a daemon's file at once (``dreamp2p config check``);
- :mod:`dreamp2p.config.certs`: what is wrong with the PEM files of a TLS configuration (dates, key, CA).
"""

from dreamp2p.config.check import check_file
from dreamp2p.config.daemon import LOG_FORMATS, CheckpointConfig, DaemonConfig, MetricsConfig
from dreamp2p.config.parse import parse_duration, parse_rate
from dreamp2p.config.peer import (
    COMM_MODES,
    PeerConfig,
    PeerInfo,
    TLSConfig,
    TransportConfig,
    is_loopback_address,
    token_digest,
)
from dreamp2p.config.sync import STRATEGIES, SyncConfig
from dreamp2p.config.task import TaskConfig
from dreamp2p.config.train import AMP_MODES, TrainConfig

__all__ = [
    "AMP_MODES",
    "COMM_MODES",
    "LOG_FORMATS",
    "STRATEGIES",
    "CheckpointConfig",
    "DaemonConfig",
    "MetricsConfig",
    "PeerConfig",
    "PeerInfo",
    "SyncConfig",
    "TLSConfig",
    "TaskConfig",
    "TrainConfig",
    "TransportConfig",
    "check_file",
    "is_loopback_address",
    "parse_duration",
    "parse_rate",
    "token_digest",
]
