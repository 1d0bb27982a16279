"""Knobs of the synchronization strategies (``[sync]``), one frozen dataclass with validation.

The codec fields are checked against `dreamp2p.config.codecs` (this package is a leaf: it may not import
the codec registry in `dreamp2p.compression`, which a unit test holds those names equal to).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, fields, replace
from typing import Any

from dreamp2p.config.codecs import (
    CODEC_NAMES,
    canonical_codec,
    check_link_codecs,
    is_sparse,
    needs_feedback,
    unknown_codec_message,
    wire_rank,
)
from dreamp2p.config.parse import one_of_message

STRATEGIES = ("none", "ssgd", "localsgd", "diloco", "streaming", "co2", "dreamddp")
# How model buffers (BatchNorm running statistics, any registered buffer) are kept equal across members
# whenever a strategy syncs parameters: their mean, or rank 0's values (DDP's ``broadcast_buffers``).
BUFFER_MODES = ("average", "broadcast")
# Outer optimizer defaults by inner optimizer: DiLoCo's Nesterov outer step (lr 0.7, momentum 0.9) is
# tuned for an adaptive inner optimizer (AdamW); over SGD with momentum it compounds two momenta and
# overshoots, so plain averaging of the pseudo-gradient (lr 1, momentum 0) is the default there.
ADAPTIVE_OUTER = (0.7, 0.9)
PLAIN_OUTER = (1.0, 0.0)
# DreamDDP's per-layer outer step over an adaptive inner optimizer: lr 1 with Nesterov momentum 0.5 (a 2x
# step at steady state). Measured (docs/BENCHMARKS.md): on bench lm (AdamW 3e-4, H 20, 200 steps) held-out
# 2.4169 against 2.4381 with 0.7/0.9 and 2.4662 with plain averaging; on the demo (AdamW 3e-3, H 10,
# 1 minute) eval 1.56-1.59 against 2.04-2.08 with 0.7/0.9 and 1.58-1.65 plain. DiLoCo's 0.7/0.9 (a 7x
# step) suits its 500-step periods, not syncs every few steps. Over SGD, plain averaging (PLAIN_OUTER):
# on bench digits (SGD momentum 0.9) 0.9806 against 0.9778 with 1/0.5.
GROUP_OUTER_ADAPTIVE = (1.0, 0.5)
# What a period counts (``sync.periods``): "steps", in lockstep, every member after the same count of
# local steps (the slowest sets everyone's pace); "time", a period is the span the fastest member takes for
# ``period`` steps: every member follows the cluster's step clock (`dreamp2p.sync.strategies.pacing`), takes
# as many local steps as it manages meanwhile, and the merge weights each pseudo-gradient by those steps
PERIOD_KINDS = ("steps", "time")
TIMED_STRATEGIES = ("diloco", "streaming", "dreamddp")  # the strategies "time" applies to
REMOVED_KEYS = {
    "round_timeout_s": "sync rounds are governed by [node.transport] round_timeout_s; set it there",
}


@dataclass(frozen=True)
class SyncConfig:
    strategy: str = "dreamddp"
    period: int = 10  # H: every layer (or the whole model) is averaged once per H steps
    codec: str = "fp32"  # wire codec for parameter averaging (the [node] codec is the handshake default)
    buffers: str = "average"  # see BUFFER_MODES
    # DiLoCo / Streaming DiLoCo outer optimizer (Nesterov SGD); None: chosen by the inner optimizer at
    # attach (ADAPTIVE_OUTER for Adam-like inner optimizers, PLAIN_OUTER otherwise), see with_outer_defaults
    outer_lr: float | None = None
    outer_momentum: float | None = None
    # Streaming DiLoCo
    fragments: int = 2  # P strided fragments
    stream_delay: int = 1  # tau: steps the fragment's outer gradient travels while training goes on
    mix_alpha: float = 0.5  # theta <- alpha * local + (1 - alpha) * outer
    stream_codec: str = "e3m0"  # 4-bit outer gradients, as in the paper
    # CO2
    co2_momentum: float = 0.5
    co2_lr: float = 1.0
    co2_clip: float = 1.0  # element-wise clip of the outer momentum (0 disables)
    co2_gap_penalty: float = 0.1  # lambda of the staleness-gap penalty
    # DreamDDP
    warmup_steps: int = 5  # profiled steps before the first measured plan (the warm-up plan runs meanwhile)
    # d: a group's sync may land up to d steps after launch (WAN extension); < period. None (default): up to
    # period - 1, so a sync that takes seconds on a WAN can span the period; the planner still picks
    # delay 0 for every group whose sync hides inside one backward pass (ties go to smaller delays)
    max_delay: int | None = None
    # where the link cannot carry a plan's syncs within the period (their bytes would keep it busy over 0.8 of
    # the period's compute), a measured plan may lengthen its period to 2, 4, ... up to max_stretch times
    # ``period`` (dreamp2p.schedule.stretch): the same syncs, fewer of them, as DiLoCo's longer outer period.
    # 1 (default for now): the period is always ``period``. 8 made dreamddp the fastest strategy at 2 Mbit/s,
    # but a stretch trades model quality for speed, which the planner does not price yet, and a bandwidth
    # burst sent beside a sync reads the link low (at 5 Mbit/s a 0.4x read stretched a plan that hid every
    # sync, for a 0.9% worse model; docs/BENCHMARKS.md), so it stays opt-in until both are mended
    max_stretch: int = 1
    control_every: int = 10  # steps between control rounds (gather link stats and profiles)
    control_lead: int = 2  # steps a control round may travel before its result is used
    # while the link holds steady, control rounds space out: every control_every steps after a change or a
    # re-plan, twice that after one quiet round, ... up to control_backoff x control_every (1: never space
    # out): each round costs about 7 ms of comm CPU on the trainer's cores (bench lm, 2-core host), which
    # a steady link does not repay. A round that sees a change brings the next one back to control_every
    control_backoff: int = 4
    # relative change of the slowest link that counts as a change: a link shaped by a token bucket reads
    # up to ~2x its rate for a while (bursts absorbed by the bucket and socket buffers), and each re-plan
    # costs a sync's worth of disturbance, so only a large change that lasts re-plans
    replan_threshold: float = 0.5
    replan_sustain: int = 3  # consecutive control rounds that must see the change
    bubble_fill: bool = False  # extra syncs in idle link time; costs CPU, so off unless cores are spare
    plan_margin: float = 0.3  # plan as if syncs took this much longer than measured, so noise stays hidden
    # trainer seconds one layer-sync round costs besides its link time (launch, landing, the comm path's CPU
    # and GIL on the trainer's cores); the planner adds it per round and counts plans within one round's
    # cost as alike. 0.08: measured on bench lm on a 2-core host, where a round in every step cost 0.1 s
    # per step and 2 rounds per period ~0.06 s per round (docs/PLANNING.md, "Round cost"); 0 prices rounds
    # by the link alone (the planner then staggers a group into every iteration wherever they hide)
    round_cost_s: float = 0.08
    # outer optimizer per layer group (Nesterov, as DiLoCo's); lr 1 + momentum 0 is plain averaging. None:
    # resolved at attach to plain averaging (see with_outer_defaults)
    group_outer_lr: float | None = None
    group_outer_momentum: float | None = None
    # DreamDDP pseudo-gradients: layer syncs average theta - params (how far each replica moved since the
    # layer's outer weights theta) with ``delta_codec``; every ``anchor_every``-th period a 17-element round
    # beside them checks that every member holds the same theta, and where one does not (a partition or a
    # lost round), the layer's next sync is an anchor: it averages the parameters themselves with the plan's
    # codec and resets theta to their mean. Theta starts at attach from rank 0's broadcast parameters, so
    # the first period sends (checked) pseudo-gradients too, and plans are priced at delta_codec's size.
    # Empty delta_codec: every sync averages parameters.
    delta_codec: str = "int4"
    # where the link cannot carry a period's pseudo-gradients in delta_codec (the plan's syncs would keep it
    # busy more than dreamp2p.schedule.stretch's budget, or land most of a period late), the plan's syncs use
    # the first of these that it carries fresh (else the first it carries, else the last). What they leave
    # out stays in the parameters (keep_unsent) or in error feedback: 2-bit rounding errs by about half a
    # pseudo-gradient's norm each round, topk sends 2% of it. A sparse one needs one of the two.
    # Tried before stretching the period. Least to most compressive; those sending no fewer bytes than
    # delta_codec are skipped (`delta_chain`). Empty: delta_codec whatever the link.
    delta_fallbacks: tuple[str, ...] = ("int2", "topk")
    anchor_every: int = 4
    # error feedback on those pseudo-gradient syncs: what delta_codec lost in one round is added to the
    # same group's next round, at every lossy encode of the ring (dreamp2p.collective.feedback)
    error_feedback: bool = False
    # what a 2-bit or sparse pseudo-gradient codec (int2, topk: a tight link's) did not carry stays in the
    # member's own parameters (so in its next pseudo-gradient, which is measured from the shared theta),
    # rather than a merge resetting them to theta plus the codec's share: a replica keeps its whole local
    # progress, and no residual is needed. Until a denser sync or flush() the replicas differ by their unsent
    # parts, so a quiet stretch (learning rate 0) no longer makes them bit-identical; a daemon flushes at the
    # end of its run ([train] flush_at_end). error_feedback = true turns it off (the unsent part would count
    # twice)
    keep_unsent: bool = True
    # DreamDDP's flush(): the codec of its one round of pseudo-gradients (a dense one; a check confirms the
    # replicas end identical either way). Empty: chosen from the plan in force, see flush_delta_codec
    flush_codec: str = ""
    # Bandwidth-aware compression per ring link (DreamDDP's layer syncs): candidates from least to most
    # lossy, ``codec`` among them; each link sends with the least lossy one that keeps its transfer within
    # (1 + link_codec_tolerance) of the fastest link's, from the bandwidths of the control round. Empty:
    # every link uses ``codec``. Every node must use the same list (it fixes the segment layout).
    link_codecs: tuple[str, ...] = ()
    link_codec_tolerance: float = 0.25
    # DreamDDP codec per plan (see dreamp2p.schedule.plancodec): candidates from least to most lossy; each
    # plan uses the least lossy one that hides with the link busy at most codec_link_budget of the period.
    # Empty: every layer sync uses ``codec``. Ignored when link_codecs is set (per-link codecs instead).
    # These codecs carry the anchors' parameters (4 bits of a weight, not of an update, are too coarse);
    # the pseudo-gradients use delta_codec. int8 alone by default: on a 20 Mbit/s link
    # bf16 or fp32 anchors would hide but cost 1.3-2.5x Streaming DiLoCo's bytes (bench lm); add them,
    # least lossy first, where bytes are cheap.
    plan_codecs: tuple[str, ...] = ("int8",)
    codec_link_budget: float = 0.25
    periods: str = "steps"  # see PERIOD_KINDS

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ValueError(one_of_message("sync.strategy", self.strategy, STRATEGIES))
        self._check_periods()
        for name in ("codec", "stream_codec"):  # case-insensitive, as the codec registry reads them
            try:
                canonical_codec(getattr(self, name))
            except ValueError as exc:
                raise ValueError(f"sync.{name}: {exc}") from None
        for name in ("bubble_fill", "error_feedback", "keep_unsent"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"sync.{name} must be true or false, got {getattr(self, name)!r}")
        for name in (
            "period",
            "fragments",
            "control_every",
            "control_lead",
            "control_backoff",
            "replan_sustain",
            "anchor_every",
            "max_stretch",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"sync.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("stream_delay", "warmup_steps"):
            if getattr(self, name) < 0:
                raise ValueError(f"sync.{name} must be >= 0, got {getattr(self, name)}")
        if self.max_delay is not None and self.max_delay < 0:
            raise ValueError(f"sync.max_delay must be >= 0, got {self.max_delay}")
        if self.max_delay is not None and self.max_delay >= self.period:
            raise ValueError(f"sync.max_delay ({self.max_delay}) must be < sync.period ({self.period})")
        if self.stream_delay >= self.period:
            raise ValueError(f"sync.stream_delay ({self.stream_delay}) must be < sync.period ({self.period})")
        if self.control_lead >= self.control_every:
            raise ValueError("sync.control_lead must be < sync.control_every")
        if not 0.0 <= self.mix_alpha <= 1.0:
            raise ValueError(f"sync.mix_alpha must be in [0, 1], got {self.mix_alpha}")
        if self.buffers not in BUFFER_MODES:
            raise ValueError(one_of_message("sync.buffers", self.buffers, BUFFER_MODES))
        if (self.outer_lr is not None and self.outer_lr <= 0) or self.co2_lr <= 0:
            raise ValueError("sync.outer_lr and sync.co2_lr must be > 0")
        if self.outer_momentum is not None and not 0.0 <= self.outer_momentum < 1.0:
            raise ValueError(f"sync.outer_momentum must be in [0, 1), got {self.outer_momentum}")
        if not 0.0 <= self.co2_momentum < 1.0:
            raise ValueError(f"sync.co2_momentum must be in [0, 1), got {self.co2_momentum}")
        if self.replan_threshold <= 0:
            raise ValueError("sync.replan_threshold must be > 0")
        if not 0.0 <= self.plan_margin <= 9.0:
            raise ValueError(f"sync.plan_margin must be in [0, 9], got {self.plan_margin}")
        if not 0.0 <= self.round_cost_s <= 60.0:
            raise ValueError(f"sync.round_cost_s must be in [0, 60] seconds, got {self.round_cost_s}")
        if self.group_outer_lr is not None and not 0.0 < self.group_outer_lr <= 2.0:
            raise ValueError(f"sync.group_outer_lr must be in (0, 2], got {self.group_outer_lr}")
        if self.group_outer_momentum is not None and not 0.0 <= self.group_outer_momentum < 1.0:
            raise ValueError(f"sync.group_outer_momentum must be in [0, 1), got {self.group_outer_momentum}")
        if self.flush_codec and (self.flush_codec not in CODEC_NAMES or is_sparse(self.flush_codec)):
            dense = ", ".join(c for c in CODEC_NAMES if not is_sparse(c))
            raise ValueError(f"sync.flush_codec must be a dense codec ({dense}), got {self.flush_codec!r}")
        if self.delta_codec and self.delta_codec not in CODEC_NAMES:
            raise ValueError(f"sync.delta_codec: {unknown_codec_message(self.delta_codec)}")
        if isinstance(self.link_codecs, str) or not all(isinstance(c, str) for c in self.link_codecs):
            raise ValueError(f"sync.link_codecs must be a list of codec names, got {self.link_codecs!r}")
        object.__setattr__(self, "link_codecs", tuple(self.link_codecs))  # a TOML array arrives as a list
        if isinstance(self.plan_codecs, str) or not all(isinstance(c, str) for c in self.plan_codecs):
            raise ValueError(f"sync.plan_codecs must be a list of codec names, got {self.plan_codecs!r}")
        object.__setattr__(self, "plan_codecs", tuple(self.plan_codecs))
        unknown = [c for c in self.plan_codecs if c not in CODEC_NAMES]
        if unknown:
            raise ValueError(f"sync.plan_codecs: {unknown_codec_message(unknown[0])}")
        self._check_delta_fallbacks()
        _check_sparse_codecs(self)
        if not 0.0 < self.codec_link_budget <= 1.0:
            raise ValueError(f"sync.codec_link_budget must be in (0, 1], got {self.codec_link_budget}")
        if self.link_codecs:
            try:
                check_link_codecs(self.codec, self.link_codecs, self.link_codec_tolerance)
            except ValueError as exc:
                raise ValueError(f"sync.link_codecs: {exc}") from None

    def _check_delta_fallbacks(self) -> None:
        """Known codec names, each sending fewer bytes than the one before it."""
        names = self.delta_fallbacks
        if isinstance(names, str) or not all(isinstance(c, str) for c in names):
            raise ValueError(f"sync.delta_fallbacks must be a list of codec names, got {names!r}")
        try:
            names = tuple(canonical_codec(c) for c in names)
        except ValueError as exc:
            raise ValueError(f"sync.delta_fallbacks: {exc}") from None
        object.__setattr__(self, "delta_fallbacks", names)
        for before, after in itertools.pairwise(names):
            if wire_rank(after) <= wire_rank(before):
                raise ValueError(
                    f"sync.delta_fallbacks: {after} sends no fewer bytes than {before}; list them least "
                    "compressive first"
                )

    @property
    def delta_chain(self) -> tuple[str, ...]:
        """The codecs a plan's pseudo-gradients may use, least compressive first: ``delta_codec``, then the
        fallbacks that send fewer bytes than it; empty without a delta codec."""
        if not self.delta_codec:
            return ()
        base = wire_rank(self.delta_codec)
        return (canonical_codec(self.delta_codec), *(c for c in self.delta_fallbacks if wire_rank(c) > base))

    def keeps_unsent(self, codec: str) -> bool:
        """Whether pseudo-gradient syncs in ``codec`` leave what it did not carry in the parameters
        (`keep_unsent`: a 2-bit or sparse codec, unless error feedback carries it instead)."""
        return self.keep_unsent and not self.error_feedback and needs_feedback(codec)

    def flush_delta_codec(self, plan_codec: str) -> str:
        """What DreamDDP's flush() sends its pseudo-gradients in when the plan in force syncs them in
        ``plan_codec``: ``flush_codec`` when set; int2 where the plan's codec keeps its unsent parts (a tight
        link: a sparse flush would drop them, and 4 bits would cost the run as much as its syncs did); else
        ``delta_codec``."""
        if self.flush_codec:
            return self.flush_codec
        return "int2" if self.keeps_unsent(plan_codec) else self.delta_codec

    @property
    def delay_cap(self) -> int:
        """The largest delay a DreamDDP group may get: ``max_delay``, or period - 1 when unset."""
        return self.period - 1 if self.max_delay is None else self.max_delay

    @property
    def link_margin(self) -> float:
        """The planner's `LinkModel.margin`: syncs planned as if they took this factor longer than measured."""
        return 1.0 + self.plan_margin

    @property
    def outer(self) -> tuple[float, float]:
        """(lr, momentum) of the outer optimizer; :meth:`with_outer_defaults` must have resolved them."""
        if self.outer_lr is None or self.outer_momentum is None:
            raise ValueError("sync.outer_lr/outer_momentum are unresolved: call with_outer_defaults(optimizer)")
        return self.outer_lr, self.outer_momentum

    @property
    def group_outer(self) -> tuple[float, float]:
        """(lr, momentum) of DreamDDP's per-group outer step; resolved like :attr:`outer`."""
        if self.group_outer_lr is None or self.group_outer_momentum is None:
            raise ValueError("sync.group_outer_lr/momentum are unresolved: call with_outer_defaults(optimizer)")
        return self.group_outer_lr, self.group_outer_momentum

    def with_outer_defaults(self, adaptive_inner: bool) -> SyncConfig:
        """Fill the outer optimizer settings left unset from the kind of inner optimizer (see PLAIN_OUTER)."""
        lr, momentum = ADAPTIVE_OUTER if adaptive_inner else PLAIN_OUTER
        group_lr, group_momentum = GROUP_OUTER_ADAPTIVE if adaptive_inner else PLAIN_OUTER
        return replace(
            self,
            outer_lr=self.outer_lr if self.outer_lr is not None else lr,
            outer_momentum=self.outer_momentum if self.outer_momentum is not None else momentum,
            # DreamDDP's per-layer step: its own defaults (GROUP_OUTER_ADAPTIVE), measured apart from DiLoCo's
            group_outer_lr=self.group_outer_lr if self.group_outer_lr is not None else group_lr,
            group_outer_momentum=self.group_outer_momentum if self.group_outer_momentum is not None else group_momentum,
        )

    def _check_periods(self) -> None:
        if self.periods not in PERIOD_KINDS:
            raise ValueError(one_of_message("sync.periods", self.periods, PERIOD_KINDS))
        if self.periods == "time" and self.strategy not in (*TIMED_STRATEGIES, "none"):
            raise ValueError(
                f"sync.periods = 'time' applies to {', '.join(TIMED_STRATEGIES)}, not {self.strategy!r}: ssgd "
                "averages every step, and the others run their periods in steps (periods = 'steps') for now"
            )

    @property
    def timed_periods(self) -> bool:
        """Whether members follow the cluster's step clock instead of meeting after equal step counts."""
        return self.periods == "time" and self.strategy in TIMED_STRATEGIES

    def shared_settings(self) -> dict[str, str]:
        """Every setting, as strings: all of them must be equal on every member (see `dreamp2p.settings`)."""
        return {f"sync.{f.name}": str(getattr(self, f.name)) for f in fields(self)}

    @staticmethod
    def from_dict(data: dict[str, Any]) -> SyncConfig:
        for key, why in REMOVED_KEYS.items():
            if key in data:
                raise ValueError(f"sync.{key} is no longer a setting: {why}")
        known = {f.name for f in fields(SyncConfig)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown key sync.{unknown[0]}; allowed keys: {', '.join(sorted(known))}")
        return SyncConfig(**data)


def _check_sparse_codecs(cfg: SyncConfig) -> None:
    """A sparse codec (``topk``) only where something carries what it leaves out: DreamDDP's pseudo-gradients,
    with ``error_feedback`` or ``keep_unsent``. Averaging parameters with it would zero 98% of them, and
    the other increments (gradients, outer gradients) are sent without feedback, so it would drop 98%."""
    carriers = {
        "codec": (cfg.codec,),
        "stream_codec": (cfg.stream_codec,),
        "plan_codecs": cfg.plan_codecs,
        "link_codecs": cfg.link_codecs,
    }
    for key, names in carriers.items():
        sparse = [c for c in names if is_sparse(c)]
        if sparse:
            raise ValueError(
                f"sync.{key}: {sparse[0]} is a sparse codec, usable only as sync.delta_codec or a fallback "
                "(it sends 2% of each block and decodes the rest as zeros)"
            )
    carried = cfg.error_feedback or cfg.keep_unsent
    if cfg.delta_codec and needs_feedback(cfg.delta_codec) and not carried:
        loss = (
            "is sparse (2% of each block per round)"
            if is_sparse(cfg.delta_codec)
            else "loses about half of each pseudo-gradient per round"
        )
        raise ValueError(
            f"sync.delta_codec {cfg.delta_codec} {loss}: it needs sync.error_feedback = true (or "
            "sync.keep_unsent = true), which carries the rest into the next rounds"
        )
    sparse = [c for c in cfg.delta_chain if is_sparse(c)]
    if sparse and not carried:
        raise ValueError(
            f"sync.delta_fallbacks: {sparse[0]} is a sparse codec (2% of each block per round): it needs "
            'sync.keep_unsent = true or sync.error_feedback = true, or leave it out (delta_fallbacks = ["int2"])'
        )


def dreamddp_settings(codec: str, period: int, max_delay: int | None = None) -> dict[str, Any]:
    """The ``[sync]`` settings that run DreamDDP's layer syncs in ``codec`` every ``period`` steps, landing at
    most ``max_delay`` steps late (None: left out, so the default cap, period - 1) — what ``dreamp2p plan
    --target-cu`` recommends, in a user's words.

    A 4-bit, 2-bit or sparse codec carries pseudo-gradients (``delta_codec``, the default mode; what a 2-bit
    or sparse one leaves out stays in the parameters, ``keep_unsent``'s default, not in error feedback, which
    lost the model on `bench lm`): 4 bits of a weight are too coarse, 4 bits of an update are not. A wider
    codec averages the parameters themselves (``delta_codec = ""``, ``plan_codecs = [codec]``).
    """
    name = canonical_codec(codec)
    out: dict[str, Any] = {"strategy": "dreamddp", "period": period}
    if max_delay is not None:
        out["max_delay"] = max_delay
    if wire_rank(name) >= wire_rank("int4"):
        out["delta_codec"] = name
    else:
        out.update(delta_codec="", plan_codecs=[name])
    if period <= SyncConfig.stream_delay:  # checked for every strategy: Streaming DiLoCo's delay < the period
        out["stream_delay"] = 0
    SyncConfig.from_dict(out)  # a ValueError here, not in the run it is pasted into
    return out
