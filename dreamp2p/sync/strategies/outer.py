"""DreamDDP's per-layer outer weights: theta and momentum, the outer Nesterov step, and the anchors' check.

Pseudo-gradients between anchors (DiLoCo, Douillard et al., arXiv 2311.08105; Streaming DiLoCo, arXiv
2501.18512): each layer keeps outer weights theta and a momentum, changed only by landed syncs. A landing
takes a Nesterov step per layer, theta -= lr * (g + mu * m), with g the mean pseudo-gradient (lr 1,
momentum 0 is plain averaging).

Checks and anchors: a 17-element round beside a layer sync carries a reset flag and 16 bits of a digest
of each member's theta and momentum (`anchor_verdict` reads the mean). An anchor sync averages the
parameters themselves: where the check agrees, g = theta - mean(params) feeds the same outer step; where
any differs, every member resets theta to the parameter mean and the momentum to zero, identically (see
`dreamp2p.sync.strategies.dreamddp` for when each runs).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch
import xxhash

from dreamp2p.sync.model.layers import Layer
from dreamp2p.sync.model.shardlocal import local_view, split_like
from dreamp2p.sync.strategies.base import Held
from dreamp2p.sync.strategies.replicas import bits_agree, digest_bits

log = logging.getLogger(__name__)

DIGEST_BITS = 16


def anchor_check_vector(want_reset: bool, digest: int) -> torch.Tensor:
    """One member's contribution to an anchor's check round: a reset flag and its digest's low bits."""
    flag = torch.tensor([1.0 if want_reset else 0.0], dtype=torch.float32)
    return torch.cat([flag, digest_bits(digest)[:DIGEST_BITS]])


def anchor_verdict(mean: torch.Tensor) -> str:
    """From the averaged check vector, the same on every member: "agree", "fresh" (a member asked for a
    reset: its theta is local only) or "differ" (the members' thetas differ: a partition or a lost round).

    Each digest bit averages to exactly 0 or 1 only where every member holds the same bit.
    """
    if bool(mean[0] > 0):
        return "fresh"
    return "agree" if bits_agree(mean[1:]) else "differ"


class OuterWeights:
    """Theta and momentum of each layer: from the parameters at attach (`start`), or from the local
    parameters at the layer's first use after a resume that had none (then fresh)."""

    def __init__(self, layers: Sequence[Layer], lr: float, momentum: float) -> None:
        self._layers = layers
        self._lr = lr
        self._mu = momentum
        self._outer: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._fresh: set[int] = set()  # layers whose theta is local only: the next anchor resets them
        # layers a check found apart: their next sync is an anchor (agreed memory: every member reads the
        # same check, and the set is checkpointed)
        self._repair: set[int] = set()
        self.anchors_healed = 0  # anchors that found the members' thetas different

    def start(self) -> None:
        """Theta of every layer from the current parameters, as agreed memory (not fresh).

        Called once at attach, right after rank 0's parameters were broadcast, so every member starts from
        the same theta and the first period's syncs can send pseudo-gradients. Where a member did not take
        the broadcast (different initial parameters), the first period's checks see the digests differ and
        the layers' next syncs are anchors, as after any drift.
        """
        for li in range(len(self._layers)):
            if li not in self._outer:
                self.theta(li)
                self._fresh.discard(li)

    def theta(self, li: int) -> torch.Tensor:
        """Layer ``li``'s outer weights, created from the local parameters on first use (then fresh)."""
        state = self._outer.get(li)
        if state is None:
            shards = [local_view(p).detach() for p in self._layers[li].params]  # this rank's, under FSDP2
            theta = torch.cat([t.reshape(-1).to("cpu", torch.float32) for t in shards])
            state = (theta, torch.zeros_like(theta))
            self._outer[li] = state
            self._fresh.add(li)
        return state[0]

    def per_param(self) -> dict[str, list[torch.Tensor]]:
        """Theta and momentum as one view per parameter, every layer's in layer order (`Strategy.outer_shards`)."""
        views: dict[str, list[torch.Tensor]] = {"theta": [], "momentum": []}
        for li, layer in enumerate(self._layers):
            self.theta(li)  # a layer without outer weights yet gets them as on its first use
            theta, momentum = self._outer[li]
            views["theta"] += split_like(theta, layer.params)
            views["momentum"] += split_like(momentum, layer.params)
        return views

    def held(self) -> list[Held]:
        """Theta and momentum of every layer that has them (`Strategy.held`)."""
        layers = sorted(self._outer)
        return [
            Held(
                "outer weights",
                "theta per layer, changed only by landed syncs: what the pseudo-gradients are measured from",
                tuple(self._outer[li][0] for li in layers),
            ),
            Held(
                "outer momentum",
                "per layer, the outer Nesterov step's momentum (zeros with momentum 0)",
                tuple(self._outer[li][1] for li in layers),
            ),
        ]

    def copy_theta(self, layers: Sequence[int], out: torch.Tensor) -> None:
        """Write the outer weights of ``layers``, concatenated in that order, into the flat ``out``."""
        offset = 0
        for li in layers:
            theta = self.theta(li)
            n = theta.numel()
            out[offset : offset + n].copy_(theta)
            offset += n

    def set_theta(self, layers: Sequence[int], flat: torch.Tensor) -> None:
        """Theta of ``layers`` <- the flat ``flat`` (concatenated in that order); momenta stay as they are."""
        offset = 0
        for li in layers:
            theta = self.theta(li)
            n = theta.numel()
            theta.copy_(flat[offset : offset + n])
            offset += n

    def check_vector(self, layers: Sequence[int]) -> torch.Tensor:
        """This member's anchor check for ``layers``: reset flag and digest of their theta and momentum."""
        for li in layers:
            self.theta(li)
        digest = xxhash.xxh3_64()
        for li in layers:
            theta, mom = self._outer[li]
            # the arrays' own memory (buffer protocol), not a copy of it
            digest.update(theta.numpy().data)
            digest.update(mom.numpy().data)
        return anchor_check_vector(bool(self._fresh & set(layers)), digest.intdigest())

    def needs_anchor(self, layers: Sequence[int]) -> bool:
        """Whether a check found any of ``layers`` apart since their last anchor."""
        return not self._repair.isdisjoint(layers)

    @property
    def repair_layers(self) -> tuple[int, ...]:
        """Layers whose next sync is an anchor because a check found the members' outer weights different."""
        return tuple(sorted(self._repair))

    def land(self, mean: torch.Tensor, layers: tuple[int, ...], anchor: bool, verdict: str) -> bool:
        """Apply a landed sync's ``mean`` to theta, then write the new theta into ``mean`` in place; whether
        it was applied.

        A pseudo-gradient whose check found the members apart is applied nowhere (the layers keep their
        local values, as after a failed round) and makes the layers' next sync an anchor.
        """
        if not anchor and verdict != "agree":
            log.warning(
                "layers %s: outer weights differ between members (%s); their next sync is an anchor", layers, verdict
            )
            self._repair.update(layers)
            return False
        reset = verdict != "agree"
        if verdict == "differ":
            self.anchors_healed += 1
            log.warning("layers %s: outer weights differed between members; reset to the parameter mean", layers)
        self._outer_step(mean, layers, anchor=anchor, reset=reset)
        if anchor:
            self._repair.difference_update(layers)
        return True

    def _outer_step(self, mean: torch.Tensor, layers: tuple[int, ...], anchor: bool, reset: bool) -> None:
        """Turn ``mean`` (of parameters at an anchor, of pseudo-gradients otherwise) into the new theta, in place."""
        lr, mu = self._lr, self._mu
        offset = 0
        for li in layers:
            n = self._layers[li].numel
            a = mean[offset : offset + n]
            self.theta(li)  # a sync restored with a checkpoint that had no outer weights: fresh from here
            theta, mom = self._outer[li]
            offset += n
            if reset:
                theta.copy_(a)  # the parameter mean, identical on every member
                mom.zero_()
                self._fresh.discard(li)
                continue
            # a pseudo-gradient's mean serves as the step's scratch: it is overwritten with theta below
            g = theta - a if anchor else a
            if lr == 1.0 and mu == 0.0 and anchor:
                theta.copy_(a)  # plain averaging: exactly the mean
            else:
                mom.mul_(mu).add_(g)
                theta.sub_(g.add_(mom, alpha=mu), alpha=lr)
            a.copy_(theta)

    def state(self) -> dict[str, Any]:
        """Checkpoint entries (``outer``, ``fresh``, ``repair``), copies."""
        return {
            "outer": {li: (theta.clone(), mom.clone()) for li, (theta, mom) in self._outer.items()},
            "fresh": sorted(self._fresh),
            "repair": sorted(self._repair),
        }

    def load(self, state: dict[str, Any]) -> None:
        self._outer = {int(li): (theta.clone(), mom.clone()) for li, (theta, mom) in state.get("outer", {}).items()}
        self._fresh = {int(li) for li in state.get("fresh", [])}
        self._repair = {int(li) for li in state.get("repair", [])}
