"""Streaming DiLoCo (Douillard et al., arXiv 2501.18512): the model in P strided fragments, each synced once
per H steps at staggered offsets, its outer gradient travelling while training goes on.

Each fragment keeps a global copy and an outer Nesterov momentum as DiLoCo does for the whole model
(`dreamp2p.sync.strategies.baselines`); its 4-bit outer gradient lands tau steps after launch, and then
theta <- alpha * local + (1 - alpha) * outer. A round that fails is skipped by every member (see
`dreamp2p.sync.strategies.base`): that fragment's outer step is skipped everywhere and training goes on.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Iterable
from typing import Any

import torch

from dreamp2p.errors import RoundFailed
from dreamp2p.messages import RoundResult
from dreamp2p.schedule.fragments import fragment_offsets, fragments_due, strided_fragments
from dreamp2p.sync.model.groups import fragment_check_group, fragment_group, fragment_heal_group
from dreamp2p.sync.model.layers import FlatGroup
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
from dreamp2p.sync.strategies.replicas import tensors_digest

# a Streaming DiLoCo fragment sync in flight: (landing step, its round, the check beside it or None)
_FragmentSync = tuple[int, concurrent.futures.Future[RoundResult], CheckRound | None]


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
        # per fragment in flight: (landing step, its round, the check of its outer state beside it or None)
        self._inflight: dict[int, _FragmentSync] = {}
        self._check = OuterCheck(
            self.comm, self.cfg.period, self.cfg.anchor_every, fragment_check_group, fragment_heal_group, self._wait
        )

    def _step(self) -> None:
        self._inner_step()
        t = self.step_count
        for p, (land, fut, check) in sorted(self._inflight.items()):
            if land <= t:  # earlier only for a joiner, which starts a few steps after its state's step
                del self._inflight[p]
                self._land(p, fut, check)
        # fragments become due only after a full period of local steps
        if t + 1 >= self.cfg.period:
            for p in fragments_due(t + 1, self.offsets, self.cfg.period):
                if p in self._inflight:
                    self._land(p, *self._inflight.pop(p)[1:])  # its previous sync had not landed: finish it first
                g, codec = self._groups[p], self.cfg.stream_codec
                fut = launch_pseudo_gradient(self.comm, g, self._global[p], fragment_group(p), codec, self._round())
                check = self._check.launch(p, self.outer_state(p), self._round()) if self._check.due(t) else None
                if self.cfg.stream_delay == 0:
                    self._land(p, fut, check)
                else:
                    self._inflight[p] = (t + self.cfg.stream_delay, fut, check)

    def _land(
        self,
        p: int,
        fut: concurrent.futures.Future[RoundResult],
        check: CheckRound | None,
        timeout: float | None = None,
    ) -> None:
        """Fragment ``p``'s sync lands: its outer step, then (where a check found the members' copies of the
        fragment apart) their mean on every member, then the mix into the parameters."""
        applied = self._wait(fut, timeout) is not None  # a failed round failed everywhere: no outer step
        self._check.judge(p, check, timeout)
        if applied:
            outer_step(self._outer[p], self._shadow[p], self._groups[p].work)
        # in place: the outer optimizer's parameter (the same memory) holds the mean too
        self._check.heal(p, self.outer_state(p), self._round(), timeout)
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

    def outer_digest(self) -> str:
        """64 bits naming every fragment's global copy and outer momentum."""
        return f"{tensors_digest(t for p in range(len(self._groups)) for t in self.outer_state(p)):016x}"

    def _finish(self, timeout: float | None) -> None:
        for p in sorted(self._inflight):
            self._land(p, *self._inflight.pop(p)[1:], timeout=timeout)

    def _drop(self) -> None:
        self._inflight.clear()

    def _extra_state(self) -> dict[str, Any]:
        # the global copy and outer momentum per fragment: a joiner or a resumed node must continue the
        # same outer trajectory; fragments in flight land later on every member that took part, so their
        # results (and their checks' verdicts) travel too and land at the same step here
        inflight = {}
        for p, (land, fut, check) in self._inflight.items():
            try:
                fut.result(self.comm.round_timeout_s)
                avg: torch.Tensor | None = self._groups[p].work.clone()
            except RoundFailed:
                avg = None  # failed everywhere (all-or-none): nobody applies it
            verdict = check.record(self.comm.round_timeout_s) if check is not None else None
            if avg is not None or verdict is not None:
                inflight[p] = (land, avg, verdict)
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
            self._inflight[int(p)] = (int(land), fut, CheckRound.restore(verdict) if verdict is not None else None)
