"""The daemon's log lines for people while it trains: a progress line at a steady cadence, and the members
that left or came back, read from the peer status the daemon publishes every few steps.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from dreamp2p.messages import PeerStatus
from dreamp2p.service.metrics import NodeMetrics
from dreamp2p.service.progress import Progress, ProgressClock, membership_change

log = logging.getLogger(__name__)


class ProgressLog:
    """Called once per finished step; writes a progress line when one is due (`ProgressClock`)."""

    def __init__(self, every_s: float, sync: Any, metrics: NodeMetrics) -> None:
        self.sync = sync
        self.metrics = metrics
        self.clock = ProgressClock(every_s)
        self._status: PeerStatus | None = None  # the status last looked at for membership changes

    def step(self, step: int, final: int, loss: float, tokens_per_s: float, plan_version: int) -> None:
        """Step ``step`` (0-based) finished with ``loss``; the run ends at step ``final``."""
        status = self.metrics.last_status
        if status is not None and status is not self._status:
            self._members(status, step)
        done = step + 1
        if not self.clock.due(done, time.monotonic()):
            return
        rates = [link.goodput_Bps for link in (status.links if status else ()) if link.goodput_Bps > 0]
        line = Progress(
            step=done,
            final=final,
            loss=loss,
            tokens_per_s=tokens_per_s,
            hidden_fraction=self.sync.totals.hidden_fraction,
            link_Bps=min(rates) if rates else None,
            plan_version=plan_version,
            eta_s=self.clock.eta(done, final),
        )
        log.info("%s", line.message(), extra=line.fields())

    def _members(self, status: PeerStatus, step: int) -> None:
        """Log the members that left or came back since the last status (before the first view: the whole ring)."""
        live = status.live or status.ring
        if self._status is not None:
            lost, joined = membership_change(self._status.live or self._status.ring, live)
            for what, members in (("lost", lost), ("joined", joined)):
                for member in members:
                    extra = {"event": f"member_{what}", "member": member}
                    log.info("member %s: %s at step %d (live: %s)", what, member, step, ", ".join(live), extra=extra)
        self._status = status
