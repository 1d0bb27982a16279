"""Per-node metrics: a Prometheus endpoint and a JSON-lines log that the report and demo read.

One registry per node (no process globals), so several nodes can live in one process in tests. The
registry follows Prometheus' conventions: running totals are counters (``*_total``), durations that
vary per event are histograms, and the process/platform/GC collectors that the default registry would
carry are registered on it too. What the peer counts (rounds, rejected frames, withheld contributions,
bytes, liveness) is mirrored from its `PeerStatus` as last read, by a collector of its own: the peer
owns those totals, so they are exported as read instead of being added up a second time here.
"""

from __future__ import annotations

import enum
import json
import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    start_http_server,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from dreamp2p.messages import LinkSnapshot, PeerStatus
from dreamp2p.service.jsonl import RotatingJsonl
from dreamp2p.service.progress import lifecycle_message

if TYPE_CHECKING:
    from dreamp2p.sync.strategies.base import StepStats  # torch: not for readers of RecordKind such as the report

# Rounds cross WAN links: tens of ms on loopback up to minutes for a large group on a slow link.
ROUND_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
# Exposed wait per step: zero when the schedule hides communication, up to a whole round when not.
EXPOSED_BUCKETS = (0.0, 0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


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
    # the peer's round counters and live view, with each status read (`bench chaos` reads them)
    PEER = "peer"


log = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
# attributes of a log record, which a record's extra fields may not reuse
_LOG_RECORD_KEYS = frozenset(vars(logging.makeLogRecord({}))) | {"message", "asctime"}


class PeerStatusCollector(Collector):
    """The peer's own totals and liveness, exported from the last `PeerStatus` handed to :meth:`update`.

    Nothing is exported before the first update. Rejected frames are one total: the peer counts them
    without their status code (``Inbound.note_rejected``), so there is no per-status label to give.
    """

    def __init__(self) -> None:
        self._status: PeerStatus | None = None

    @property
    def status(self) -> PeerStatus | None:
        return self._status

    def update(self, status: PeerStatus) -> None:
        self._status = status  # one reference swap: the scrape thread sees the old or the new status whole

    def collect(self) -> Iterator[Metric]:
        s = self._status
        if s is None:
            return
        for name, doc, value in (
            ("dreamp2p_rounds_completed", "Averaging rounds completed", s.rounds_completed),
            ("dreamp2p_rounds_failed", "Averaging rounds that failed (skipped on every member)", s.rounds_failed),
            ("dreamp2p_frames_rejected", "Frames and calls from peers that this node refused", s.frames_rejected),
            (
                "dreamp2p_contributions_withheld",
                "Rounds this node took part in without its values (non-finite, or a norm jump)",
                s.contributions_refused,
            ),
            (
                "dreamp2p_straggler_evictions",
                "Times a live member was left out of the rounds as a straggler (see peer.straggler)",
                s.straggler_evictions,
            ),
            (
                "dreamp2p_straggler_returns",
                "Times a member left out as a straggler took part in the rounds again after its probation",
                s.straggler_returns,
            ),
        ):
            yield CounterMetricFamily(name, doc, value=value)
        yield from _link_families(s.links)
        # before the first membership view the rounds run among the whole ring, so every member counts
        live = set(s.live) if s.live else set(s.ring)
        up = GaugeMetricFamily("dreamp2p_peer_up", "1 while the ring member is counted alive, else 0", labels=["peer"])
        out = GaugeMetricFamily(
            "dreamp2p_peer_excluded", "1 while the live member sits out the rounds as a straggler", labels=["peer"]
        )
        for member in s.ring:
            # a straggler is alive but not in the rounds' view (its own view is itself alone)
            up.add_metric([member], 1.0 if member in live or member in s.excluded else 0.0)
            out.add_metric([member], 1.0 if member in s.excluded else 0.0)
        yield up
        yield out
        yield GaugeMetricFamily("dreamp2p_live_members", "Ring members counted alive now", value=len(live))


def _link_families(links: tuple[LinkSnapshot, ...]) -> Iterator[Metric]:
    sent = CounterMetricFamily("dreamp2p_bytes_sent", "Bytes sent to a peer", labels=["peer"])
    received = CounterMetricFamily("dreamp2p_bytes_received", "Bytes received from a peer", labels=["peer"])
    goodput = GaugeMetricFamily("dreamp2p_link_goodput_bytes_per_second", "Measured link goodput", labels=["peer"])
    rtt = GaugeMetricFamily("dreamp2p_link_rtt_seconds", "Measured link round-trip time", labels=["peer"])
    for link in links:
        sent.add_metric([link.peer], link.bytes_sent)
        received.add_metric([link.peer], link.bytes_received)
        goodput.add_metric([link.peer], link.goodput_Bps)
        rtt.add_metric([link.peer], link.rtt_s)
    yield from (sent, received, goodput, rtt)


# metrics.jsonl's default budget ([metrics] jsonl_max_mb, jsonl_files): the last 100 MB of records in 5 files;
# a step record is about 250 bytes, so that is the last ~400,000 steps with log_every = 1
JSONL_MAX_BYTES = 100 << 20
JSONL_FILES = 5


class NodeMetrics:
    """One node's Prometheus registry and its run log ``RUN/<node_id>/metrics.jsonl`` (size-capped, rotated).

    Lifecycle records (start, join, resume, checkpoint, stop) are also told in the process log at INFO.
    """

    def __init__(
        self,
        node_id: str,
        run_dir: str | Path | None = None,
        max_bytes: int = JSONL_MAX_BYTES,
        files: int = JSONL_FILES,
    ) -> None:
        self.node_id = node_id
        self.registry = CollectorRegistry()
        r = self.registry
        # what the default registry carries (process_*, python_info, python_gc_*): a custom one starts empty
        ProcessCollector(registry=r)
        PlatformCollector(registry=r)
        GCCollector(registry=r)
        self.step = Gauge("dreamp2p_step", "Training step reached", registry=r)
        self.loss = Gauge("dreamp2p_loss", "Training loss of the last step", registry=r)
        self.eval_loss = Gauge("dreamp2p_eval_loss", "Held-out loss at the last evaluation", registry=r)
        self.tokens_per_s = Gauge("dreamp2p_tokens_per_second", "Training throughput", registry=r)
        self.exposed = Counter("dreamp2p_exposed_wait_seconds", "Time training waited on the network", registry=r)
        self.comm = Counter("dreamp2p_comm_seconds", "Duration of collectives that landed", registry=r)
        self.exposed_per_step = Histogram(
            "dreamp2p_step_exposed_wait_seconds",
            "Time each step waited on the network",
            buckets=EXPOSED_BUCKETS,
            registry=r,
        )
        self.round_duration = Histogram(
            "dreamp2p_round_duration_seconds",
            "Duration of the averaging rounds that landed (rounds landing in one step count at their mean)",
            buckets=ROUND_BUCKETS,
            registry=r,
        )
        self.hidden = Gauge("dreamp2p_hidden_fraction", "1 - exposed wait / comm time, whole run", registry=r)
        self.plan_version = Gauge("dreamp2p_plan_version", "Version of the layer schedule in force", registry=r)
        self.peer = PeerStatusCollector()
        r.register(self.peer)
        self._log: RotatingJsonl | None = None
        self._server: Any = None
        self.dir: Path | None = None
        if run_dir is not None:
            self.dir = Path(run_dir) / node_id
            self.dir.mkdir(parents=True, exist_ok=True)
            self._log = RotatingJsonl(self.dir / METRICS_FILE, max_bytes, files)

    def serve(self, listen: str) -> int:
        """Start the HTTP endpoint on ``host:port`` (port 0 picks one); returns the port."""
        host, _, port = listen.rpartition(":")
        server, _thread = start_http_server(int(port), addr=host or "0.0.0.0", registry=self.registry)
        self._server = server
        return int(server.server_port)

    def record(self, kind: RecordKind, **fields: Any) -> None:
        if self._log is not None:
            self._log.write({"kind": kind.value, "t": time.time(), **fields})
        message = lifecycle_message(kind, fields)
        if message is not None:
            extra = {k: v for k, v in fields.items() if k not in _LOG_RECORD_KEYS}
            log.info("%s", message, extra={"event": kind.value, **extra})

    def step_stats(self, stats: StepStats) -> None:
        """One training step's communication figures: the running totals and the histograms."""
        self.exposed.inc(stats.exposed_s)
        self.comm.inc(stats.comm_s)
        self.exposed_per_step.observe(stats.exposed_s)
        # the step reports the sum and count of the rounds that landed in it, not each duration: observing
        # the mean once per round keeps the histogram's _sum and _count exact
        if stats.syncs > 0:
            mean = stats.comm_s / stats.syncs
            for _ in range(stats.syncs):
                self.round_duration.observe(mean)

    @property
    def last_status(self) -> PeerStatus | None:
        """The peer status last handed to :meth:`peer_status` (None before the first)."""
        return self.peer.status

    def peer_status(self, status: PeerStatus) -> None:
        """The peer's counters, links and liveness as just read (``node.comm.status()``): exported, and written
        to the run log (a PEER record, and a LINK record per measured link)."""
        self.peer.update(status)
        self.record(
            RecordKind.PEER,
            rounds_completed=status.rounds_completed,
            rounds_failed=status.rounds_failed,
            live=list(status.live or status.ring),
            view_id=status.view_id,
        )
        for s in status.links:
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
