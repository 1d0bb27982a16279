"""Streaming DiLoCo (Douillard et al., arXiv 2501.18512): the model in P strided fragments, each synced once
per H steps at staggered offsets, its outer gradient travelling while training goes on.

Each fragment keeps a global copy and an outer Nesterov momentum as DiLoCo does for the whole model
(`dreamp2p.sync.strategies.baselines`); its 4-bit outer gradient lands tau steps after launch, and then
theta <- alpha * local + (1 - alpha) * outer. A round that fails is skipped by every member (see
`dreamp2p.sync.strategies.base`): that fragment's outer step is skipped everywhere and training goes on.
Paced by time, the offsets are steps of the cluster's clock and each fragment's outer gradient is the
token-weighted mean (`dreamp2p.sync.strategies.pacing`).
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Iterable
from typing import Any, NamedTuple

import torch

from dreamp2p.errors import RoundFailed
from dreamp2p.messages import RoundResult
from dreamp2p.schedule.fragments import fragment_offsets, fragments_due, strided_fragments
from dreamp2p.sync.model.groups import fragment_check_group, fragment_group, fragment_heal_group
from dreamp2p.sync.model.layers import FlatGroup
from dreamp2p.sync.model.shardlocal import split_like
from dreamp2p.sync.strategies.base import Held, Strategy, landed
from dreamp2p.sync.strategies.baselines import (
    GLOBAL_COPY_WHY,
    OUTER_MOMENTUM_WHY,
    PSEUDO_GRADIENT_WHY,
    global_parameter,
    kept_momenta,
    launch_pseudo_gradient,
    load_outer,
    momenta,
    outer_sgd,
    outer_step,
)
from dreamp2p.sync.strategies.outercheck import CheckRound, OuterCheck
from dreamp2p.sync.strategies.pacing import TokenShares, unweigh
from dreamp2p.sync.strategies.replicas import tensors_digest

# the shares' round beside a launch (time-paced periods) and the slot whose buffer holds its mean
_Shares = tuple[concurrent.futures.Future[RoundResult], int]


class _FragmentSync(NamedTuple):
    """A fragment's sync in flight."""

    land: int  # the step it lands at (paced by time: at the first step from there at which it has arrived)
    round_id: int  # the round id it was launched with: its heal round, where one follows, takes the same
    fut: concurrent.futures.Future[RoundResult]
    check: CheckRound | None  # the check of the fragment's outer state beside it
    shares: _Shares | None  # the shares' round beside it (time-paced periods)

    def arrived(self) -> bool:
        """Whether its rounds completed (or failed): landing it now waits for nothing."""
        return self.fut.done() and (self.shares is None or self.shares[0].done())


def failed_round(key: int) -> concurrent.futures.Future[RoundResult]:
    """A round that failed everywhere (restored from saved state: nobody applies it)."""
    fut: concurrent.futures.Future[RoundResult] = concurrent.futures.Future()
    fut.set_exception(RoundFailed(None, f"fragment {key}: failed on every member before this state was saved"))
    return fut


def _each(groups: Iterable[FlatGroup]) -> tuple[torch.Tensor, ...]:
    """Every group's host buffers, in order."""
    return _flat(g.buffers for g in groups)


def _flat(parts: Iterable[tuple[torch.Tensor, ...]]) -> tuple[torch.Tensor, ...]:
    return tuple(t for part in parts for t in part)


class StreamingDiLoCo(Strategy):
    name = "streaming"
    buffers_inline = False
    resume_fixed = (*Strategy.resume_fixed, "sync.fragments")  # the saved outer state is per fragment

    def _setup(self) -> None:
        nfrag = min(self.cfg.fragments, len(self.layers))
        self.fragments = strided_fragments(len(self.layers), nfrag)
        self.offsets = fragment_offsets(nfrag, self.cfg.period)
        # one buffer per fragment: its pseudo-gradient, averaged in place, then the mean until it lands
        self._groups = [
            FlatGroup([p for i in frag for p in self.layers[i].params], pin=self.pin, one_buffer=True)
            for frag in self.fragments
        ]
        self._global = []
        self._shadow = []
        self._outer = []
        for g in self._groups:
            glob = torch.empty(g.numel)
            g.read(glob)
            shadow = global_parameter(glob)
            self._global.append(glob)
            self._shadow.append(shadow)
            self._outer.append(outer_sgd(shadow, self.cfg))
        self._inflight: dict[int, _FragmentSync] = {}
        self._tokens = TokenShares(self.comm, nfrag)
        self._check = OuterCheck(
            self.comm, self.cfg.period, self.cfg.anchor_every, fragment_check_group, fragment_heal_group, self._wait
        )

    def _step(self) -> None:
        self._inner_step()
        self._tick()

    def _tick(self) -> None:
        t = self.step_count
        for p, sync in sorted(self._inflight.items()):
            # earlier only for a joiner, which starts a few steps after its state's step. Paced by time, not
            # before it arrived: a slower member launches it later, and waiting would tie us to its pace
            # (where it lands changes only our own mix; the outer steps are the same on every member)
            if sync.land <= t and (self._clock is None or sync.arrived()):
                self._land(p, self._inflight.pop(p))
        # fragments become due only after a full period of local steps
        if t + 1 < self.cfg.period:
            return
        # paced by time: every fragment due now is weighed by the share of the period we trained (the same
        # window for each), with one shares' round per step
        share = self._clock.share() if self._clock is not None else None
        launched: _Shares | None = None
        for p in fragments_due(t + 1, self.offsets, self.cfg.period):
            if p in self._inflight:
                self._land(p, self._inflight.pop(p))  # its previous sync had not landed: finish it first
            if share is not None and launched is None:
                launched = (self._tokens.launch(p, share, self._round()), p)
            g, codec = self._groups[p], self.cfg.stream_codec
            fut = launch_pseudo_gradient(self.comm, g, self._global[p], fragment_group(p), codec, self._round(), share)
            check = self._check.launch(p, self.outer_state(p), self._round()) if self._check.due(t) else None
            sync = _FragmentSync(t + self.cfg.stream_delay, self._round(), fut, check, launched)
            if self.cfg.stream_delay == 0:
                self._land(p, sync)
            else:
                self._inflight[p] = sync

    def _land(self, p: int, sync: _FragmentSync, timeout: float | None = None) -> None:
        """Fragment ``p``'s sync lands: its outer step, then (where a check found the members' copies of the
        fragment apart) their mean on every member, then the mix into the parameters."""
        applied = self._wait(sync.fut, timeout) is not None  # a failed round failed everywhere: no outer step
        if applied and sync.shares is not None:
            done, slot = sync.shares
            applied = self._wait(done, timeout) is not None and unweigh(self._groups[p].work, self._tokens.mean(slot))
        self._check.judge(p, sync.check, timeout)
        if applied:
            outer_step(self._outer[p], self._shadow[p], self._groups[p].work)
        # in place: the outer optimizer's parameter (the same memory) holds the mean too
        self._check.heal(p, self.outer_state(p), sync.round_id, timeout)
        if applied:
            g = self._groups[p]
            local = torch.empty_like(self._global[p])
            g.read(local)
            a = self.cfg.mix_alpha
            g.write(local.mul_(a).add_(self._global[p], alpha=1 - a))

    @property
    def outer_heals(self) -> int:
        """Heal rounds that averaged the members' copies of a fragment after a check found them apart."""
        return self._check.healed

    def _held(self) -> list[Held]:
        return [
            Held("pseudo-gradients", PSEUDO_GRADIENT_WHY + ", then its mean until it lands", _each(self._groups)),
            Held("global copies", GLOBAL_COPY_WHY, tuple(self._global)),
            Held("outer momenta", OUTER_MOMENTUM_WHY, _flat(map(kept_momenta, self._outer, self._shadow))),
        ]

    def outer_state(self, p: int) -> list[torch.Tensor]:
        """Fragment ``p``'s global copy and outer momentum (zeros before its first outer step)."""
        return [self._global[p], *momenta(self._outer[p], self._shadow[p])]

    def outer_shards(self) -> dict[str, list[torch.Tensor]]:
        views: dict[str, dict[int, torch.Tensor]] = {"global": {}, "momentum": {}}
        for p, frag in enumerate(self.fragments):
            params = [q for i in frag for q in self.layers[i].params]
            for kind, flat in zip(views, self.outer_state(p), strict=False):
                views[kind].update(zip(map(id, params), split_like(flat, params), strict=True))
        return {kind: [by_param[id(q)] for q in self.params] for kind, by_param in views.items() if by_param}

    def outer_digest(self) -> str:
        """64 bits naming every fragment's global copy and outer momentum."""
        return f"{tensors_digest(t for p in range(len(self._groups)) for t in self.outer_state(p)):016x}"

    def _finish(self, timeout: float | None) -> None:
        for p in sorted(self._inflight):
            self._land(p, self._inflight.pop(p), timeout=timeout)

    def _drop(self) -> None:
        self._inflight.clear()

    def _extra_state(self) -> dict[str, Any]:
        # the global copy and outer momentum per fragment: a joiner or a resumed node must continue the
        # same outer trajectory; fragments in flight land later on every member that took part, so their
        # results (and their checks' verdicts) travel too and land at the same step here
        inflight = {}
        for p, sync in self._inflight.items():
            try:
                sync.fut.result(self.comm.round_timeout_s)
                avg: torch.Tensor | None = self._groups[p].work.clone()
                if sync.shares is not None:  # saved as the weighed mean it lands as
                    sync.shares[0].result(self.comm.round_timeout_s)
                    if avg is not None and not unweigh(avg, self._tokens.mean(sync.shares[1])):
                        avg = None
            except RoundFailed:
                avg = None  # failed everywhere (all-or-none): nobody applies it
            verdict = sync.check.record(self.comm.round_timeout_s) if sync.check is not None else None
            if avg is not None or verdict is not None:
                inflight[p] = (sync.land, avg, verdict)
        return {
            "global": [g.clone() for g in self._global],
            "outer": [o.state_dict() for o in self._outer],
            "inflight": inflight,
            "check": self._check.state(),
        }

    def _load_extra_state(self, state: dict[str, Any]) -> None:
        if "global" not in state:
            return
        if len(state["global"]) != len(self._global):
            raise ValueError(f"state has {len(state['global'])} fragments, this strategy {len(self._global)}")
        for glob, outer, saved, saved_outer in zip(
            self._global, self._outer, state["global"], state["outer"], strict=True
        ):
            glob.copy_(saved)  # the outer optimizer's parameter too (the same memory)
            load_outer(outer, saved_outer, self.cfg)
        self._check.load(state.get("check"))
        self._inflight.clear()
        for p, (land, avg, *rest) in state.get("inflight", {}).items():
            verdict = rest[0] if rest else None  # saved before checks: none
            if avg is None:
                fut = failed_round(int(p))
            else:
                self._groups[p].work.copy_(avg)
                fut = landed(self._groups[p].numel)
            check = CheckRound.restore(verdict) if verdict is not None else None
            # launched the delay before its landing (the same on every member: the same state and settings)
            launch_round = int(land) - self.cfg.stream_delay + 1
            self._inflight[int(p)] = _FragmentSync(int(land), launch_round, fut, check, None)
