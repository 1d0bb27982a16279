"""Which plan each DreamDDP step follows: the plan in force, the one queued, the one being made, their codecs.

Every member adopts a plan at the step its request fixed (`dreamp2p.sync.strategies.control.PlanRequest`),
so a plan made off the training thread is waited for at that step if it is not in yet: every member then
runs the same plan from the same step, however long its planner took. Until the first measured plan, a
warm-up plan of a few large syncs runs, in the most compressive candidate codec, since the link is not
measured yet.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
from typing import Any

from dreamp2p.config.sync import SyncConfig
from dreamp2p.schedule.cost import LayerCost
from dreamp2p.schedule.dreamddp import warmup_plan
from dreamp2p.schedule.plan import Plan
from dreamp2p.sync.strategies.control import Gathered, MadePlan, PlanRequest, Replanner, in_background

log = logging.getLogger(__name__)

# syncs per period before the first measured plan (see `warmup_plan`)
WARMUP_GROUPS = 2


class PlanBook:
    """The plans of one member, and the history of their adoptions (version, effective step)."""

    def __init__(self, cfg: SyncConfig, blank: list[LayerCost]) -> None:
        self._cfg = cfg
        self._blank = blank  # every layer at zero cost: what a warm-up plan is made from
        # before the link is measured: a few large syncs, landing as late as the WAN extension allows
        self.plan: Plan = self._warmup()
        self._next: Plan | None = None
        # a plan being made off the training thread: (its request, the future of the plan and its codecs)
        self._making: tuple[PlanRequest, concurrent.futures.Future[MadePlan]] | None = None
        self.history: list[tuple[int, int]] = [(0, 0)]
        # codec of each plan's anchors, and of its pseudo-gradients where not delta_codec (plan version -> name)
        self._codecs: dict[int, str] = {0: self._warmup_codec()}
        self._deltas: dict[int, str] = self._warmup_deltas()

    def _warmup(self) -> Plan:
        return warmup_plan(self._blank, self._cfg.period, WARMUP_GROUPS, delay=self._cfg.delay_cap)

    def _warmup_codec(self) -> str:
        """The warm-up plan's codec: the most compressive candidate, since the link is not measured yet."""
        return self._cfg.plan_codecs[-1] if self._cfg.plan_codecs else self._cfg.codec

    def _warmup_deltas(self) -> dict[int, str]:
        """The first warm-up plan's pseudo-gradient codec where not ``delta_codec``: with ``keep_unsent``, the most
        compressive of the chain (at 1 Mbit/s a warm-up period of 4-bit syncs exposed 14.8 s of `bench lm`'s
        run), else none (with error feedback a fallback would reset each replica to a share of its progress).
        A restart's warm-up (a rejoin) sends ``delta_codec``."""
        chain = self._cfg.delta_chain
        return {0: chain[-1]} if len(chain) > 1 and self._cfg.keeps_unsent(chain[-1]) else {}

    @property
    def codec(self) -> str:
        """The codec of the plan in force's anchors (of all its layer syncs without a delta codec)."""
        return self._codecs.get(self.plan.version, self._cfg.codec)

    @property
    def delta_codec(self) -> str:
        """The codec of the plan in force's pseudo-gradients: ``delta_codec`` or a fallback of it ("" without)."""
        return self._deltas.get(self.plan.version, self._cfg.delta_codec)

    def adopt(self, step: int) -> None:
        """Adopt the plan due by ``step``, waiting for it if it is still being made."""
        if self._making is not None and step >= self._making[0].start:
            self.collect()
        if self._next is not None and step >= self._next.effective_step:
            self.plan = self._next
            self._next = None
            self.history.append((self.plan.version, self.plan.effective_step))
            log.info("adopted plan v%d at step %d", self.plan.version, step)

    def collect(self) -> Plan | None:
        """Queue the plan being made, waiting for it if it is not ready yet; the queued plan, if any."""
        if self._making is not None:
            req, fut = self._making
            self._making = None
            made = fut.result()
            self._next, self._codecs[req.version] = made.plan, made.anchors
            if made.deltas != self._cfg.delta_codec:
                self._deltas[req.version] = made.deltas
        return self._next

    def replan(self, replanner: Replanner, g: Gathered, t: int, world: int) -> None:
        """Decide on what a control round gathered, as of its landing step ``t``: the same inputs on every
        member at the same step, so the same decision everywhere.

        ``world`` is the member count the control round was packed for (equal on every member whose round
        succeeded), not the live view: views differ between members for a moment while one leaves or joins,
        and so do the shard rings of a region's ranks, which would then decide different plans.
        """
        self.collect()  # a newer decision replaces the queued plan, as if it had been made at once
        version = max(self.plan.version, self._next.version if self._next else 0) + 1
        req = replanner.decide(g, t, self.plan, version, world)
        if req is not None:
            # the planner's search takes a good fraction of a step: run it beside training (torch kernels
            # release the GIL); the request fixes the version and adoption step, so waiting for the result
            # at that step (if it is not there yet) gives every member the same plan at the same step
            self._making = (req, in_background(replanner.make, req))

    def restart(self, step: int) -> None:
        """Start over from ``step`` as at a fresh start: a warm-up plan, no plan queued or being made."""
        self.plan = dataclasses.replace(self._warmup(), effective_step=step)
        self._next = None
        self._making = None
        self.history = [(self.plan.version, step)]
        self._codecs = {self.plan.version: self._warmup_codec()}
        self._deltas = {}

    def state(self) -> dict[str, Any]:
        """Checkpoint entries ``plan``, ``next_plan`` (the plan being made is waited for), ``history`` and
        ``plan_codecs`` and ``delta_codecs`` (only plans whose pseudo-gradients use a fallback)."""
        return {
            "plan": self.plan.to_dict(),
            "next_plan": queued.to_dict() if (queued := self.collect()) is not None else None,
            "history": [list(h) for h in self.history],
            "plan_codecs": dict(self._codecs),
            "delta_codecs": dict(self._deltas),
        }

    def load(self, state: dict[str, Any]) -> None:
        self.plan = Plan.from_dict(state["plan"])
        nxt = state.get("next_plan")
        self._next = Plan.from_dict(nxt) if nxt else None
        self._making = None
        self.history = [(int(v), int(e)) for v, e in state.get("history", [])]
        self._codecs.update({int(v): str(c) for v, c in state.get("plan_codecs", {}).items()})
        self._deltas.update({int(v): str(c) for v, c in state.get("delta_codecs", {}).items()})
