"""DreamDDP's control round and re-planning: what every member gathers, when, and the plan it derives alike.

One plan for all (DreamDDP, Tang et al., arXiv 2502.11058, extended for the WAN in docs/PLANNING.md):
plans are computed only from inputs every member holds bit-identically, gathered by a small control
all-reduce (each member's link measurements and layer profile). Every member runs the same
deterministic planner on them at the same step, so no plan needs to be sent.

Codec per plan (bandwidth-aware compression, arXiv 2408.14736): with ``plan_codecs`` (least lossy first),
a plan is made for each candidate's wire size and the least lossy candidate is taken whose plan hides
every sync within the link budget; per-link codecs (``link_codecs``) are re-chosen from the gathered
link bandwidths instead. With pseudo-gradients (``delta_codec``) the plan is made for their size and the
plan codecs carry only the anchors.
"""

from __future__ import annotations

import collections
import concurrent.futures
import hashlib
import logging
import math
import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any, TypeVar

import torch

from dreamp2p.config.sync import SyncConfig
from dreamp2p.messages import RingCodecPlan, RoundResult
from dreamp2p.schedule.cost import LayerCost, LinkModel
from dreamp2p.schedule.dreamddp import plan_dreamddp
from dreamp2p.schedule.linkcodec import effective_bandwidth, plan_ring_codecs, round_wire_ratio, wire_ratio
from dreamp2p.schedule.plan import Plan
from dreamp2p.schedule.plancodec import choose_anchor_codec
from dreamp2p.schedule.stretch import choose_codec_and_period, choose_delta_codec, choose_period, stretched_periods
from dreamp2p.sync.comm.collective import Collective
from dreamp2p.sync.model.groups import GROUP_CONTROL
from dreamp2p.sync.model.layers import FlatGroup
from dreamp2p.sync.strategies.base import settled
from dreamp2p.sync.strategies.outercheck import Wait

log = logging.getLogger(__name__)
A = TypeVar("A")
R = TypeVar("R")
SEEN_KEPT = 64  # control rounds a Replanner remembers for the run report


@dataclass(frozen=True)
class Gathered:
    """What one control round told every peer: per-rank link stats and the slowest member's layer profile."""

    bandwidth_Bps: float  # slowest measured link (inf if none measured yet)
    rtt_s: float  # largest measured RTT
    costs: tuple[LayerCost, ...]
    # per rank of the control round: its link to the next rank (NaN where not measured yet)
    link_bandwidths: tuple[float, ...] = ()


def pack_control(
    rank: int, world: int, bw: float, rtt: float, costs: list[LayerCost], sync_rate: float = math.nan
) -> torch.Tensor:
    """This rank's slot of the control vector: its link to the next rank (goodput, RTT), the pace of its
    own layer syncs (bytes sent / round seconds, NaN if none yet) and its layer profile."""
    slot = 3 + 2 * len(costs)
    vec = torch.zeros(world * slot, dtype=torch.float32)
    base = rank * slot
    vec[base] = bw if math.isfinite(bw) else 0.0
    vec[base + 1] = rtt if math.isfinite(rtt) else 0.0
    vec[base + 2] = sync_rate if math.isfinite(sync_rate) else 0.0
    for i, c in enumerate(costs):
        vec[base + 3 + i] = c.fwd_s
        vec[base + 3 + len(costs) + i] = c.bwd_s
    return vec


def unpack_control(mean: torch.Tensor, world: int, template: list[LayerCost], fastest: bool = False) -> Gathered:
    """Turn the averaged control vector (each rank filled only its slot) back into the gathered view.

    The planner's bandwidth is the slowest of every link's goodput and the syncs' pace (a ring runs at its
    slowest link, and the syncs see through buffers that inflate goodput). A ring round has one pace on
    every member, but each member times it from its own launch, so a member that launched early (a fast
    one, waiting for a slow member's backward) reads it diluted by that wait: the syncs' pace is the
    highest member's. Per-link codecs choose from the goodputs alone. The layer profile
    is the slowest member's (the largest forward + backward): in lockstep every member steps at its pace,
    and its backward is the window a sync overlaps with; a member not profiled yet (zeros) is not counted.
    ``fastest``: periods in time, where the cluster's step clock runs at its fastest member's pace, whose
    profile is taken instead.
    """
    n = len(template)
    slots = (mean.double() * world).view(world, 3 + 2 * n)
    bws = [float(b) for b in slots[:, 0] if float(b) > 0]
    rtts = [float(r) for r in slots[:, 1] if float(r) > 0]
    rates = [float(r) for r in slots[:, 2] if float(r) > 0]
    totals = slots[:, 3:].sum(1)
    if fastest and bool((totals > 0).any()):
        member = int(torch.where(totals > 0, totals, math.inf).argmin())
    else:
        member = int(totals.argmax())
    fwd = slots[member, 3 : 3 + n]
    bwd = slots[member, 3 + n :]
    costs = tuple(
        LayerCost(c.name, max(0.0, float(fwd[i])), max(0.0, float(bwd[i])), c.nbytes) for i, c in enumerate(template)
    )
    links = tuple(float(b) if float(b) > 0 else math.nan for b in slots[:, 0])
    paces = [max(rates)] if rates else []
    slowest = min(bws + paces) if bws or paces else math.inf
    return Gathered(slowest, max(rtts) if rtts else 0.0, costs, links)


def in_background(fn: Callable[[A], R], arg: A) -> concurrent.futures.Future[R]:
    """Run ``fn(arg)`` on a daemon thread of its own; its result or exception arrives in the future."""
    fut: concurrent.futures.Future[R] = concurrent.futures.Future()

    def run() -> None:
        try:
            fut.set_result(fn(arg))
        except BaseException as exc:  # handed to whoever waits for the result, re-raised there
            fut.set_exception(exc)

    threading.Thread(target=run, name="dreamp2p-planner", daemon=True).start()
    return fut


def control_interval(every: int, backoff: int, quiet: int) -> int:
    """Steps between control rounds after ``quiet`` steady ones in a row: ``every``, doubling per quiet round
    up to ``backoff`` x ``every``. A steady link needs no round every few steps, and each costs comm CPU on
    the trainer's cores; a change resets ``quiet``, so a drifting link is watched at the full pace again."""
    return every * min(backoff, 1 << min(quiet, 30))


@dataclass(frozen=True)
class PlanRequest:
    """Everything a new plan is made from, fixed when the members decided to re-plan."""

    costs: tuple[LayerCost, ...]
    link: LinkModel
    version: int
    start: int  # the step it takes effect at (a period boundary of the plan in force)


@dataclass(frozen=True)
class MadePlan:
    """A plan and the codecs of its syncs: ``anchors`` for syncs that average parameters (every sync without a
    delta codec), ``deltas`` for the pseudo-gradients ("" without a delta codec)."""

    plan: Plan
    anchors: str
    deltas: str = ""


class Replanner:
    """Decides, from each gathered view, whether to re-plan and which plan and codec follow.

    Holds the decision's memory (the bandwidth the plan in force was made for, how many control rounds in
    a row saw it changed, how many in a row saw nothing to do) and the per-link codecs; every member holds
    the same and decides alike.
    """

    def __init__(self, cfg: SyncConfig) -> None:
        self.cfg = cfg
        # wire bytes per fp32 byte the plan's syncs are priced at: the pseudo-gradients' codec where they
        # are on (anchors, in the plan codecs, follow only a failed check), else the base codec
        self.ratio = wire_ratio(cfg.delta_codec or cfg.codec)
        self.basis_bw = math.nan
        self.changed = 0
        self.quiet = 0  # control rounds in a row, since the last change or re-plan, that saw the link steady
        self._seen: collections.deque[tuple[int, float, float]] = collections.deque(maxlen=SEEN_KEPT)
        self.last_gathered: Gathered | None = None
        # per-link codecs (bandwidth-aware compression), re-chosen at every control round; until the first
        # one every link sends the base codec, but rounds already accept (and are laid out for) all of them
        self.ring_codecs: RingCodecPlan | None = (
            plan_ring_codecs(cfg.codec, cfg.link_codecs, [], cfg.link_codec_tolerance) if cfg.link_codecs else None
        )

    def state(self) -> dict[str, Any]:
        """Checkpoint entries: the re-planning memory (``basis_bw``, ``changed``, ``quiet``)."""
        return {"basis_bw": self.basis_bw, "changed": self.changed, "quiet": self.quiet}

    def load(self, state: dict[str, Any]) -> None:
        self.basis_bw = float(state.get("basis_bw", math.nan))
        self.changed = int(state.get("changed", 0))
        self.quiet = int(state.get("quiet", 0))

    def seen(self) -> list[tuple[int, float, float]]:
        """The last `SEEN_KEPT` decided control rounds, oldest first: (landing step, the bandwidth the planner
        would use, the slowest link's transport goodput), in B/s (the difference is the syncs' own pace)."""
        return list(self._seen)

    def control_interval(self) -> int:
        """Steps from a control round launched now to the next one (`control_interval`, on agreed memory)."""
        return control_interval(self.cfg.control_every, self.cfg.control_backoff, self.quiet)

    def report(self, plan: Plan, profiled: tuple[LayerCost, ...], world: int, codec: str = "") -> dict[str, Any]:
        """``plan`` with the layer costs and link it was made from (``profiled`` before any was gathered);
        ``codec``: what its syncs send, where not the codec plans start from (a fallback of delta_codec)."""
        g = self.last_gathered
        costs = g.costs if g is not None else profiled
        bw = g.bandwidth_Bps if g is not None and math.isfinite(g.bandwidth_Bps) else 1e12
        return {
            "plan": plan.to_dict(),
            # host buffers between steps: 8 B per parameter of the syncs in flight (layersync.LayerSyncs.launch)
            "inflight_share": plan.inflight_share([c.nbytes for c in costs]),
            "costs": [asdict(c) for c in costs],
            "round_cost_s": self.cfg.round_cost_s,
            "link": {
                "bandwidth_Bps": bw,
                "rtt_s": g.rtt_s if g is not None else 0.0,
                "world": world,
                "codec_ratio": wire_ratio(codec) if codec else self.ratio,
            },
        }

    def decide(self, g: Gathered, t: int, plan: Plan, next_version: int, world: int) -> PlanRequest | None:
        """Whether to re-plan on ``g``, and what for; None keeps the plan in force (and the one queued).

        Cheap: the plan itself is made by :meth:`make`, which a caller may run off its own thread, since
        the request already fixes everything every member must agree on (version, adoption step, inputs).
        ``next_version``: the version the new plan takes; 1 means no measured plan was made yet.
        """
        cfg = self.cfg
        self.last_gathered = g
        goodputs = [b for b in g.link_bandwidths if math.isfinite(b)]
        self._seen.append((t, g.bandwidth_Bps, min(goodputs) if goodputs else math.nan))
        bandwidth = g.bandwidth_Bps
        if self.ring_codecs is not None and g.link_bandwidths:
            self.ring_codecs = plan_ring_codecs(cfg.codec, cfg.link_codecs, g.link_bandwidths, cfg.link_codec_tolerance)
            # slow links compress more: the ring runs as fast as an all-base-codec ring on this bandwidth
            effective = effective_bandwidth(self.ring_codecs, g.link_bandwidths)
            bandwidth = effective if math.isfinite(effective) else bandwidth
        # the first measured plan waits for a measured link: planning for an unknown one as if it were free
        # would pick no delay at all and expose every sync until the next re-plan
        measured = math.isfinite(g.bandwidth_Bps) or world == 1
        replan = next_version == 1 and measured
        if not replan and math.isfinite(g.bandwidth_Bps):
            basis = self.basis_bw
            changed = not math.isfinite(basis) or abs(g.bandwidth_Bps / basis - 1.0) > cfg.replan_threshold
            self.changed = self.changed + 1 if changed else 0
            replan = self.changed >= cfg.replan_sustain
        # only a measured plan kept on a steady link counts as quiet: until then every round may decide
        self.quiet = self.quiet + 1 if not replan and self.changed == 0 and next_version > 1 else 0
        if not replan:
            return None
        link = LinkModel(
            bandwidth_Bps=bandwidth if math.isfinite(bandwidth) else 1e12,
            rtt_s=g.rtt_s,
            world=len(g.link_bandwidths) or world,
            codec_ratio=self.ratio,
            margin=cfg.link_margin,
        )
        # adopted at the next period boundary of the plan in force: a plan switched mid-period would sync
        # layers again soon after the old plan did, two rounds contending for the link at once
        start = t + 1 + (plan.effective_step - t - 1) % plan.period
        self.basis_bw = g.bandwidth_Bps
        self.changed = 0
        log.info("plan v%d computed at step %d from bw %.3g B/s rtt %.3g s", next_version, t, g.bandwidth_Bps, g.rtt_s)
        return PlanRequest(g.costs, link, next_version, start)

    def make(self, req: PlanRequest) -> MadePlan:
        """The plan and its codecs for ``req``: pure and deterministic, so every member makes the same. The plan's
        period is ``sync.period``, or a multiple of it where the link cannot carry the syncs in that time
        (`dreamp2p.schedule.stretch`); its pseudo-gradients use the first codec of ``sync.delta_chain`` that
        the link carries (`choose_delta_codec`)."""
        cfg = self.cfg
        periods = stretched_periods(cfg.period, cfg.max_stretch)

        def make_plan(lk: LinkModel, H: int) -> Plan:
            return plan_dreamddp(
                list(req.costs),
                lk,
                H,
                version=req.version,
                effective_step=req.start,
                # a stretched period is a larger bound too: a sync may land up to a period after its launch
                max_delay=H - 1 if cfg.max_delay is None else cfg.max_delay,
                bubble_fill=cfg.bubble_fill,
                round_cost_s=cfg.round_cost_s,
            )

        if cfg.delta_codec:
            return self._make_deltas(req, periods, make_plan)
        if not cfg.plan_codecs or cfg.link_codecs:  # per-link codecs replace the per-plan choice
            plan = choose_period(periods, req.costs, req.link, lambda H: make_plan(req.link, H)).plan
            return MadePlan(plan, cfg.codec)
        candidates = [(c, wire_ratio(c)) for c in cfg.plan_codecs]
        picked = choose_codec_and_period(candidates, req.costs, req.link, periods, make_plan, cfg.codec_link_budget)
        log.info(
            "plan v%d: codec %s, period %d (link busy %.0f%% of the period, predicted exposed %.3g s per period)",
            req.version,
            picked.codec,
            picked.plan.period,
            100 * picked.busy_fraction,
            picked.exposed_s,
        )
        return MadePlan(picked.plan, picked.codec)

    def _make_deltas(
        self, req: PlanRequest, periods: tuple[int, ...], make_plan: Callable[[LinkModel, int], Plan]
    ) -> MadePlan:
        """`make` where the plan's syncs are pseudo-gradients: planned for their codec's size; the plan codecs
        carry only the anchors that follow a failed check."""
        cfg = self.cfg
        deltas, choice = choose_delta_codec(
            [(c, round_wire_ratio(c, req.link.world)) for c in cfg.delta_chain], req.costs, req.link, periods, make_plan
        )
        plan = choice.plan
        if deltas != cfg.delta_codec:
            log.info(
                "plan v%d: pseudo-gradients in %s with error feedback: the link could not carry them in %s",
                req.version,
                deltas,
                cfg.delta_codec,
            )
        if choice.stretch > 1:
            log.info(
                "plan v%d: period %d (%d x sync.period): the link could not carry the syncs of a period of %d; "
                "now busy %.0f%% of the period",
                req.version,
                plan.period,
                choice.stretch,
                cfg.period,
                100 * choice.busy_fraction,
            )
        if not cfg.plan_codecs or cfg.link_codecs:
            return MadePlan(plan, cfg.codec, deltas)
        candidates = [(c, wire_ratio(c)) for c in cfg.plan_codecs]
        anchor = choose_anchor_codec(candidates, list(req.costs), req.link, plan.period, plan, cfg.codec_link_budget)
        log.info("plan v%d: pseudo-gradients in %s, anchors in %s", req.version, deltas, anchor)
        return MadePlan(plan, anchor, deltas)


# A control round in flight: (the step its result is used at, the round, its buffer, the members it was
# packed for)
Control = tuple[int, concurrent.futures.Future[RoundResult], FlatGroup, int]


def control_record(control: Control, timeout: float) -> dict[str, Any] | None:
    """A control round's checkpoint record once it finished; None if it failed (everywhere: all-or-none,
    so no member will use it). RoundFailed when it is still in flight after ``timeout``."""
    land, fut, group, world = control
    if not settled(fut, timeout):
        return None
    return {"land": land, "mean": group.work.clone(), "world": world}


def restore_control(rec: dict[str, Any], world: int) -> Control:
    """The finished control round a :func:`control_record` describes; its result is used at the same step
    as on every other member. ``world``: the members, for records written before the field existed."""
    group = FlatGroup([rec["mean"]])
    group.work.copy_(rec["mean"])
    done: concurrent.futures.Future[RoundResult] = concurrent.futures.Future()
    done.set_result(RoundResult(GROUP_CONTROL, 0, 0.0, 0, 0, group.numel, "fp32", 0))
    return (int(rec["land"]), done, group, int(rec.get("world", world)))


def successor_link(comm: Collective) -> tuple[int, int, float, float, bool]:
    """(members, our rank, goodput B/s, RTT s, whether that goodput is only a floor) of our link to the next
    member, NaN where not measured yet: what this member's slot of a control round reports (`pack_control`,
    through `link_bandwidth`)."""
    links = {s.peer: s for s in comm.links()}
    members = comm.members  # read once: the view may change on the comm thread meanwhile
    world, rank = len(members), members.index(comm.node_id)
    succ = members[(rank + 1) % world] if world > 1 else None
    snap = links.get(succ) if succ else None
    bw = snap.goodput_Bps if snap is not None and snap.goodput_Bps > 0 else math.nan
    rtt = snap.rtt_s if snap is not None and snap.rtt_s > 0 else math.nan
    return world, rank, bw, rtt, snap is not None and snap.goodput_is_floor


def link_bandwidth(goodput: float, floor: bool, sync_rate: float) -> float:
    """The bandwidth a member reports for its link: its ``goodput``, unless that is only a ``floor`` and its
    own syncs' pace (``sync_rate``, NaN if none yet) is known; then the larger of the two.

    The planner takes the slowest of the links and the paces, so a floor below the pace would set the plan
    while the syncs themselves show the link carries more: at 5 Mbit/s a burst that met a sync read 0.25 MB/s
    and the planner stretched the period 4x, while the syncs' pace read 0.6 MB/s. A full goodput sample below
    the pace still counts: that link may have slowed since the syncs of the pace's window.
    """
    if floor and math.isfinite(sync_rate):
        return max(goodput, sync_rate) if math.isfinite(goodput) else sync_rate
    return goodput


class ControlSchedule:
    """When control rounds run, and the one in flight: agreed memory, the same on every member.

    The step the next round launches at is checkpointed, since its spacing follows what the rounds decided
    (`control_interval`). The step the schedule or the re-planning memory last changed at, with their
    digest, is what heartbeats name beside the plan: two sides of a partition keep their plan but run their
    own control rounds, so their memories part, and each side would wait for rounds the other skips until
    the round deadline; the side with the lesser name takes the others' state (`dreamp2p.peer.drift`).
    """

    def __init__(self, cfg: SyncConfig, comm: Collective) -> None:
        self._cfg = cfg
        self._comm = comm
        self._control: Control | None = None
        self.next_step = self._fixed_step(0)
        self.changed_at = 0  # the step the schedule or the re-planning memory last changed at
        self._name: tuple[object, int] = (None, 0)  # (the memory, its digest), cached

    def _fixed_step(self, step: int) -> int:
        """The first control step at or after ``step`` on the fixed grid: the first control round of a run,
        and where a checkpoint that predates spacing resumes."""
        start, every = max(self._cfg.warmup_steps, 1), self._cfg.control_every
        return start + max(0, -(-(step - start) // every)) * every

    def landed(self, step: int) -> Control | None:
        """The round in flight, taken out of flight, if its result is used at or before ``step``."""
        if self._control is not None and self._control[0] <= step:
            control, self._control = self._control, None
            return control
        return None

    def overdue(self, step: int) -> Control | None:
        """The round in flight, taken out of flight, if its result was used before ``step`` (a jump)."""
        if self._control is not None and self._control[0] < step:
            control, self._control = self._control, None
            return control
        return None

    def due(self, step: int) -> bool:
        """Whether a control round launches at ``step``."""
        return self._control is None and step >= self.next_step

    def launch(
        self, step: int, interval: int, round_id: int, contribution: Callable[[], tuple[torch.Tensor, int]]
    ) -> None:
        """Launch the round of ``step``, the next one ``interval`` steps on. ``contribution``: this member's
        control vector and the member count it was packed for, read once the schedule has moved on."""
        self.next_step = step + interval
        self.changed_at = step
        vec, world = contribution()
        group = FlatGroup([vec])
        group.snapshot()
        fut = self._comm.allreduce_group(group, GROUP_CONTROL, "fp32", round_id=round_id, guard_norm=False)
        self._control = (step + self._cfg.control_lead, fut, group, world)

    def decided(self, land: int) -> None:
        """A round whose result was used at ``land`` decided (its re-planning memory may have changed)."""
        self.changed_at = max(self.changed_at, land)

    def hasten(self, land: int) -> None:
        """After a round landing at ``land`` that saw a change or made a plan: the rounds that confirm the
        change (replan_sustain) or watch the new plan come at the full pace again."""
        launched = land - self._cfg.control_lead
        self.next_step = min(self.next_step, launched + self._cfg.control_every)

    def catch_up(self, step: int, interval: int) -> None:
        """Move past the rounds the members launched before ``step`` (a join or a resync): those that
        included us failed (we refused their frames), deciding nothing, so each spaced the next by
        ``interval``."""
        while self.next_step < step:
            self.changed_at = max(self.changed_at, self.next_step)
            self.next_step += interval

    def digest(self, replanning: dict[str, Any]) -> int:
        """64 bits naming the schedule and the re-planning memory (``replanning``: `Replanner.state`)."""
        memory = (self.next_step, *replanning.values())
        if self._name[0] != memory:
            raw = hashlib.sha256(repr(memory).encode()).digest()
            self._name = (memory, int.from_bytes(raw[:8], "big"))
        return self._name[1]

    def finish(self, wait: Wait, timeout: float | None) -> None:
        """Finish the round in flight but keep it: its result is used at its landing step, as on every peer;
        one that failed did so everywhere, and no member will use it."""
        if self._control is not None and wait(self._control[1], timeout) is None:
            self._control = None

    def drop(self) -> None:
        self._control = None

    def restart(self, step: int) -> None:
        """The re-planning memory starts over at ``step``, on every member alike."""
        self.changed_at = step

    def state(self) -> dict[str, Any]:
        """Checkpoint entries ``next_control`` and ``schedule_step``."""
        return {"next_control": self.next_step, "schedule_step": self.changed_at}

    def record(self, timeout: float) -> dict[str, Any] | None:
        """The checkpoint entry ``control`` (`control_record`); None without a finished round in flight."""
        return control_record(self._control, timeout) if self._control is not None else None

    def load(self, state: dict[str, Any], step: int, world: int) -> None:
        """From checkpoint entries, resuming at ``step``; ``world``: the members, for old control records."""
        control = state.get("control")
        if control is not None:
            self._control = restore_control(control, world)
        self.next_step = int(state.get("next_control", self._fixed_step(step)))
        self.changed_at = int(state.get("schedule_step", 0))
