"""How a DreamDDP layer sync is launched and merged: a pseudo-gradient or an anchor, with its check round.

Most syncs average ``theta - params`` in ``delta_codec`` (a lossy codec then errs in proportion to the
update, not to the weights). Every ``anchor_every``-th period, by the launch step so every member agrees
without asking, a sync carries a 17-element check round beside it; a layer a check found apart syncs next
as an anchor, which averages the parameters themselves with a check of its own (see
`dreamp2p.sync.strategies.outer` for what a landing does with each). A pseudo-gradient whose check found
the members' outer weights different is applied nowhere, as after a failed round.

A sync launched at one step lands ``delay`` steps later (docs/PLANNING.md, the WAN extension of DreamDDP,
arXiv 2502.11058). Every member that took part applies it at the same step, so a checkpoint taken while it
travels keeps its result (`InFlight.record`), and a joiner or a resumed node applies the same average at
the same step. A sync's flat buffers (its snapshot and its mean) are made at its launch and dropped when it
lands: between steps a member holds them only for the syncs in flight.

Periods in time (``sync.periods = "time"``, `dreamp2p.sync.strategies.pacing`): a pseudo-gradient sync
carries ``w * (theta - params)``, ``w`` this member's share of the clock's last period, with the step's
shares' round beside it, and lands as the weighed mean ``sum(w g) / sum(w)``.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from dreamp2p.compression import get_codec
from dreamp2p.config.sync import SyncConfig
from dreamp2p.messages import RingCodecPlan, RoundResult
from dreamp2p.schedule.plan import Plan
from dreamp2p.sync.comm.collective import Collective
from dreamp2p.sync.model.groups import anchor_check_group, anchor_group, plan_sync_group
from dreamp2p.sync.model.layers import FlatGroup, Layer
from dreamp2p.sync.strategies.base import Held, landed, settled
from dreamp2p.sync.strategies.outer import OuterWeights, anchor_verdict
from dreamp2p.sync.strategies.pacing import Shares, StepShares, unweigh

# A check round in flight: its (flag, digest bits) group, whose ``work`` receives the members' mean
Check = tuple[FlatGroup, concurrent.futures.Future[RoundResult]]


@dataclass
class InFlight:
    land_step: int
    key: tuple[int, int]  # (plan version, sync index)
    group: FlatGroup
    layers: tuple[int, ...]
    fut: concurrent.futures.Future[RoundResult]
    # anchors and checked pseudo-gradients: the round of (flag, 16 digest bits) beside the sync; None for
    # an unchecked pseudo-gradient sync
    check: FlatGroup | None = None
    check_fut: concurrent.futures.Future[RoundResult] | None = None
    anchor: bool = False  # whether it averages the parameters themselves (else pseudo-gradients)
    rated: bool = False  # whether its round's pace was taken into the link estimate yet (once per sync)
    shares: Shares | None = None  # periods in time: the shares' round its weighed pseudo-gradient lands by

    def rounds(self) -> list[concurrent.futures.Future[RoundResult]]:
        """The sync's round and those beside it (its check, its shares'), where it has them."""
        beside = (self.check_fut, self.shares.fut if self.shares is not None else None)
        return [self.fut, *(f for f in beside if f is not None)]

    def arrived(self) -> bool:
        """Whether every round of the sync completed (or failed): landing it now waits for nothing."""
        return all(f.done() for f in self.rounds())

    def mean(self) -> torch.Tensor | None:
        """The mean it lands with (its buffer, unweighed in place where shares weighed it); None where no
        member trained in the window (nothing to apply). Valid once it arrived and its rounds succeeded."""
        if self.shares is None:
            return self.group.work
        return self.group.work if unweigh(self.group.work, self.shares.mean()) else None

    def record(self, timeout: float) -> dict[str, Any] | None:
        """Wait for the sync, then its checkpoint record; None when it failed (everywhere: nobody applies it).
        RoundFailed when a round is still in flight after ``timeout`` (`dreamp2p.sync.strategies.base.settled`)."""
        if not all(settled(f, timeout) for f in self.rounds()):
            return None
        if self.shares is not None:  # saved as the mean it lands with, restored without shares
            if self.mean() is None:
                return None
            self.shares = None
        rec = {
            "land": self.land_step,
            "key": list(self.key),
            "layers": list(self.layers),
            "mean": self.group.work.clone(),
            "snap": self.group.snap.clone(),
            "anchor": self.anchor,
        }
        if self.check is not None:
            rec["check"] = self.check.work.clone()
        return rec

    @classmethod
    def restore(cls, rec: dict[str, Any], model_layers: Sequence[Layer], pin: bool) -> InFlight:
        """The landed sync a :meth:`record` describes, over the parameters of ``model_layers``."""
        layers = tuple(int(li) for li in rec["layers"])
        group = FlatGroup([p for li in layers for p in model_layers[li].params], pin=pin)
        group.snap.copy_(rec["snap"])
        group.work.copy_(rec["mean"])
        key = (int(rec["key"][0]), int(rec["key"][1]))
        # records from before checked pseudo-gradients: every checked sync was an anchor
        inf = cls(
            int(rec["land"]), key, group, layers, landed(group.numel), anchor=bool(rec.get("anchor", "check" in rec))
        )
        if "check" in rec:
            inf.check = FlatGroup([rec["check"].clone()])
            inf.check.work.copy_(rec["check"])
            inf.check_fut = landed(inf.check.numel)
        return inf


class ArmedSyncs:
    """The syncs of the step to come, each launched as soon as the last gradient of its layers is ready (a
    post-accumulate-grad hook per parameter), while backward goes on."""

    def __init__(self, layers: Sequence[Layer], launch: Callable[[int], None]) -> None:
        self._layers = layers
        self._launch = launch
        self._layer_of = {id(p): layer.index for layer in layers for p in layer.params}
        self._armed: dict[int, set[int]] = {}  # sync index -> its layers whose gradients are not ready yet
        self._pending: dict[int, int] = {}  # layer -> its parameters whose gradients are not ready yet

    def arm(self, plan: Plan, iteration: int) -> None:
        """Arm the syncs ``plan`` launches at ``iteration`` of its period (the previous ones are dropped)."""
        self._armed = {i: set(s.layers) for i, s in enumerate(plan.syncs) if s.iteration == iteration}
        self._pending = {li: len(self._layers[li].params) for layers in self._armed.values() for li in layers}

    def on_grad(self, p: torch.Tensor) -> None:
        """A parameter's gradient is ready: launch every armed sync it was the last one missing for."""
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

    def launch_rest(self) -> None:
        """Launch the armed syncs still waiting (layers that produced no gradient, or a step not trained at)."""
        for idx in sorted(self._armed):
            self._launch(idx)
        self._armed.clear()


class LayerSyncs:
    """Launches the layer syncs of the plans in force, each over buffers of its own while it travels."""

    def __init__(
        self,
        cfg: SyncConfig,
        comm: Collective,
        layers: Sequence[Layer],
        pin: bool,
        weights: OuterWeights,
        shares: StepShares | None = None,
    ) -> None:
        self._cfg = cfg
        self._shares = shares  # periods in time: pseudo-gradients weighed by this member's share
        self._comm = comm
        self._layers = layers
        self._pin = pin
        self._weights = weights

    def launch(
        self,
        plan: Plan,
        idx: int,
        step: int,
        round_id: int,
        anchor_codec: str | RingCodecPlan,
        delta_codec: str,
    ) -> InFlight:
        """Launch sync ``idx`` of ``plan`` at ``step``, in buffers of its own that live until it lands (host memory
        is held only for the syncs in flight, not for every sync of the plan). ``anchor_codec``: what an
        anchor's parameters travel in (the plan's codec, or the per-link codecs); ``delta_codec``: what a
        pseudo-gradient travels in (``delta_codec`` or, on a tight link, a fallback, which always carries error
        feedback)."""
        sync = plan.syncs[idx]
        key = (plan.version, idx)
        group = FlatGroup([p for li in sync.layers for p in self._layers[li].params], pin=self._pin)
        gid = plan_sync_group(plan.version, idx)
        if self._averages_params(sync.layers):
            group.snapshot()
            fut = self._comm.allreduce_group(
                group, anchor_group(gid), anchor_codec, plan_version=plan.version, round_id=round_id
            )
            check, check_fut = self.check(sync.layers, anchor_check_group(gid), round_id, plan.version)
            return InFlight(step + sync.delay, key, group, sync.layers, fut, check, check_fut, anchor=True)
        group.snapshot()
        # theta is read here, on the training thread that alone changes it; `work` is ours until launch
        self._weights.copy_theta(sync.layers, group.work)

        keep = self._cfg.keeps_unsent(delta_codec)
        weight, shares = self._shares.launch(round_id) if self._shares is not None else (1.0, None)

        def pseudo_gradient() -> None:  # on the comm thread, once the snapshot has landed
            group.work.sub_(group.snap)
            if keep:  # what the codec drops stays in the parameters unweighed: the share scales what is sent
                keep_unsent(group, delta_codec)
            if weight != 1.0:
                group.work.mul_(weight)

        fut = self._comm.allreduce_group(
            group,
            gid,
            delta_codec,
            plan_version=plan.version,
            round_id=round_id,
            prepare=pseudo_gradient,
            error_feedback=not keep and (self._cfg.error_feedback or delta_codec != self._cfg.delta_codec),
        )
        if not self._is_check(step):
            return InFlight(step + sync.delay, key, group, sync.layers, fut, shares=shares)
        check, check_fut = self.check(sync.layers, anchor_check_group(gid), round_id, plan.version)
        return InFlight(step + sync.delay, key, group, sync.layers, fut, check, check_fut, shares=shares)

    def merge(self, inf: InFlight) -> None:
        """Apply a landed sync: the outer step per layer, then params = theta + local progress (where the
        check, if any, let it through; else the layers keep their local values and sync next as anchors)."""
        verdict = anchor_verdict(inf.check.work) if inf.check is not None else "agree"
        mean = inf.mean()
        if mean is not None and self._weights.land(mean, inf.layers, anchor=inf.anchor, verdict=verdict):
            inf.group.merge()

    def check(self, layers: tuple[int, ...], group_id: int, round_id: int, plan_version: int = 0) -> Check:
        """The 17-element round of (flag, digest bits) that checks ``layers``' outer weights on every member."""
        check = FlatGroup([self._weights.check_vector(layers)])
        check.snapshot()
        fut = self._comm.allreduce_group(
            check, group_id, "fp32", plan_version=plan_version, round_id=round_id, guard_norm=False
        )
        return check, fut

    def _is_check(self, step: int) -> bool:
        """Whether a sync launched at ``step`` checks the outer weights (decided from the step: agreed by all)."""
        return (step // self._cfg.period) % self._cfg.anchor_every == 0

    def _averages_params(self, layers: tuple[int, ...]) -> bool:
        """Whether a sync of ``layers`` is an anchor, from agreed memory only: always without a delta codec;
        otherwise where a check asked for it."""
        return not self._cfg.delta_codec or self._weights.needs_anchor(layers)

    @staticmethod
    def held(travelling: Iterable[FlatGroup]) -> list[Held]:
        """The buffers of the syncs in flight (`Strategy.held`)."""
        groups = {id(g): g for g in travelling}.values()
        return [
            Held(
                "sync snapshots",
                "per sync in flight: the parameters at launch; the landing keeps the local progress made since",
                tuple(g.snap for g in groups),
            ),
            Held(
                "sync means",
                "per sync in flight: theta - parameters at launch, averaged in place, then the new theta",
                tuple(g.work for g in groups),
            ),
        ]


def keep_unsent(group: FlatGroup, codec: str) -> None:
    """Move what ``codec`` would not carry of the pseudo-gradient in ``group.work`` into its snapshot, so that the
    merge (params <- mean + params - snap) leaves it in this member's parameters (`SyncConfig.keep_unsent`).

    Estimated by encoding the whole group here, where the ring encodes it chunk by chunk: whatever the estimate
    misses is not lost either, since the next pseudo-gradient, taken from the shared theta, contains it.
    """
    c = get_codec(codec)
    sent = c.decode(c.encode(group.work), group.numel)
    group.snap.add_(group.work).sub_(sent)
