"""Per-node metrics: a Prometheus endpoint and a JSON-lines log that the report and demo read.

One registry per node (no process globals), so several nodes can live in one process in tests.
"""

from __future__ import annotations

import enum
import json
import logging
import time
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

from dreamp2p.messages import LinkSnapshot


class RecordKind(enum.StrEnum):
    """The ``kind`` of each line of ``metrics.jsonl``: written here, parsed by `dreamp2p.devtools.report`."""

    STEP = "step"
    EVAL = "eval"
    LINK = "link"
    # the node's lifecycle: known to readers, not plotted
    START = "start"
    RESUME = "resume"
    JOIN = "join"
    CHECKPOINT = "checkpoint"
    STOP = "stop"


log = logging.getLogger(__name__)


class NodeMetrics:
    def __init__(self, node_id: str, run_dir: str | Path | None = None) -> None:
        self.node_id = node_id
        self.registry = CollectorRegistry()
        r = self.registry
        self.step = Gauge("dreamp2p_step", "Training step reached", registry=r)
        self.loss = Gauge("dreamp2p_loss", "Training loss of the last step", registry=r)
        self.eval_loss = Gauge("dreamp2p_eval_loss", "Held-out loss at the last evaluation", registry=r)
        self.tokens_per_s = Gauge("dreamp2p_tokens_per_second", "Training throughput", registry=r)
        self.exposed = Counter("dreamp2p_exposed_wait_seconds", "Time training waited on the network", registry=r)
        self.comm = Counter("dreamp2p_comm_seconds", "Duration of collectives that landed", registry=r)
        self.hidden = Gauge("dreamp2p_hidden_fraction", "1 - exposed wait / comm time, whole run", registry=r)
        self.plan_version = Gauge("dreamp2p_plan_version", "Version of the layer schedule in force", registry=r)
        self.rounds_failed = Gauge("dreamp2p_rounds_failed", "Averaging rounds that failed", registry=r)
        self.rounds_completed = Gauge("dreamp2p_rounds_completed", "Averaging rounds completed", registry=r)
        self.bytes_tx = Gauge("dreamp2p_bytes_sent", "Bytes sent to a peer", ["peer"], registry=r)
        self.bytes_rx = Gauge("dreamp2p_bytes_received", "Bytes received from a peer", ["peer"], registry=r)
        self.link_bw = Gauge("dreamp2p_link_goodput_bytes_per_second", "Measured link goodput", ["peer"], registry=r)
        self.link_rtt = Gauge("dreamp2p_link_rtt_seconds", "Measured link round-trip time", ["peer"], registry=r)
        self._log = None
        self._server: Any = None
        self.dir: Path | None = None
        if run_dir is not None:
            self.dir = Path(run_dir) / node_id
            self.dir.mkdir(parents=True, exist_ok=True)
            self._log = open(self.dir / "metrics.jsonl", "a", buffering=1)  # noqa: SIM115 - lives as long as the node

    def serve(self, listen: str) -> int:
        """Start the HTTP endpoint on ``host:port`` (port 0 picks one); returns the port."""
        host, _, port = listen.rpartition(":")
        server, _thread = start_http_server(int(port), addr=host or "0.0.0.0", registry=self.registry)
        self._server = server
        return int(server.server_port)

    def record(self, kind: RecordKind, **fields: Any) -> None:
        if self._log is not None:
            self._log.write(json.dumps({"kind": kind.value, "t": time.time(), **fields}) + "\n")

    def links(self, snaps: list[LinkSnapshot]) -> None:
        for s in snaps:
            self.bytes_tx.labels(s.peer).set(s.bytes_sent)
            self.bytes_rx.labels(s.peer).set(s.bytes_received)
            self.link_bw.labels(s.peer).set(s.goodput_Bps)
            self.link_rtt.labels(s.peer).set(s.rtt_s)
            if s.goodput_Bps > 0:
                self.record(RecordKind.LINK, peer=s.peer, goodput_Bps=s.goodput_Bps, rtt_s=s.rtt_s)

    def write_json(self, name: str, data: dict[str, Any]) -> None:
        if self.dir is not None:
            tmp = self.dir / f".{name}.tmp"
            tmp.write_text(json.dumps(data))
            tmp.replace(self.dir / name)

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server = None
        if self._log is not None:
            self._log.close()
            self._log = None
