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
same gathered inputs, so all use the same codec for the rounds of a plan.

One plan for all: plans are computed only from inputs every peer holds bit-identically, gathered by a
small control all-reduce every ``control_every`` steps (each peer's link measurements and layer
profile), spaced out up to ``control_backoff`` times that while the link holds steady. Every peer runs the
same deterministic planner on them at the same step and adopts the result at the next step. Until the
first measured plan, a warm-up plan of two large syncs runs.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import logging
import math
from typing import Any

import torch

from dreamp2p.messages import RingCodecPlan, RoundResult, TrainingInfo
from dreamp2p.schedule.cost import LayerCost
from dreamp2p.schedule.dreamddp import warmup_plan
from dreamp2p.schedule.pace import PaceFilter, delivery_rate
from dreamp2p.schedule.plan import GroupSync, Plan
from dreamp2p.sync.model.groups import (
    GROUP_CONTROL,
    GROUP_FLUSH_DELTA,
    GROUP_FLUSH_THETA,
    anchor_check_group,
    anchor_group,
    plan_sync_group,
)
from dreamp2p.sync.model.layers import FlatGroup
from dreamp2p.sync.model.profiler import LayerProfiler
from dreamp2p.sync.strategies.base import Strategy
from dreamp2p.sync.strategies.control import (
    Control,
    Gathered,
    PlanRequest,
    Replanner,
    control_record,
    in_background,
    pack_control,
    restore_control,
    unpack_control,
)
from dreamp2p.sync.strategies.inflight import InFlight
from dreamp2p.sync.strategies.outer import OuterWeights, anchor_verdict

log = logging.getLogger(__name__)


# Layer syncs at least this large measure the link end to end (bytes sent / round seconds): unlike the
# transport's hand-off rate, this sees through socket buffers and a shaper's token bucket, which absorb
# the first megabytes of a burst at several times the link's rate.
RATE_SAMPLE_MIN_BYTES = 256 << 10
# syncs per period before the first measured plan (see `warmup_plan`)
WARMUP_GROUPS = 2


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


class DreamDDP(Strategy):
    name = "dreamddp"
    buffers_inline = False  # buffer rounds hide behind the next step like the layer syncs

    def _setup(self) -> None:
        self.profiler = LayerProfiler(self.layers)
        self._blank = [LayerCost(layer.name, 0.0, 0.0, layer.nbytes) for layer in self.layers]
        # before the link is measured: a few large syncs, landing as late as the WAN extension allows
        self.plan: Plan = warmup_plan(self._blank, self.cfg.period, WARMUP_GROUPS, delay=self.cfg.delay_cap)
        self._next_plan: Plan | None = None
        # a plan being made off the training thread: (its request, the future of (plan, codec))
        self._planning: tuple[PlanRequest, concurrent.futures.Future[tuple[Plan, str]]] | None = None
        self.plan_history: list[tuple[int, int]] = [(0, 0)]
        self._groups: dict[tuple[int, int], FlatGroup] = {}
        self._inflight: list[InFlight] = []
        self._layer_of = {id(p): layer.index for layer in self.layers for p in layer.params}
        self._armed: dict[int, set[int]] = {}
        self._pending: dict[int, int] = {}
        # (landing step, round, buffer, members it was packed for)
        self._control: Control | None = None
        # the step the next control round launches at: agreed memory (checkpointed), since its spacing
        # follows what the control rounds decided (`control_interval`)
        self._next_control = self._fixed_control_step(0)
        # the step the control schedule and re-planning memory last changed at (a launch or a landing): with
        # their digest, what heartbeats name beside the plan (see _training_info and `dreamp2p.peer.drift`)
        self._schedule_step = 0
        self._schedule_name: tuple[object, int] = (None, 0)  # (the memory, its digest), cached
        self._pace = PaceFilter()  # bytes sent / seconds of this member's recent layer syncs
        # (members, the least RTT to the next member any control round read): a sync's latency chain, taken
        # off its pace (`delivery_rate`). The least: an RTT read while syncs queue on the link includes that
        # queueing, which the pace must keep. Unknown (NaN) until the first control round
        self._ring_latency: tuple[int, float] = (self.comm.world, math.nan)
        self._replanner = Replanner(self.cfg)
        # (plan, link codecs) -> plan_summary text and the plan's digest
        self._summary: tuple[object, str, int] = (None, "", 0)
        # per layer: outer weights theta and momentum, from the parameters rank 0 just broadcast: equal on
        # every member, which the first period's checks confirm (see the module docstring)
        lr, mu = self.cfg.group_outer
        self._weights = OuterWeights(self.layers, lr, mu)
        self._weights.start()
        # codec of each plan's layer syncs (plan version -> name); warm-up syncs use the most compressive
        # candidate, since the link is not measured yet
        self._plan_codecs: dict[int, str] = {0: self._warmup_codec()}
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in self.params]
        if self.cfg.warmup_steps > 0:
            self.profiler.start()
        self._arm(0)

    def _warmup_codec(self) -> str:
        """The warm-up plan's codec: the most compressive candidate, since the link is not measured yet."""
        return self.cfg.plan_codecs[-1] if self.cfg.plan_codecs else self.cfg.codec

    # ------------------------------------------------------------------ backward hooks

    def _iteration(self, step: int) -> int:
        return (step - self.plan.effective_step) % self.plan.period

    def _arm(self, step: int) -> None:
        """Prepare the syncs of ``step``: they launch as their layers' gradients become ready."""
        if self._planning is not None and step >= self._planning[0].start:
            self._collect_plan()
        if self._next_plan is not None and step >= self._next_plan.effective_step:
            self.plan = self._next_plan
            self._next_plan = None
            self.plan_history.append((self.plan.version, self.plan.effective_step))
            log.info("adopted plan v%d at step %d", self.plan.version, step)
        h = self._iteration(step)
        self._armed = {i: set(s.layers) for i, s in enumerate(self.plan.syncs) if s.iteration == h}
        self._pending = {}
        for layers in self._armed.values():
            for li in layers:
                self._pending[li] = len(self.layers[li].params)

    def _on_grad(self, p: torch.Tensor) -> None:
        li = self._layer_of.get(id(p))
        if li is None or li not in self._pending:
            return
        self._pending[li] -= 1
        if self._pending[li]:
            return
        for idx in [i for i, rem in self._armed.items() if li in rem]:
            rem = self._armed[idx]
            rem.discard(li)
            if not rem:
                del self._armed[idx]
                self._launch(idx)

    def _launch(self, idx: int) -> None:
        sync: GroupSync = self.plan.syncs[idx]
        key = (self.plan.version, idx)
        for inf in [f for f in self._inflight if f.key == key]:
            # still travelling from the previous period: it must land before its buffers are reused
            self._inflight.remove(inf)
            self._land(inf)
        group = self._groups.get(key)
        if group is None:
            group = FlatGroup([p for li in sync.layers for p in self.layers[li].params], pin=self.pin)
            self._groups[key] = group
        gid = plan_sync_group(self.plan.version, idx)
        if self._averages_params(sync.layers):
            self._launch_anchor(sync, key, group, gid)
            return
        group.snapshot()
        # theta is read here, on the training thread that alone changes it; `work` is ours until launch
        self._weights.copy_theta(sync.layers, group.work)

        def pseudo_gradient() -> None:  # on the comm thread, once the snapshot has landed
            group.work.sub_(group.snap)

        fut = self.comm.allreduce_group(
            group,
            gid,
            self.cfg.delta_codec,
            plan_version=self.plan.version,
            round_id=self._round(),
            prepare=pseudo_gradient,
            error_feedback=self.cfg.error_feedback,
        )
        check, check_fut = self._sync_check(sync.layers, gid) if self._is_check(self.step_count) else (None, None)
        self._inflight.append(InFlight(self.step_count + sync.delay, key, group, sync.layers, fut, check, check_fut))

    def _flush_params(self, round_id: int) -> RoundResult | None:
        """flush()'s trainable part through the compressed path: every layer's pseudo-gradient at once in
        ``delta_codec`` with a check of the outer weights beside it, then params = theta - mean pseudo-gradient
        (the members' mean up to the codec's error) and theta with them, identical on every member whose
        theta agreed. None (flush() then averages in fp32) without a delta codec, when the round failed or
        when the check found the outer weights apart; flush()'s digest check confirms the result either way.
        """
        if not self.cfg.delta_codec or len(self.comm.members) == 1:
            return None
        layers = tuple(range(len(self.layers)))
        group = FlatGroup(self.params, pin=self.pin)  # every layer's parameters, in layer order, as theta's
        group.snapshot()
        self._weights.copy_theta(layers, group.work)

        def pseudo_gradient() -> None:  # on the comm thread, once the snapshot has landed
            group.work.sub_(group.snap)

        fut = self.comm.allreduce_group(
            group,
            GROUP_FLUSH_DELTA,
            self.cfg.delta_codec,
            round_id=round_id,
            prepare=pseudo_gradient,
        )
        check, check_fut = self._check_round(layers, GROUP_FLUSH_THETA, round_id)
        res = self._wait(fut)
        checked = self._wait(check_fut)
        if res is None or checked is None:
            return None
        if anchor_verdict(check.work) != "agree":
            log.warning("flush: outer weights differ between members; the parameters are averaged in fp32")
            return None
        mean = torch.empty_like(group.work)
        self._weights.copy_theta(layers, mean)
        mean.sub_(group.work)  # theta - mean(theta - params) = mean(params), identical on every member
        group.write(mean)
        self._weights.set_theta(layers, mean)
        return res

    def _is_check(self, step: int) -> bool:
        """Whether a sync launched at ``step`` checks the outer weights (decided from the step: agreed by all)."""
        return (step // self.cfg.period) % self.cfg.anchor_every == 0

    def _averages_params(self, layers: tuple[int, ...]) -> bool:
        """Whether a sync of ``layers`` is an anchor, from agreed memory only: always without a delta codec;
        otherwise where a check asked for it."""
        return not self.cfg.delta_codec or self._weights.needs_anchor(layers)

    def _check_round(
        self, layers: tuple[int, ...], group_id: int, round_id: int, plan_version: int = 0
    ) -> tuple[FlatGroup, concurrent.futures.Future[RoundResult]]:
        """The 17-element round of (flag, digest bits) that checks ``layers``' outer weights on every member."""
        check = FlatGroup([self._weights.check_vector(layers)])
        check.snapshot()
        fut = self.comm.allreduce_group(
            check, group_id, "fp32", plan_version=plan_version, round_id=round_id, guard_norm=False
        )
        return check, fut

    def _sync_check(
        self, layers: tuple[int, ...], gid: int
    ) -> tuple[FlatGroup, concurrent.futures.Future[RoundResult]]:
        """The check beside layer sync ``gid`` of the plan in force."""
        return self._check_round(layers, anchor_check_group(gid), self._round(), self.plan.version)

    def _launch_anchor(self, sync: GroupSync, key: tuple[int, int], group: FlatGroup, gid: int) -> None:
        group.snapshot()
        fut = self.comm.allreduce_group(
            group,
            anchor_group(gid),
            self.ring_codecs or self.plan_codec,
            plan_version=self.plan.version,
            round_id=self._round(),
        )
        check, check_fut = self._sync_check(sync.layers, gid)
        inf = InFlight(self.step_count + sync.delay, key, group, sync.layers, fut, check, check_fut, anchor=True)
        self._inflight.append(inf)

    @property
    def plan_codec(self) -> str:
        """The codec of the plan in force's anchors (of all its layer syncs without a delta codec)."""
        return self._plan_codecs.get(self.plan.version, self.cfg.codec)

    @property
    def sync_codec(self) -> str:
        """The codec nearly all layer syncs use, the one plans are priced at: the pseudo-gradients'."""
        return self.cfg.delta_codec or self.plan_codec

    def _land(self, inf: InFlight, timeout: float | None = None) -> None:
        """Wait for a sync (and an anchor's check round) and merge it; a failed one is skipped everywhere."""
        res = self._wait(inf.fut, timeout)
        checked = self._wait(inf.check_fut, timeout) if inf.check_fut is not None else None
        if res is not None and (inf.check_fut is None or checked is not None):
            self._merge(inf)
        self._sample_rate(inf)

    def _sample_rate(self, inf: InFlight) -> None:
        """Fold a finished sync's pace (bytes sent / round seconds) into the link estimate, once.

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
            world, rtt = self._ring_latency
            self._pace.add(delivery_rate(res.bytes_sent, res.seconds, world, rtt))

    def _merge(self, inf: InFlight) -> None:
        """Apply a landed sync: the outer step per layer, then params = theta + local progress.

        A pseudo-gradient whose check found the members' outer weights different is applied nowhere (the
        layers keep their local values, as after a failed round) and makes the layers' next sync an anchor.
        """
        verdict = anchor_verdict(inf.check.work) if inf.check is not None else "agree"
        if self._weights.land(inf.group.work, inf.layers, anchor=inf.anchor, verdict=verdict):
            inf.group.merge()

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
        return self._next_control

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
        for idx in sorted(self._armed):  # layers that produced no gradient this step
            self._launch(idx)
        self._armed.clear()
        for inf in [f for f in self._inflight if f.land_step <= t]:
            self._inflight.remove(inf)
            self._land(inf)  # a failed round failed on every member: the layers keep their local values
        self._inner_step()
        self._stats.plan_version = self.plan.version
        if self.profiler.active:
            if t == 0:
                self.profiler.skip_step()  # the first step pays one-time costs: not representative
            else:
                self.profiler.end_step()
            if self.profiler.steps >= self.cfg.warmup_steps:
                self.profiler.stop()
        self._control_round(t)
        self._forget_old_groups()
        self._arm(t + 1)

    def _control_round(self, t: int) -> None:
        cfg = self.cfg
        if self._control is not None and self._control[0] <= t:
            control, self._control = self._control, None
            self._decide(control)
        if self._control is None and t >= self._next_control:
            self._next_control = t + self._replanner.control_interval()
            self._schedule_step = t
            links = {s.peer: s for s in self.comm.links()}
            members = self.comm.members  # read once: the view may change on the comm thread meanwhile
            world, rank = len(members), members.index(self.comm.node_id)
            succ = members[(rank + 1) % world] if world > 1 else None
            snap = links.get(succ) if succ else None
            bw = snap.goodput_Bps if snap is not None and snap.goodput_Bps > 0 else math.nan
            rtt = snap.rtt_s if snap is not None and snap.rtt_s > 0 else math.nan
            least = min((r for r in (self._ring_latency[1], rtt) if math.isfinite(r)), default=math.nan)
            self._ring_latency = (world, least)
            for inf in self._inflight:
                self._sample_rate(inf)
            costs = self.profiler.costs() if self.profiler.steps else self._blank
            group = FlatGroup([pack_control(rank, world, bw, rtt, costs, self._pace.rate)])
            group.snapshot()
            fut = self.comm.allreduce_group(group, GROUP_CONTROL, "fp32", round_id=self._round(), guard_norm=False)
            self._control = (t + cfg.control_lead, fut, group, world)

    def _decide(self, control: Control) -> None:
        """Decide on a control round that has landed (its result is waited for if need be)."""
        land, fut, gathered, world = control
        if self._wait(fut) is not None:
            self._schedule_step = max(self._schedule_step, land)
            # decided as of the agreed landing step, not the step we got here: a node that joined with
            # this round in flight and started past it adopts the plan with the members' phase
            self._on_gathered(unpack_control(gathered.work, world, self._blank), land, world)
            if not self._replanner.quiet:
                # the link moved or a plan was made: the rounds that confirm the change (replan_sustain) or
                # watch the new plan come at the full pace
                launched = land - self.cfg.control_lead
                self._next_control = min(self._next_control, launched + self.cfg.control_every)

    def _on_gathered(self, g: Gathered, t: int, world: int) -> None:
        """Same inputs on every peer at the same step: the same decision everywhere.

        ``world`` is the member count the control round was packed for (equal on every member whose round
        succeeded), not the live view: views differ between members for a moment while one leaves or
        joins, and so do the shard rings of a region's ranks, which would then decide different plans.
        """
        self._collect_plan()  # a newer decision replaces the queued plan, as if it had been made at once
        version = max(self.plan.version, self._next_plan.version if self._next_plan else 0) + 1
        req = self._replanner.decide(g, t, self.plan, version, world)
        if req is not None:
            # the planner's search takes a good fraction of a step: run it beside training (torch kernels
            # release the GIL); the request fixes the version and adoption step, so waiting for the result
            # at that step (if it is not there yet) gives every member the same plan at the same step
            self._planning = (req, in_background(self._replanner.make, req))

    def _collect_plan(self) -> Plan | None:
        """Queue the plan being made, waiting for it if it is not ready yet; the queued plan, if any."""
        if self._planning is not None:
            req, fut = self._planning
            self._planning = None
            self._next_plan, self._plan_codecs[req.version] = fut.result()
        return self._next_plan

    def plan_report(self) -> dict[str, Any]:
        """The plan in force with the profile and link it was made from (the run report's Gantt chart)."""
        return self._replanner.report(self.plan, tuple(self.profiler.costs()), self.comm.world)

    def _rearm(self) -> None:
        """Arm the step this node jumped to (a join or a resync, `Strategy.jump_to`).

        A control round restored with the state whose landing step lies before that step is decided first,
        with the plan in force at its landing step, as every member decided it there: its plan may take
        effect at or before our first step, and a node that ran that step on the older plan would launch
        rounds of groups no member runs, which hold everyone until the round deadline.
        """
        control = self._control
        if control is not None and control[0] < self.step_count:
            self._control = None
            self._arm(control[0])  # adopt what the members had adopted by the landing step
            self._decide(control)
        # the members launched the control rounds we skipped: those that included us failed (we refused
        # their frames), deciding nothing, so each spaced the next as the memory we hold says
        while self._next_control < self.step_count:
            self._schedule_step = max(self._schedule_step, self._next_control)
            self._next_control += self._replanner.control_interval()
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
            schedule_step=self._schedule_step,
            schedule_digest=self._schedule_digest(),
            # a member waits for each round within its delay and launches one at least once a period, so
            # in one ring no member trails another by more than a period and a delay; twice that is margin
            lag_steps=2 * (plan.period + self.cfg.delay_cap),
        )

    def _schedule_digest(self) -> int:
        """64 bits naming the control schedule and re-planning memory, which every member must hold alike.

        Two sides of a partition keep their plan but run their own control rounds, so their memories part
        (how many rounds in a row saw the link steady, hence when the next round runs): then each side
        launches control rounds at steps the other skips, and both wait for the other's until the round
        deadline. Heartbeats name it beside the plan, and the side with the lesser name takes the others'
        state (`dreamp2p.peer.drift`), as for a plan it missed.
        """
        memory = (self._next_control, *self._replanner.state().values())
        if self._schedule_name[0] != memory:
            raw = hashlib.sha256(repr(memory).encode()).digest()
            self._schedule_name = (memory, int.from_bytes(raw[:8], "big"))
        return self._schedule_name[1]

    def _fixed_control_step(self, step: int) -> int:
        """The first control step at or after ``step`` on the fixed grid: the first control round of a run,
        and where a checkpoint that predates spacing resumes."""
        start, every = max(self.cfg.warmup_steps, 1), self.cfg.control_every
        return start + max(0, -(-(step - start) // every)) * every

    def _forget_old_groups(self) -> None:
        live = {f.key for f in self._inflight}
        for key in [k for k in self._groups if k[0] != self.plan.version and k not in live]:
            del self._groups[key]

    def _finish(self, timeout: float | None) -> None:
        for inf in list(self._inflight):
            self._inflight.remove(inf)
            self._land(inf, timeout)
        # finish the control round but keep it: its result is used at its landing step, as on every peer;
        # one that failed did so everywhere, and no member will use it
        if self._control is not None and self._wait(self._control[1], timeout) is None:
            self._control = None

    def _drop(self) -> None:
        self._inflight.clear()
        self._control = None

    def _adopt_settings(self, changes: list[tuple[str, str, str]]) -> None:
        """A checkpoint saved under other settings (a period, a codec changed since): its plan, the plans'
        codecs and the re-planning memory were made for those, so they start over from this step as at a fresh
        start, under ours: a warm-up plan, then a measured plan at the first control round that measured the
        link. The outer weights, the repair set and the syncs in flight carry on. Every member resuming with
        the same settings from the same checkpoint starts over alike (a joiner then takes their state)."""
        step = self.step_count
        warmup = warmup_plan(self._blank, self.cfg.period, WARMUP_GROUPS, delay=self.cfg.delay_cap)
        self.plan = dataclasses.replace(warmup, effective_step=step)
        self._next_plan = None
        self._planning = None
        self._groups.clear()
        self._replanner = Replanner(self.cfg)
        self._schedule_step = step  # the re-planning memory starts over here, on every member alike
        self.plan_history = [(self.plan.version, step)]
        self._plan_codecs = {self.plan.version: self._warmup_codec()}
        log.info(
            "resume: %s changed, so the plan starts over: warm-up plan (period %d) from step %d, then a measured one",
            ", ".join(name for name, _, _ in changes),
            self.plan.period,
            step,
        )
        self._arm(step)

    def _extra_state(self) -> dict[str, Any]:
        state: dict[str, Any] = {
            "plan": self.plan.to_dict(),
            "next_control": self._next_control,
            "schedule_step": self._schedule_step,
            "next_plan": queued.to_dict() if (queued := self._collect_plan()) is not None else None,
            **self._replanner.state(),
            "history": [list(h) for h in self.plan_history],
            **self._weights.state(),
            "plan_codecs": dict(self._plan_codecs),
            "inflight": [r for inf in self._inflight if (r := inf.record(self.round_limit_s))],
        }
        record = control_record(self._control, self.round_limit_s) if self._control is not None else None
        if record is not None:
            state["control"] = record
        return state

    def _load_extra_state(self, state: dict[str, Any]) -> None:
        if "plan" in state:
            self.plan = Plan.from_dict(state["plan"])
            # group buffers are cached per (version, sync); a loaded plan of a version we held may group
            # other layers (a node that took the members' state after a partition, see Node.resync)
            self._groups.clear()
            nxt = state.get("next_plan")
            self._next_plan = Plan.from_dict(nxt) if nxt else None
            self._planning = None
            self._replanner.load(state)
            self.plan_history = [(int(v), int(e)) for v, e in state.get("history", [])]
            self._weights.load(state)
            self._plan_codecs.update({int(v): str(c) for v, c in state.get("plan_codecs", {}).items()})
            self._inflight = [InFlight.restore(rec, self.layers, self.pin) for rec in state.get("inflight", [])]
            control = state.get("control")
            if control is not None:
                self._control = restore_control(control, self.comm.world)
            self._next_control = int(state.get("next_control", self._fixed_control_step(self.step_count)))
            self._schedule_step = int(state.get("schedule_step", 0))
            self._arm(self.step_count)
