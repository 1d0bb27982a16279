"""DreamDDP at run time: planned layer-wise partial synchronization, overlapped with backward.

DreamDDP (Tang et al., arXiv 2502.11058) averages, at iteration h of a period of H, only the layers the
plan assigns to h. A sync is launched from gradient hooks as soon as its layers' gradients are ready
(backward no longer needs those weights), runs on the comm thread while backward continues, and is
merged before the optimizer step. WAN extension (docs/PLANNING.md): a sync may land d steps later; merging
adds ``avg - snapshot`` so the local progress made meanwhile is kept.

Pseudo-gradients between anchors (DiLoCo, Douillard et al., arXiv 2311.08105; Streaming DiLoCo, arXiv
2501.18512): each layer keeps outer weights theta and a momentum, changed only by landed syncs. Most
syncs average ``theta - params`` (how far this replica moved since theta) with ``delta_codec``, 4 bits by
default: a lossy codec then errs in proportion to the update, not to the weights. A landing takes a
Nesterov step per layer, theta -= lr * (g + mu * m) with g the mean pseudo-gradient (lr 1, momentum 0 is
plain averaging), and params = theta + the local progress made while the sync travelled.

Checks and anchors: every ``anchor_every``-th period (by the launch step, so every member agrees without
asking) a layer's pseudo-gradient sync carries a 17-element round beside it: a flag and 16 bits of a digest
of each member's theta and momentum. Where all agree, the sync lands as any other. Where any differs (a
partition, each side averaging alone; a round one member lost; a fresh node), nobody applies it, and the
layer's next sync is an anchor: it averages the parameters themselves with the plan's codec, with a check
of its own, and every member resets theta to the parameter mean and the momentum to zero, identically.
Theta starts at attach from the parameters rank 0 broadcast, so the first period sends pseudo-gradients too
(and checks them: a member that skipped the broadcast is found there). Pseudo-gradients would otherwise
need theta bit-identical on every member for good; checking first keeps the anchors' parameter bytes (twice
a 4-bit pseudo-gradient's) off the wire while the members agree, which is nearly always.

Codec per plan (bandwidth-aware compression, arXiv 2408.14736): with ``plan_codecs`` (least lossy first),
every plan is made for each candidate's wire size and the least lossy candidate is taken whose plan hides
every sync and keeps the link busy at most ``codec_link_budget`` of the period (the rest is headroom for
the CPU cost of each byte and for noise); if none does, the most compressive. Every peer decides from the
same gathered inputs, so all use the same codec for the rounds of a plan. Pseudo-gradients likewise: where
the link cannot carry a period's syncs in ``delta_codec``, a plan's syncs use the first of
``delta_fallbacks`` it can (int2 by default), always with error feedback (`Replanner.make`).

One plan for all: plans are computed only from inputs every peer holds bit-identically, gathered by a
small control all-reduce every ``control_every`` steps (each peer's link measurements and layer
profile), spaced out up to ``control_backoff`` times that while the link holds steady. Every peer runs the
same deterministic planner on them at the same step and adopts the result at the next step. Until the
first measured plan, a warm-up plan of two large syncs runs.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch

from dreamp2p.messages import RingCodecPlan, RoundResult, TrainingInfo
from dreamp2p.schedule.cost import LayerCost
from dreamp2p.schedule.pace import PaceFilter, delivery_rate
from dreamp2p.schedule.plan import Plan
from dreamp2p.sync.model.profiler import LayerProfiler
from dreamp2p.sync.strategies.base import Held, Strategy
from dreamp2p.sync.strategies.control import (
    Control,
    ControlSchedule,
    Gathered,
    Replanner,
    link_bandwidth,
    pack_control,
    successor_link,
    unpack_control,
)
from dreamp2p.sync.strategies.deltaflush import DeltaFlush
from dreamp2p.sync.strategies.layersync import ArmedSyncs, InFlight, LayerSyncs
from dreamp2p.sync.strategies.outer import OuterWeights
from dreamp2p.sync.strategies.pacing import StepShares
from dreamp2p.sync.strategies.plans import PlanBook
from dreamp2p.sync.strategies.replicas import tensors_digest

log = logging.getLogger(__name__)


# Layer syncs at least this large measure the link end to end (bytes sent / round seconds): unlike the
# transport's hand-off rate, this sees through socket buffers and a shaper's token bucket, which absorb
# the first megabytes of a burst at several times the link's rate.
RATE_SAMPLE_MIN_BYTES = 256 << 10


def plan_summary(s: DreamDDP) -> str:
    """One line per iteration: which layers sync, and with what delay."""
    lines = []
    for h in range(s.plan.period):
        parts = []
        for sync in s.plan.syncs_at(h):
            names = f"{s.layers[sync.layers[0]].name}..{s.layers[sync.layers[-1]].name}"
            parts.append(names + (f" (+{sync.delay})" if sync.delay else "") + (" [repeat]" if sync.repeat else ""))
        lines.append(f"h{h}: " + (", ".join(parts) if parts else "-"))
    if s.ring_codecs is not None and s.ring_codecs.send:
        lines.append(f"link codecs: {', '.join(s.ring_codecs.send)}; all-gather {s.ring_codecs.gather}")
    elif s.sync_codec != s.plan_codec:
        lines.append(f"codec: {s.sync_codec} pseudo-gradients, {s.plan_codec} anchors")
    else:
        lines.append(f"codec: {s.plan_codec}")
    return "\n".join(lines)


class LinkPace:
    """What this member's layer syncs tell about its link to the next member: their pace (bytes sent /
    seconds), with the ring's latency chain taken off (`delivery_rate`)."""

    def __init__(self, world: int) -> None:
        self._filter = PaceFilter()
        # (members, the least RTT to the next member any control round read). The least: an RTT read while
        # syncs queue on the link includes that queueing, which the pace must keep. NaN until the first one
        self.latency: tuple[int, float] = (world, math.nan)

    @property
    def rate(self) -> float:
        """The link's rate (B/s) from recent layer syncs; NaN before the first."""
        return self._filter.rate

    def read_rtt(self, world: int, rtt: float) -> None:
        """A control round read ``rtt`` (NaN: none) on a ring of ``world`` members."""
        least = min((r for r in (self.latency[1], rtt) if math.isfinite(r)), default=math.nan)
        self.latency = (world, least)

    def sample(self, inf: InFlight) -> None:
        """Fold a finished sync's pace into the estimate, once.

        Taken as soon as the round is done, not when it lands: a sync launched at step 0 with a long delay
        would otherwise tell the control rounds nothing until it lands, and the first measured plan would be
        made from the transport's goodput alone, then re-made once the syncs' pace arrives.
        """
        fut = inf.fut
        if inf.rated or not fut.done() or fut.cancelled() or fut.exception() is not None:
            return
        inf.rated = True
        res = fut.result()
        if res.bytes_sent >= RATE_SAMPLE_MIN_BYTES and res.seconds > 0:
            world, rtt = self.latency
            self._filter.add(delivery_rate(res.bytes_sent, res.seconds, world, rtt))


class DreamDDP(Strategy):
    name = "dreamddp"
    buffers_inline = False  # buffer rounds hide behind the next step like the layer syncs

    def _setup(self) -> None:
        self.profiler = LayerProfiler(self.layers)
        self._blank = [LayerCost(layer.name, 0.0, 0.0, layer.nbytes) for layer in self.layers]
        self._plans = PlanBook(self.cfg, self._blank)
        self._inflight: list[InFlight] = []
        self._armed = ArmedSyncs(self.layers, self._launch)
        self._schedule = ControlSchedule(self.cfg, self.comm)
        self._pace = LinkPace(self.comm.world)
        self._replanner = Replanner(self.cfg)
        # (plan, link codecs) -> plan_summary text and the plan's digest
        self._summary: tuple[object, str, int] = (None, "", 0)
        # per layer: outer weights theta and momentum, from the parameters rank 0 just broadcast: equal on
        # every member, which the first period's checks confirm (see the module docstring)
        lr, mu = self.cfg.group_outer
        self._weights = OuterWeights(self.layers, lr, mu)
        self._weights.start()
        shares = StepShares(self.comm, self._clock) if self._clock is not None else None
        self._syncs = LayerSyncs(self.cfg, self.comm, self.layers, self.pin, self._weights, shares)
        self._delta_flush = DeltaFlush(self.comm, self._weights, self.layers, self.pin, self._wait, self._syncs.check)
        self._hooks = [p.register_post_accumulate_grad_hook(self._armed.on_grad) for p in self.params]
        if self.cfg.warmup_steps > 0:
            self.profiler.start()
        self._arm(0)

    # ------------------------------------------------------------------ backward hooks

    def _arm(self, step: int) -> None:
        """Prepare the syncs of ``step``: they launch as their layers' gradients become ready."""
        self._plans.adopt(step)
        self._armed.arm(self.plan, (step - self.plan.effective_step) % self.plan.period)

    def _launch(self, idx: int) -> None:
        key, layers = (self.plan.version, idx), set(self.plan.syncs[idx].layers)
        # still travelling from the previous period: it lands first, so its layers' theta moves through their
        # syncs in launch order. Paced by time (landings deferred), so must every sync of the same layers
        for inf in [f for f in self._inflight if f.key == key or (self._clock is not None and layers & {*f.layers})]:
            self._inflight.remove(inf)
            self._land(inf)
        anchor_codec = self.ring_codecs or self.plan_codec
        launched = self._syncs.launch(
            self.plan, idx, self.step_count, self._round(), anchor_codec, self._plans.delta_codec
        )
        self._inflight.append(launched)

    def _flush_params(self, round_id: int) -> RoundResult | None:
        """flush()'s trainable part through the compressed path (`dreamp2p.sync.strategies.deltaflush`)."""
        return self._delta_flush.run(round_id, self.cfg.flush_delta_codec(self._plans.delta_codec))

    @property
    def plan(self) -> Plan:
        """The plan in force."""
        return self._plans.plan

    @property
    def plan_history(self) -> list[tuple[int, int]]:
        """Every plan adopted, as (version, effective step), oldest first."""
        return self._plans.history

    @property
    def plan_codec(self) -> str:
        """The codec of the plan in force's anchors (of all its layer syncs without a delta codec)."""
        return self._plans.codec

    @property
    def sync_codec(self) -> str:
        """The codec nearly all layer syncs use, the one plans are priced at: the pseudo-gradients'."""
        return self._plans.delta_codec or self.plan_codec

    def _land(self, inf: InFlight, timeout: float | None = None) -> None:
        """Wait for a sync (and its check and shares' rounds, where it has them) and merge it; a failed one is
        skipped everywhere."""
        if all([self._wait(f, timeout) is not None for f in inf.rounds()]):  # every one waited for
            self._syncs.merge(inf)
        self._pace.sample(inf)

    def _held(self) -> list[Held]:
        # every sync in flight holds its snapshot and mean buffers until it lands
        return [*self._weights.held(), *LayerSyncs.held(inf.group for inf in self._inflight)]

    def outer_shards(self) -> dict[str, list[torch.Tensor]]:
        return self._weights.per_param()

    def outer_digest(self) -> str:
        """64 bits naming every layer's theta and outer momentum."""
        return f"{tensors_digest(t for views in self._weights.per_param().values() for t in views):016x}"

    @property
    def anchors_healed(self) -> int:
        """Anchors that found the members' outer weights different (and reset them)."""
        return self._weights.anchors_healed

    @property
    def repair_layers(self) -> tuple[int, ...]:
        """Layers whose next sync is an anchor because a check found the members' outer weights different."""
        return self._weights.repair_layers

    @property
    def ring_codecs(self) -> RingCodecPlan | None:
        """Per-link codecs in force (None unless ``link_codecs`` is set)."""
        return self._replanner.ring_codecs

    @property
    def basis_bw(self) -> float:
        """The bandwidth (B/s) the latest plan was made for (NaN before the first measured plan)."""
        return self._replanner.basis_bw

    @property
    def next_control_step(self) -> int:
        """The step the next control round launches at (agreed by every member)."""
        return self._schedule.next_step

    @property
    def controls_seen(self) -> list[tuple[int, float, float]]:
        """The latest control rounds' (landing step, planner's bandwidth, slowest goodput) in B/s, oldest first."""
        return self._replanner.seen()

    @property
    def last_gathered(self) -> Gathered | None:
        """What the last control round gathered (None before the first)."""
        return self._replanner.last_gathered

    # ------------------------------------------------------------------ step

    def _step(self) -> None:
        t = self.step_count
        self._armed.launch_rest()
        self._land_due(t)
        self._inner_step()
        self._stats.plan_version = self.plan.version
        if self.profiler.active:
            if t == 0:
                self.profiler.skip_step()  # the first step pays one-time costs: not representative
            else:
                self.profiler.end_step()
            if self.profiler.steps >= self.cfg.warmup_steps:
                self.profiler.stop()
        self._advance(t)

    def _tick(self) -> None:
        """Periods in time: the clock passes a step we do not train at; its syncs launch all the same (their
        layers' values as they stand), due ones land, and the control schedule goes on."""
        t = self.step_count
        self._armed.launch_rest()
        self._land_due(t)
        self._advance(t)

    def _land_due(self, t: int) -> None:
        # a failed round failed on every member: the layers keep their local values. Paced by time, a sync
        # lands once its rounds arrived, at its landing step or later: a slower member launches later, and
        # waiting would tie us to its pace (where it lands changes only our own mix, not theta)
        for inf in [f for f in self._inflight if f.land_step <= t and (self._clock is None or f.arrived())]:
            self._inflight.remove(inf)
            self._land(inf)

    def _advance(self, t: int) -> None:
        """The control schedule at the end of step ``t``, then the syncs of the next step armed."""
        control = self._schedule.landed(t)
        if control is not None:
            self._decide(control)
        if self._schedule.due(t):
            self._schedule.launch(t, self._replanner.control_interval(), self._round(), self._control_vector)
        self._arm(t + 1)

    def _control_vector(self) -> tuple[torch.Tensor, int]:
        """This member's slot of a control round (`pack_control`) and the member count it was packed for."""
        world, rank, goodput, rtt, floor = successor_link(self.comm)
        self._pace.read_rtt(world, rtt)
        for inf in self._inflight:
            self._pace.sample(inf)
        costs = self.profiler.costs() if self.profiler.steps else self._blank
        bw = link_bandwidth(goodput, floor, self._pace.rate)
        return pack_control(rank, world, bw, rtt, costs, self._pace.rate), world

    def _decide(self, control: Control) -> None:
        """Decide on a control round that has landed (its result is waited for if need be)."""
        land, fut, gathered, world = control
        if self._wait(fut) is None:
            return
        self._schedule.decided(land)
        # decided as of the agreed landing step, not the step we got here: a node that joined with this
        # round in flight and started past it adopts the plan with the members' phase
        self._plans.replan(
            self._replanner, unpack_control(gathered.work, world, self._blank, self._clock is not None), land, world
        )
        if not self._replanner.quiet:
            self._schedule.hasten(land)

    def plan_report(self) -> dict[str, Any]:
        """The plan in force with the profile and link it was made from (the run report's Gantt chart)."""
        return self._replanner.report(self.plan, tuple(self.profiler.costs()), self.comm.world, self.sync_codec)

    def _rearm(self) -> None:
        """Arm the step this node jumped to (a join or a resync, `Strategy.jump_to`).

        A control round restored with the state whose landing step lies before that step is decided first,
        with the plan in force at its landing step, as every member decided it there: its plan may take
        effect at or before our first step, and a node that ran that step on the older plan would launch
        rounds of groups no member runs, which hold everyone until the round deadline.
        """
        control = self._schedule.overdue(self.step_count)
        if control is not None:
            self._arm(control[0])  # adopt what the members had adopted by the landing step
            self._decide(control)
        self._schedule.catch_up(self.step_count, self._replanner.control_interval())
        self._arm(self.step_count)

    def _training_info(self) -> TrainingInfo:
        # published every step: the summary text is rebuilt only when the plan or the link codecs change
        # (the plan itself, not its version: a node that took the members' state may get another plan of
        # the same version, see Node.resync)
        key = (self.plan, self.ring_codecs)
        if self._summary[0] != key:
            self._summary = (key, plan_summary(self), self.plan.digest())
        plan = self.plan
        return TrainingInfo(
            self.name,
            self.step_count,
            plan.version,
            plan.effective_step,
            self._summary[1],
            plan_digest=self._summary[2],
            schedule_step=self._schedule.changed_at,
            # the control schedule and re-planning memory, which every member must hold alike
            schedule_digest=self._schedule.digest(self._replanner.state()),
            # a member waits for each round within its delay and launches one at least once a period, so
            # in one ring no member trails another by more than a period and a delay; twice that is margin
            # (a stretched plan's delays may exceed the configured cap)
            lag_steps=2 * (plan.period + max(self.cfg.delay_cap, *(s.delay for s in plan.syncs))),
        )

    def _finish(self, timeout: float | None) -> None:
        for inf in list(self._inflight):
            self._inflight.remove(inf)
            self._land(inf, timeout)
        self._schedule.finish(self._wait, timeout)

    def _drop(self) -> None:
        self._inflight.clear()
        self._schedule.drop()

    def _adopt_settings(self, changes: list[tuple[str, str, str]]) -> None:
        """A checkpoint saved under other settings (a period, a codec changed since): its plan, the plans'
        codecs and the re-planning memory were made for those, so they start over from this step as at a fresh
        start, under ours: a warm-up plan, then a measured plan at the first control round that measured the
        link. The outer weights, the repair set and the syncs in flight carry on. Every member resuming with
        the same settings from the same checkpoint starts over alike (a joiner then takes their state)."""
        step = self.step_count
        self._plans.restart(step)
        self._replanner = Replanner(self.cfg)
        self._schedule.restart(step)
        log.info(
            "resume: %s changed, so the plan starts over: warm-up plan (period %d) from step %d, then a measured one",
            ", ".join(name for name, _, _ in changes),
            self.plan.period,
            step,
        )
        self._arm(step)

    def _extra_state(self) -> dict[str, Any]:
        plans = self._plans.state()
        # the entries in the order checkpoints have always listed them
        state: dict[str, Any] = {
            "plan": plans["plan"],
            **self._schedule.state(),
            "next_plan": plans["next_plan"],
            **self._replanner.state(),
            "history": plans["history"],
            **self._weights.state(),
            "plan_codecs": plans["plan_codecs"],
            "delta_codecs": plans["delta_codecs"],
            "inflight": [r for inf in self._inflight if (r := inf.record(self.round_limit_s))],
        }
        record = self._schedule.record(self.round_limit_s)
        if record is not None:
            state["control"] = record
        return state

    def _load_extra_state(self, state: dict[str, Any]) -> None:
        if "plan" not in state:
            return
        self._plans.load(state)
        self._replanner.load(state)
        self._weights.load(state)
        self._inflight = [InFlight.restore(rec, self.layers, self.pin) for rec in state.get("inflight", [])]
        self._schedule.load(state, self.step_count, self.comm.world)
        self._arm(self.step_count)
