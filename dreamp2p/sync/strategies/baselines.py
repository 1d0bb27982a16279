"""The baseline strategies, all on the same transport so benchmarks compare like with like.

A round that fails is skipped by every member (see `dreamp2p.sync.strategies.base`): S-SGD then skips that step's
update everywhere, the others skip that average or outer step and carry on locally.

- ``none``: local training only, the compute-only reference.
- ``ssgd``: data-parallel S-SGD, gradients averaged every step (blocking).
- ``localsgd``: local SGD, whole model averaged every H steps (blocking).
- ``diloco``: DiLoCo (Douillard et al., arXiv 2311.08455): H inner steps, then the mean pseudo-gradient
  (global - local) drives an outer Nesterov SGD step (lr 0.7, momentum 0.9 over an adaptive inner
  optimizer as in the paper; plain averaging, lr 1 and momentum 0, over SGD: see `config.sync`). Paced by
  time, H steps of the cluster's clock and a token-weighted mean (`dreamp2p.sync.strategies.pacing`).
- ``streaming``: Streaming DiLoCo (arXiv 2501.18512), in `dreamp2p.sync.strategies.streaming`, over the
  outer optimizer defined here.
- ``co2``: CO2 (Sun et al., arXiv 2401.16265): every tau steps an asynchronous all-reduce of the
  parameters is launched; the next boundary applies the outer step with that one-step-stale average,
  scaled down by a staleness-gap penalty, with outer momentum clipped element-wise (really applied).
"""

from __future__ import annotations

import concurrent.futures
from typing import Any

import torch
from torch import nn

from dreamp2p.config.sync import SyncConfig
from dreamp2p.errors import RoundFailed
from dreamp2p.messages import RoundResult
from dreamp2p.sync.comm.collective import Collective
from dreamp2p.sync.model.groups import GROUP_CO2_GAP, GROUP_GRADS, GROUP_OUTER_CHECK, GROUP_OUTER_HEAL, GROUP_PARAMS
from dreamp2p.sync.model.layers import FlatGroup
from dreamp2p.sync.model.shardlocal import local_view, shard_like, split_like
from dreamp2p.sync.strategies.base import Held, Strategy, landed
from dreamp2p.sync.strategies.outercheck import CheckRound, OuterCheck
from dreamp2p.sync.strategies.pacing import TokenShares, unweigh
from dreamp2p.sync.strategies.replicas import tensors_digest


def outer_sgd(shadow: nn.Parameter, cfg: SyncConfig) -> torch.optim.Optimizer:
    """The DiLoCo outer optimizer: SGD with Nesterov momentum over the global copy."""
    lr, momentum = cfg.outer
    return torch.optim.SGD([shadow], lr=lr, momentum=momentum, nesterov=momentum > 0)


def global_parameter(glob: torch.Tensor) -> nn.Parameter:
    """The outer optimizer's parameter over the global copy ``glob`` itself (the same memory, not a copy):
    its step moves the copy, and whatever writes the copy (a heal, a load) writes the parameter."""
    return nn.Parameter(glob)


def launch_pseudo_gradient(
    comm: Collective,
    group: FlatGroup,
    glob: torch.Tensor,
    group_id: int,
    codec: str,
    round_id: int,
    weight: float | None = None,
) -> concurrent.futures.Future[RoundResult]:
    """Average ``glob - params`` over the one-buffer ``group``: the parameters are snapshotted into it, and
    the difference is taken there in place once the snapshot has landed (no temporary of the model's size).
    ``weight``: scale it by this member's share first (time-paced periods, `dreamp2p.sync.strategies.pacing`)."""
    group.snapshot()
    work = group.work

    def pseudo_gradient() -> None:
        torch.sub(glob, work, out=work)
        if weight is not None and weight != 1.0:
            work.mul_(weight)

    return comm.allreduce_group(group, group_id, codec, round_id=round_id, prepare=pseudo_gradient)


def outer_step(outer: torch.optim.Optimizer, shadow: nn.Parameter, mean: torch.Tensor) -> None:
    """The outer optimizer's step with the mean pseudo-gradient ``mean`` as the gradient, lent for the step:
    neither copied nor kept afterwards (the caller reads ``mean`` no more, which a foreach SGD overwrites)."""
    shadow.grad = mean
    outer.step()
    shadow.grad = None


def momenta(outer: torch.optim.Optimizer, shadow: nn.Parameter) -> list[torch.Tensor]:
    """The outer optimizer's momentum buffer over ``shadow``, created as zeros if no step made it yet (a
    Nesterov SGD step treats a zero buffer as none); nothing without momentum."""
    if not outer.param_groups[0]["momentum"]:
        return []
    state = outer.state[shadow]
    if state.get("momentum_buffer") is None:
        state["momentum_buffer"] = torch.zeros_like(shadow, memory_format=torch.preserve_format).detach()
    return [state["momentum_buffer"]]


def kept_momenta(outer: torch.optim.Optimizer, shadow: nn.Parameter) -> tuple[torch.Tensor, ...]:
    """The outer optimizer's momentum buffer over ``shadow`` where one exists (not before its first step)."""
    buf = outer.state.get(shadow, {}).get("momentum_buffer")
    return () if buf is None else (buf,)


# why DiLoCo and Streaming DiLoCo keep each buffer (`Strategy.held`)
PSEUDO_GRADIENT_WHY = "global copy - parameters at the sync, averaged in place by the round: the outer step's gradient"
GLOBAL_COPY_WHY = (
    "the parameters every member agreed at the last outer step: the pseudo-gradient is measured from it and the "
    "outer step moves it (it is the outer optimizer's parameter itself)"
)
OUTER_MOMENTUM_WHY = "the outer Nesterov step's momentum (none with outer momentum 0)"


def _whole_model_check(s: Strategy) -> OuterCheck:
    """The outer-state check and heal of a strategy with one global copy of the whole model."""
    return OuterCheck(
        s.comm, s.cfg.period, s.cfg.anchor_every, lambda _: GROUP_OUTER_CHECK, lambda _: GROUP_OUTER_HEAL, s._wait
    )


def load_outer(outer: torch.optim.Optimizer, state: dict[str, Any], cfg: SyncConfig) -> None:
    """Load the outer optimizer's saved state (its momentum buffer), keeping ``cfg``'s outer lr and momentum:
    ``load_state_dict`` would put back the saved ones, and a resume adopts changed settings."""
    outer.load_state_dict(state)
    lr, momentum = cfg.outer
    for group in outer.param_groups:
        group.update(lr=lr, momentum=momentum, nesterov=momentum > 0)


class NoSync(Strategy):
    """No communication at all: the compute-only reference that utilization is measured against."""

    name = "none"
    syncs_buffers = False

    def _step(self) -> None:
        self._inner_step()


class SSGD(Strategy):
    name = "ssgd"
    buffers_every_step = True  # as DDP: replicas hold the same buffers after every step

    def _setup(self) -> None:
        # one buffer: the gradients are copied in and averaged there in place (nothing is merged)
        self._grads = FlatGroup(self.params, pin=self.pin, one_buffer=True)

    def _step(self) -> None:
        # this rank's shards of the gradients under FSDP2 (the group holds this rank's shards of the parameters)
        grads = [local_view(p.grad) if p.grad is not None else torch.zeros_like(local_view(p)) for p in self.params]
        self._grads.snapshot(grads)
        res = self._wait(self.comm.allreduce_group(self._grads, GROUP_GRADS, self.cfg.codec, round_id=self._round()))
        if res is None:
            return  # the round failed on every member: every member skips this update alike
        with torch.no_grad():
            offset = 0
            for p in self.params:
                shard = local_view(p)
                n = shard.numel()
                avg = self._grads.work[offset : offset + n].view(shard.shape)
                if p.grad is None:
                    p.grad = shard_like(p, avg.to(p.device, p.dtype, copy=True))
                else:
                    local_view(p.grad).copy_(avg)  # across device and dtype at once: no temporary on the device
                offset += n
        # the mean of every member's gradients, so never skipped on one member's AMP overflow: that member's
        # non-finite gradients were refused by the contribution guard and every member applies the same mean
        self.optimizer.step()

    def _held(self) -> list[Held]:
        why = "the step's gradients in one flat host buffer, averaged there in place, then copied into the gradients"
        return [Held("gradients", why, self._grads.buffers)]


class LocalSGD(Strategy):
    name = "localsgd"

    def _setup(self) -> None:
        self._group = FlatGroup(self.params, pin=self.pin)

    def _step(self) -> None:
        self._inner_step()
        if (self.step_count + 1) % self.cfg.period == 0:
            self._group.snapshot()
            fut = self.comm.allreduce_group(self._group, GROUP_PARAMS, self.cfg.codec, round_id=self._round())
            if self._wait(fut) is not None:
                self._group.merge()

    def _held(self) -> list[Held]:
        why = "the parameters at the round's launch: the merge keeps what changed since (nothing: the round blocks)"
        return [
            Held("snapshot", why, (self._group.snap,)),
            Held("mean", "the members' parameter mean, written by the round", (self._group.work,)),
        ]


class DiLoCo(Strategy):
    name = "diloco"

    def _setup(self) -> None:
        # one buffer: the pseudo-gradient, averaged in place (the result is built from the mean alone)
        self._group = FlatGroup(self.params, pin=self.pin, one_buffer=True)
        self._global = torch.empty(self._group.numel)
        self._group.read(self._global)
        self._shadow = global_parameter(self._global)
        self._outer = outer_sgd(self._shadow, self.cfg)
        self._check = _whole_model_check(self)
        self._tokens = TokenShares(self.comm, 1)

    def _step(self) -> None:
        self._inner_step()
        self._tick()

    def _tick(self) -> None:
        if (self.step_count + 1) % self.cfg.period:
            return
        # pseudo-gradient: how far this replica moved away from the global parameters (paced by time: weighed
        # by the share of the period we trained, with the shares' round beside it)
        share = self._clock.share() if self._clock is not None else None
        fut = launch_pseudo_gradient(
            self.comm, self._group, self._global, GROUP_PARAMS, self.cfg.codec, self._round(), share
        )
        tokens = self._tokens.launch(0, share, self._round()) if share is not None else None
        check = self._check.launch(0, self.outer_state(), self._round()) if self._check.due(self.step_count) else None
        res = self._wait(fut)  # None: no outer step anywhere; the next period's pseudo-gradient covers both
        if res is not None and tokens is not None:
            weighed = self._wait(tokens) is not None and unweigh(self._group.work, self._tokens.mean(0))
            res = res if weighed else None
        self._check.judge(0, check)
        if res is not None:
            outer_step(self._outer, self._shadow, self._group.work)
        # where a check found the members' global copies apart (a partition): their mean, on every member (in
        # place, so the outer optimizer's parameter, the same memory, holds it too)
        self._check.heal(0, self.outer_state(), self._round())
        if res is not None:
            self._group.write(self._global)

    @property
    def outer_heals(self) -> int:
        """Heal rounds that averaged the members' global copies after a check found them apart."""
        return self._check.healed

    def outer_state(self) -> list[torch.Tensor]:
        """The global copy and outer momentum (zeros before the first outer step), as every member must hold them."""
        return [self._global, *momenta(self._outer, self._shadow)]

    def outer_shards(self) -> dict[str, list[torch.Tensor]]:
        return dict(zip(("global", "momentum"), (split_like(t, self.params) for t in self.outer_state()), strict=False))

    def _held(self) -> list[Held]:
        return [
            Held("pseudo-gradient", PSEUDO_GRADIENT_WHY, self._group.buffers),
            Held("global copy", GLOBAL_COPY_WHY, (self._global,)),
            Held("outer momentum", OUTER_MOMENTUM_WHY, kept_momenta(self._outer, self._shadow)),
        ]

    def outer_digest(self) -> str:
        """64 bits naming the global copy and outer momentum: equal on members holding them bit-identical."""
        return f"{tensors_digest(self.outer_state()):016x}"

    def _extra_state(self) -> dict[str, Any]:
        return {"global": self._global.clone(), "outer": self._outer.state_dict(), "check": self._check.state()}

    def _load_extra_state(self, state: dict[str, Any]) -> None:
        if "global" in state:
            self._global.copy_(state["global"])  # the outer optimizer's parameter too (the same memory)
            load_outer(self._outer, state["outer"], self.cfg)
            self._check.load(state.get("check"))


class CO2(Strategy):
    """CO2 with a staleness-gap penalty every member computes alike.

    The gap (local progress while the average travelled, relative to the outer gradient) differs per
    replica; a penalty taken from each replica's own gap would steer each replica's outer momentum apart
    for good. So each member's gap travels in a one-element round beside the parameters, and a landing
    uses the mean gap of the previous landing: one period stale, identical everywhere.
    """

    name = "co2"
    buffers_inline = False

    def _setup(self) -> None:
        self._group = FlatGroup(self.params, pin=self.pin)
        self._outer_params = torch.empty(self._group.numel)
        self._group.read(self._outer_params)
        self._momentum = torch.zeros_like(self._outer_params)
        # the local parameters sent in the round in flight: the group's snapshot itself, not a copy (nothing
        # writes it before the next launch, which lands this round first)
        self._launched: torch.Tensor | None = None
        self._fut: concurrent.futures.Future[RoundResult] | None = None
        self._gap = FlatGroup([torch.zeros(1)])  # this member's last gap, averaged with the parameters
        # no gap before the first landing: 0 (FlatGroup buffers start uninitialized)
        self._gap.snap.zero_()
        self._gap.work.zero_()
        self._gap_fut: concurrent.futures.Future[RoundResult] | None = None
        self._mean_gap = 0.0
        self.last_penalty = 1.0
        self._check = _whole_model_check(self)
        self._check_round: CheckRound | None = None  # the check of the outer state beside the round in flight

    def _step(self) -> None:
        self._inner_step()
        if (self.step_count + 1) % self.cfg.period:
            return
        self._land()
        self._group.snapshot()
        self._launched = self._group.snap
        self._fut = self.comm.allreduce_group(self._group, GROUP_PARAMS, self.cfg.codec, round_id=self._round())
        self._gap_fut = self.comm.allreduce_group(
            self._gap, GROUP_CO2_GAP, "fp32", round_id=self._round(), guard_norm=False
        )
        if self._check.due(self.step_count):
            self._check_round = self._check.launch(0, self.outer_state(), self._round())

    def _land(self, timeout: float | None = None) -> None:
        """The round launched at the previous boundary lands: the outer step, then (where a check found the
        members' outer states apart) their mean on every member, then the parameters."""
        check, self._check_round = self._check_round, None
        self._check.judge(0, check, timeout)
        progress = self._outer_step(timeout)
        self._launched = None
        # where a check found the members' outer parameters apart (a partition): their mean, on every member
        self._check.heal(0, self.outer_state(), self._round(), timeout)
        if progress is not None:
            self._group.write(progress.add_(self._outer_params))  # outer + progress (addition commutes)

    def _outer_step(self, timeout: float | None) -> torch.Tensor | None:
        """The stale outer step with the landed average; the local progress made meanwhile, None where no
        round was in flight or it failed (everywhere: no outer step this time)."""
        if self._fut is None or self._launched is None:
            return None
        res = self._wait(self._fut, timeout)
        gap_res = self._wait(self._gap_fut, timeout) if self._gap_fut is not None else None
        self._fut = self._gap_fut = None
        if res is None or gap_res is None:
            return None
        avg = self._group.work
        # in place, one temporary of the model's size: the local work done while the average travelled, and
        # the outer gradient in the mean's own buffer (nothing reads the mean after this)
        progress = torch.empty_like(avg)
        self._group.read(progress)
        progress.sub_(self._launched)
        outer_grad = torch.sub(self._outer_params, avg, out=avg)
        # staleness gap: the more the replicas moved meanwhile, the smaller the stale outer step; the mean
        # gap of the previous landing, so that every member takes the same step
        penalty = 1.0 + self.cfg.co2_gap_penalty * float(self._gap.work[0])
        self._gap.snap.fill_(float(progress.norm()) / (float(outer_grad.norm()) + 1e-12))
        self.last_penalty = penalty
        self._momentum.mul_(self.cfg.co2_momentum).add_(outer_grad, alpha=1.0 / penalty)
        if self.cfg.co2_clip > 0:
            self._momentum.clamp_(-self.cfg.co2_clip, self.cfg.co2_clip)
        self._outer_params.sub_(self._momentum, alpha=self.cfg.co2_lr)
        return progress

    def outer_state(self) -> list[torch.Tensor]:
        """The outer parameters and their momentum, as every member must hold them. (The mean gap is not:
        the gap round that lands with the next average replaces it before it is read.)"""
        return [self._outer_params, self._momentum]

    def outer_shards(self) -> dict[str, list[torch.Tensor]]:
        return {
            "outer": split_like(self._outer_params, self.params),
            "momentum": split_like(self._momentum, self.params),
        }

    def _held(self) -> list[Held]:
        sent = (
            "the parameters sent in the round in flight: the local progress made while it travels is measured from them"
        )
        return [
            Held("snapshot", sent, (self._group.snap,)),
            Held(
                "mean",
                "the members' parameter mean, landed at the next boundary (one period stale)",
                (self._group.work,),
            ),
            Held("outer parameters", "the outer copy the stale outer step moves", (self._outer_params,)),
            Held("outer momentum", "the outer step's momentum (clipped element-wise)", (self._momentum,)),
        ]

    def outer_digest(self) -> str:
        """64 bits naming the outer parameters and momentum."""
        return f"{tensors_digest(self.outer_state()):016x}"

    @property
    def outer_heals(self) -> int:
        """Heal rounds that averaged the members' outer parameters after a check found them apart."""
        return self._check.healed

    def _finish(self, timeout: float | None) -> None:
        self._land(timeout)

    def _drop(self) -> None:
        self._fut = self._gap_fut = None
        self._launched = None
        self._check_round = None

    def _extra_state(self) -> dict[str, Any]:
        state: dict[str, Any] = {
            "outer": self._outer_params.clone(),
            "momentum": self._momentum.clone(),
            "gap": self._gap.snap.clone(),
            "mean_gap": self._gap.work.clone(),
            "check": self._check.state(),
        }
        # a check in flight is judged at the next boundary on every member that took part: carry its mean
        verdict = self._check_round.record(self.comm.round_timeout_s) if self._check_round is not None else None
        if verdict is not None:
            state["pending_check"] = verdict
        # a round in flight lands at the next boundary on every member that took part: carry its result, so
        # a joiner (which was not part of it) or a resumed node takes the same outer step there
        if self._fut is not None and self._gap_fut is not None and self._launched is not None:
            try:
                self._fut.result(self.comm.round_timeout_s)
                self._gap_fut.result(self.comm.round_timeout_s)
            except RoundFailed:
                return state  # failed everywhere (all-or-none): no member will apply it
            state["pending"] = {
                "avg": self._group.work.clone(),
                "launched": self._launched.clone(),
                "mean_gap_next": self._gap.work.clone(),
            }
        return state

    def _load_extra_state(self, state: dict[str, Any]) -> None:
        if "outer" not in state:
            return
        self._outer_params.copy_(state["outer"])
        self._momentum.copy_(state["momentum"])
        self._gap.snap.copy_(state.get("gap", torch.zeros(1)))
        self._gap.work.copy_(state.get("mean_gap", torch.zeros(1)))
        self._fut = self._gap_fut = None
        self._launched = None
        self._check.load(state.get("check"))
        verdict = state.get("pending_check")
        self._check_round = CheckRound.restore(verdict) if verdict is not None else None
        pending = state.get("pending")
        if pending is not None:
            self._group.work.copy_(pending["avg"])
            self._gap.work.copy_(pending["mean_gap_next"])
            self._launched = self._group.snap.copy_(pending["launched"])
            self._fut = landed(self._group.numel)
            self._gap_fut = landed(1)
