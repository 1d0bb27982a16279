"""Compute utilization against WAN bandwidth: what each sync strategy needs to reach a target, and which settings do.

One responsibility: answer "how many Gbit/s for X% compute utilization?" (``needed_bandwidth``,
``bandwidth_table``) and "which period, delay and codec reach X% on this link?" (``recommend``), from the same
pure cost model as the DreamDDP planner (``cost.ring_comm_time``: a ring all-reduce of ``n`` fp32 bytes costs
``2(N-1)/N * n * codec_ratio / bandwidth + 2(N-1) * RTT/2``). Utilization is ``compute / (compute + exposed
communication)`` per step. Pure: no I/O, no clocks, no torch.

Papers: Streaming DiLoCo (Douillard et al. 2025, "Streaming DiLoCo with overlapping communication: Towards a
Distributed Free Lunch", arXiv 2501.18512), whose Table 4 gives the model sizes, layer counts and per-step compute
times used by ``PAPER_WORKLOADS``; DiLoCo (Douillard et al. 2023, arXiv 2311.08105); DreamDDP (arXiv 2502.11058).

Exposed communication per step, in closed form (``C`` step compute, ``B`` its backward part, ``L`` layers,
``T(n)`` the ring time of ``n`` fp32 bytes with the method's codec ratio):

* data-parallel: every step's gradients, pipelined over the backward pass (bucketed all-reduce as in PyTorch DDP;
  the paper's simulator, its Figure 3, also interleaves per-layer reductions with the backward pass): the link
  can start once the first layer's gradient exists (after ``B/L``) and the last layer's share cannot start before
  ``B``, so exposed = ``max(T(all/L), T(all) - B(L-1)/L)``. Without the overlap (``overlap_backward=False``) it
  is ``T(all)``.
* DiLoCo: the whole model every ``H`` steps, blocking: ``T(all) / H``.
* Streaming DiLoCo: ``n = min(P, H)`` fragment syncs per period, launched every ``H // n`` steps, each landing up
  to ``tau`` steps later: each waits ``max(0, T(all/n) - min(tau, H // n) C)``. Once ``tau`` exceeds the launch
  interval the link is the bottleneck and a step cannot run faster than the link drains the queue, which is the
  ``H // n`` term.
* DreamDDP with delays up to ``d``: the planner's delay-friendly starting points are ``k`` equal contiguous groups,
  one all-reduce each, launched every ``H // k`` steps (``dreamddp._spread_candidates``); this is Streaming DiLoCo's
  formula with ``tau = d`` and the best ``k`` among the planner's group counts that divide ``L``. It leaves out
  the extra overlap with the launch iteration's backward, so the planner itself predicts at least this
  utilization (tests check it): the bound is conservative, which is the safe side for a bandwidth requirement.

Utilization never falls as bandwidth grows, so the needed bandwidth is found by bisection in log space; it is
``None`` where latency alone keeps the target out of reach.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from dreamp2p.schedule.cost import LayerCost, LinkModel, ring_comm_time, ring_wire_bytes
from dreamp2p.schedule.dreamddp import plan_dreamddp, rounds_per_step, simulate
from dreamp2p.schedule.plancodec import link_busy_fraction

KINDS = ("data-parallel", "diloco", "streaming", "dreamddp")
# Streaming DiLoCo, Table 4 and its text: H = 100 inner steps, fragments of 3 layers, CU columns 50..99%.
PAPER_PERIOD = 100
PAPER_FRAGMENT_LAYERS = 3
PAPER_TARGETS = (0.5, 0.8, 0.9, 0.95, 0.99)
# The paper's main experiments overlap one inner step ("we used 1 step for simplicity", section 3.3.2).
PAPER_OVERLAP = 1
# Wire bytes per fp32 byte: 16-bit grads/weights, and 4-bit values without block scales.
RATIO_FP32, RATIO_BF16, RATIO_4BIT = 1.0, 0.5, 0.125
# Bisection brackets in bytes/s: 1 B/s .. 1e30 B/s (a stand-in for "infinite" that LinkModel accepts).
_LOW_BPS, _INFINITE_BPS = 1.0, 1e30
_BISECT_REL = 1e-9
# Periods the target search tries when --period does not pin one; DreamDDP codec candidates, least lossy first
# (the same order as SyncConfig.plan_codecs: raw weights are averaged, so no 4-bit codec).
SEARCH_PERIODS = (1, 2, 5, 10, 20, 50, 100)
SEARCH_CODECS = ("fp32", "bf16", "int8")


def _real(name: str, value: float, low: float, high: float = math.inf, open_low: bool = True) -> None:
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < low or (open_low and value == low) or value > high:
        bound = f"({low}, {high}]" if open_low else f"[{low}, {high}]"
        raise ValueError(f"{name} must be a finite number in {bound}, got {value!r}")


def _positive_int(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")


def _check_target(target: float) -> None:
    ok = isinstance(target, int | float) and not isinstance(target, bool) and 0.0 < target < 1.0
    if not ok:
        raise ValueError(f"target utilization must be a number in (0, 1), got {target!r}")


@dataclass(frozen=True)
class Workload:
    """A model: its parameters in ``layers`` equal layers and the compute time (forward + backward) of one step."""

    name: str
    params: float
    layers: int
    step_time_s: float
    backward_fraction: float = 2.0 / 3.0  # backward costs about twice the forward

    def __post_init__(self) -> None:
        _real("params", self.params, 0.0)
        _positive_int("layers", self.layers)
        _real("step_time_s", self.step_time_s, 0.0)
        _real("backward_fraction", self.backward_fraction, 0.0, 1.0)

    @property
    def fp32_bytes(self) -> int:
        return int(4 * self.params)


@dataclass(frozen=True)
class Network:
    """The ring: peers (one per region) and the largest RTT; bandwidth is what the solver varies."""

    peers: int = 2
    rtt_s: float = 0.0

    def __post_init__(self) -> None:
        _positive_int("peers", self.peers)
        _real("rtt_s", self.rtt_s, 0.0, open_low=False)

    def link(self, bandwidth_Bps: float, ratio: float) -> LinkModel:
        return LinkModel(bandwidth_Bps=bandwidth_Bps, rtt_s=self.rtt_s, world=self.peers, codec_ratio=ratio)


@dataclass(frozen=True)
class Method:
    """One sync strategy and its knobs; ``ratio`` is wire bytes per fp32 byte (fp32 1, bf16 0.5, 4-bit 0.125)."""

    label: str
    kind: str
    ratio: float = RATIO_FP32
    period: int = 1  # H: every parameter is synchronized once per H steps
    fragment_layers: int = PAPER_FRAGMENT_LAYERS  # streaming: layers per fragment, P = ceil(L / this)
    overlap: int = 0  # streaming: tau; dreamddp: the largest landing delay d (< H)
    overlap_backward: bool = True  # data-parallel: pipeline the all-reduce over the backward pass

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown method kind {self.kind!r}; expected one of {list(KINDS)}")
        _real("ratio", self.ratio, 0.0, 4.0)
        _positive_int("period", self.period)
        _positive_int("fragment_layers", self.fragment_layers)
        if isinstance(self.overlap, bool) or not isinstance(self.overlap, int) or self.overlap < 0:
            raise ValueError(f"overlap must be an int >= 0, got {self.overlap!r}")
        if self.kind == "dreamddp" and self.overlap >= self.period:
            raise ValueError(f"a DreamDDP delay ({self.overlap}) must be less than the period ({self.period})")


# --------------------------------------------------------------------------------------------- exposure model


def _group_counts(layers: int, period: int) -> list[int]:
    """The planner's spread group counts (1, 2, 3, 4, 6, 8, 12, ... up to min(H, L)) that split L layers evenly."""
    kmax = min(period, layers)
    ks: list[int] = []
    k = 1
    while k <= kmax:
        ks.extend(x for x in (k, k + k // 2) if x <= kmax and x not in ks)
        k *= 2
    if kmax not in ks:
        ks.append(kmax)
    # uneven groups would make the largest one slower than all/k: only even splits keep the bound conservative
    return sorted(x for x in ks if layers % x == 0)


def _staggered_wait(T: Callable[[int], float], total: int, n: int, period: int, window: int, C: float) -> float:
    """Exposed seconds per period: ``n`` equal syncs launched every ``period // n`` steps, due ``window`` later."""
    interval = max(1, period // n)
    return n * max(0.0, T(total // n) - min(window, interval) * C)


def _dreamddp_waits(method: Method, work: Workload, link: LinkModel) -> tuple[list[int], list[float]]:
    """Group counts k and the exposed seconds per period of k spread groups, each landing within the delay."""
    ks = _group_counts(work.layers, method.period)

    def T(nbytes: int) -> float:
        return ring_comm_time(nbytes, link)

    C, H, total = work.step_time_s, method.period, work.fp32_bytes
    return ks, [_staggered_wait(T, total, k, H, method.overlap, C) for k in ks]


def exposed_per_step(method: Method, work: Workload, net: Network, bandwidth_Bps: float) -> float:
    """Mean seconds per step that ``method`` waits for the link at ``bandwidth_Bps`` (see the module docstring)."""
    link = net.link(bandwidth_Bps, method.ratio)

    def T(nbytes: int) -> float:
        return ring_comm_time(nbytes, link)

    C, L, H, total = work.step_time_s, work.layers, method.period, work.fp32_bytes
    if method.kind == "data-parallel":
        if not method.overlap_backward:
            return T(total)
        B = work.backward_fraction * C
        return max(T(total // L), T(total) - B * (L - 1) / L)
    if method.kind == "diloco":
        return T(total) / H
    if method.kind == "streaming":
        n = min(-(-L // method.fragment_layers), H)  # fragments sharing an offset sync together
        return _staggered_wait(T, total, n, H, method.overlap, C) / H
    return min(_dreamddp_waits(method, work, link)[1]) / H


def utilization(method: Method, work: Workload, net: Network, bandwidth_Bps: float) -> float:
    """Compute utilization: step compute over step compute plus exposed communication."""
    C = work.step_time_s
    return C / (C + exposed_per_step(method, work, net, bandwidth_Bps))


def ceiling(method: Method, work: Workload, net: Network) -> float:
    """Utilization with unlimited bandwidth: what latency alone allows."""
    return utilization(method, work, net, _INFINITE_BPS)


def needed_bandwidth(method: Method, work: Workload, net: Network, target: float) -> float | None:
    """Least bandwidth (bytes/s) at which ``method`` reaches ``target`` utilization; None if latency forbids it.

    Bisection in log space on a monotone function; the returned value satisfies the target when fed back.
    """
    _check_target(target)
    if ceiling(method, work, net) < target:
        return None
    lo, hi = _LOW_BPS, _LOW_BPS
    while utilization(method, work, net, hi) < target:
        lo, hi = hi, hi * 16.0
        if hi >= _INFINITE_BPS:
            hi = _INFINITE_BPS
            break
    if hi == _LOW_BPS:
        return hi
    while hi > lo * (1.0 + _BISECT_REL):
        mid = math.sqrt(lo * hi)
        if utilization(method, work, net, mid) >= target:
            hi = mid
        else:
            lo = mid
    return hi


# ------------------------------------------------------------------------------------------------ paper table

# Streaming DiLoCo, Table 4: model size, number of layers and step time (pure compute, forward and backward).
PAPER_WORKLOADS = (
    Workload("1B", 1e9, 24, 0.1),
    Workload("10B", 10e9, 48, 0.8),
    Workload("100B", 100e9, 108, 4.9),
)


def paper_methods(period: int = PAPER_PERIOD, tau: int = PAPER_OVERLAP, delay: int | None = None) -> tuple[Method, ...]:
    """The table's rows: data-parallel fp32/bf16, DiLoCo, Streaming DiLoCo fp32/4-bit, DreamDDP (delay <= H-1)."""
    d = period - 1 if delay is None else delay
    return (
        Method("data-parallel fp32", "data-parallel", RATIO_FP32),
        Method("data-parallel bf16", "data-parallel", RATIO_BF16),
        Method(f"DiLoCo fp32 H={period}", "diloco", RATIO_FP32, period),
        Method(f"Streaming DiLoCo fp32 H={period} tau={tau}", "streaming", RATIO_FP32, period, overlap=tau),
        Method(f"Streaming DiLoCo 4-bit H={period} tau={tau}", "streaming", RATIO_4BIT, period, overlap=tau),
        Method(f"DreamDDP fp32 H={period} d<={d}", "dreamddp", RATIO_FP32, period, overlap=d),
    )


@dataclass(frozen=True)
class TableRow:
    model: str
    params: float
    layers: int
    step_time_s: float
    method: str
    kind: str
    fragments: int  # syncs per period: P for streaming, the best group count for DreamDDP, 1 otherwise
    needed_Bps: tuple[float | None, ...]  # one per target; None: latency alone keeps it out of reach

    @property
    def gbit_s(self) -> tuple[float | None, ...]:
        return tuple(None if b is None else b * 8.0 / 1e9 for b in self.needed_Bps)


def _fragments(method: Method, work: Workload, net: Network, bandwidth_Bps: float | None) -> int:
    if method.kind == "streaming":
        return min(-(-work.layers // method.fragment_layers), method.period)
    if method.kind != "dreamddp" or bandwidth_Bps is None:
        return 1
    ks, waits = _dreamddp_waits(method, work, net.link(bandwidth_Bps, method.ratio))
    return ks[waits.index(min(waits))]  # the first (fewest groups, least latency) of equally good counts


def bandwidth_table(
    workloads: Sequence[Workload] = PAPER_WORKLOADS,
    methods: Sequence[Method] | None = None,
    net: Network | None = None,
    targets: Sequence[float] = PAPER_TARGETS,
) -> tuple[TableRow, ...]:
    """Needed bandwidth for every (workload, method, target); by default the paper's models and our rows."""
    methods = paper_methods() if methods is None else methods
    net = Network() if net is None else net
    for t in targets:
        _check_target(t)
    rows = []
    for work in workloads:
        for m in methods:
            needed = tuple(needed_bandwidth(m, work, net, t) for t in targets)
            at = next((b for b in reversed(needed) if b is not None), None)
            frags = _fragments(m, work, net, at)
            rows.append(TableRow(work.name, work.params, work.layers, work.step_time_s, m.label, m.kind, frags, needed))
    return tuple(rows)


# ------------------------------------------------------------------------------------------ target search


@dataclass(frozen=True)
class Setting:
    """One DreamDDP setting the search evaluated with the planner, and what the planner predicts for it."""

    codec: str
    period: int
    delay: int  # largest landing delay the planner may use (d < period)
    fragments: int  # all-reduce groups per period in the plan (each layer in exactly one)
    utilization: float
    step_time_s: float
    bytes_per_step: float  # wire bytes per peer per step
    link_busy: float = 0.0  # link seconds of a period's syncs over its compute seconds (margin included)


@dataclass(frozen=True)
class Recommendation:
    target: float
    best: Setting | None  # the preferred setting that reaches the target; None if none in the grid does
    closest: Setting | None  # best if set, else the highest utilization the planner predicted in the grid
    evaluated: int  # planner runs
    needed_Bps: float | None  # when best is None: bandwidth the most frugal grid setting needs (closed form)
    needed_for: str  # that setting, in words ("" when best is set)
    message: str


def _evaluate(
    costs: Sequence[LayerCost], link: LinkModel, codec: str, H: int, d: int, round_cost_s: float = 0.0
) -> Setting:
    """Plan and simulate like ``dreamddp.predict`` (no bubble filling, as ``dreamp2p plan`` does)."""
    plan = plan_dreamddp(costs, link, H, max_delay=d, bubble_fill=False, round_cost_s=round_cost_s)
    timeline = simulate(plan, costs, link)
    exposed = math.fsum(it.exposed_s for it in timeline) / H
    step = plan.compute_s + exposed + rounds_per_step(plan) * round_cost_s
    wire = math.fsum(ring_wire_bytes(sum(costs[x].nbytes for x in s.layers), link) for s in plan.syncs) / H
    groups = sum(1 for s in plan.syncs if not s.repeat)
    util = plan.compute_s / step if step > 0 else 1.0
    busy = link_busy_fraction(costs, link, H, plan)
    return Setting(codec, H, d, groups, util, step, wire, busy)


_BUDGET_ROUNDS = 8  # rescalings of the needed bandwidth until a plan fits the link budget


def _bandwidth_for_budget(
    costs: Sequence[LayerCost], link: LinkModel, codec: str, H: int, d: int, round_cost_s: float, budget: float
) -> tuple[float, int]:
    """Bandwidth at which the planner's plan for this setting keeps the link within ``budget``, and the
    planner runs it took. The budget may bind before utilization does: the bandwidth is scaled by how far
    the link time is over budget until the plan fits (a new bandwidth may change the plan)."""
    bw = link.bandwidth_Bps
    runs = 0
    for _ in range(_BUDGET_ROUNDS):
        lk = LinkModel(bw, link.rtt_s, link.world, link.codec_ratio, link.per_hop_overhead_s, link.margin)
        busy = _evaluate(costs, lk, codec, H, d, round_cost_s).link_busy
        runs += 1
        if busy <= budget:
            break
        bw *= 1.01 * busy / budget
    return bw, runs


def _delays(H: int, cap: int | None) -> list[int]:
    """0, 1, 2, 4, ... below H, and H - 1, capped at ``cap``: small delays first (fresher weights)."""
    top = H - 1 if cap is None else min(cap, H - 1)
    out = {0, top}
    p = 1
    while p < top:
        out.add(p)
        p *= 2
    return sorted(out)


def _throughput_bound(costs: Sequence[LayerCost], link: LinkModel, H: int) -> float:
    """Utilization no plan can beat: a period takes at least as long as the link needs to carry all its bytes."""
    compute = H * math.fsum(c.fwd_s + c.bwd_s for c in costs)
    busy = ring_comm_time(sum(c.nbytes for c in costs), link)  # more groups only add latency
    return compute / max(compute, busy) if compute > 0 else 1.0


def _workload_of(costs: Sequence[LayerCost]) -> Workload:
    compute = math.fsum(c.fwd_s + c.bwd_s for c in costs)
    backward = math.fsum(c.bwd_s for c in costs)
    return Workload("profile", sum(c.nbytes for c in costs) / 4.0, len(costs), compute, backward / compute)


def _unreached(
    costs: Sequence[LayerCost], link: LinkModel, target: float, codecs: Sequence[tuple[str, float]], H: int, d: int
) -> tuple[float | None, str, str]:
    """Bandwidth the most frugal grid setting needs (closed form), that setting in words, and the message tail."""
    name, ratio = min(codecs, key=lambda c: c[1])
    method = Method(f"DreamDDP {name} H={H} d<={d}", "dreamddp", ratio, H, overlap=d)
    work, net = _workload_of(costs), Network(link.world, link.rtt_s)
    needed = needed_bandwidth(method, work, net, target)
    what = f"DreamDDP with codec {name}, period {H}, max delay {d}"
    if needed is None:
        top = ceiling(method, work, net)
        return None, what, f"even unlimited bandwidth cannot reach it at this RTT: {what} tops out at {top:.3f}"
    now = link.bandwidth_Bps * 8 / 1e9
    return needed, what, f"{what} needs about {needed * 8 / 1e9:.3g} Gbit/s (closed-form estimate; {now:.3g} now)"


def _check_search(
    costs: Sequence[LayerCost],
    target: float,
    codecs: Sequence[tuple[str, float]],
    periods: Sequence[int],
    max_delay: int | None,
    link_budget: float | None,
) -> None:
    _check_target(target)
    if not codecs:
        raise ValueError("no candidate codecs")
    if link_budget is not None and not 0.0 < link_budget <= 1.0:
        raise ValueError(f"link_budget must be in (0, 1], got {link_budget!r}")
    if not math.fsum(c.fwd_s + c.bwd_s for c in costs) > 0:  # utilization is undefined without compute
        raise ValueError("the layer costs must have some compute time")
    for H in periods:
        _positive_int("period", H)
    if max_delay is not None and (isinstance(max_delay, bool) or not isinstance(max_delay, int) or max_delay < 0):
        raise ValueError(f"max_delay must be an int >= 0, got {max_delay!r}")


def recommend(
    costs: Sequence[LayerCost],
    link: LinkModel,
    target: float,
    codecs: Sequence[tuple[str, float]],
    periods: Sequence[int] = SEARCH_PERIODS,
    max_delay: int | None = None,
    round_cost_s: float = 0.0,
    link_budget: float | None = None,
) -> Recommendation:
    """The preferred DreamDDP setting whose planned utilization reaches ``target`` on ``link``.

    A setting qualifies when its predicted utilization (each round's ``round_cost_s`` included) reaches the
    target and its syncs keep the link busy at most ``link_budget`` of the period's compute time (with
    ``link.margin``; None: no budget):
    pass a run's own (`SyncConfig.link_margin`, ``round_cost_s``, ``codec_link_budget``) so a recommendation
    keeps the headroom the runtime itself demands of a plan codec, instead of a knife-edge setting.

    ``codecs`` are (name, wire bytes per fp32 byte), least lossy first; ``link.codec_ratio`` is ignored. Preference,
    i.e. search order with the first hit taken: least lossy codec, then smallest period (workers drift apart
    less), then smallest delay (fresher weights). Every setting is planned and simulated by the DreamDDP planner,
    after a throughput bound skips periods whose bytes the link cannot carry. For each (codec, period) the
    largest delay is tried first: if the planner cannot reach the target with it, smaller delays are not tried
    (a heuristic: the planner with a larger delay bound is never worse than with none, though not provably
    better than with every smaller bound).
    """
    _check_search(costs, target, codecs, periods, max_delay, link_budget)
    budget = math.inf if link_budget is None else link_budget
    grid = sorted(set(periods))
    evaluated, closest, bound = 0, None, 0.0
    for name, ratio in codecs:
        lk = LinkModel(link.bandwidth_Bps, link.rtt_s, link.world, ratio, link.per_hop_overhead_s, link.margin)
        for H in grid:
            limit = _throughput_bound(costs, lk, H)
            bound = max(bound, limit)
            if limit < target:
                continue
            delays = _delays(H, max_delay)
            top = _evaluate(costs, lk, name, H, delays[-1], round_cost_s)
            evaluated += 1
            closest = top if closest is None or top.utilization > closest.utilization else closest
            if top.utilization < target or top.link_busy > budget:
                continue
            best = top
            for d in delays[:-1]:  # smallest delay first; the largest one is known to reach the target
                trial = _evaluate(costs, lk, name, H, d, round_cost_s)
                evaluated += 1
                if trial.utilization >= target and trial.link_busy <= budget:
                    best = trial
                    break
            msg = (
                f"DreamDDP with codec {best.codec}, period {best.period}, max delay {best.delay} "
                f"({best.fragments} all-reduce groups per period) reaches {best.utilization:.3f} >= {target}"
            )
            return Recommendation(target, best, best, evaluated, None, "", msg)
    H = grid[-1]
    d = H - 1 if max_delay is None else min(max_delay, H - 1)
    needed, what, tail = _unreached(costs, link, target, codecs, H, d)
    if link_budget is not None and needed is not None:
        name, ratio = min(codecs, key=lambda c: c[1])
        lk = LinkModel(link.bandwidth_Bps, link.rtt_s, link.world, ratio, link.per_hop_overhead_s, link.margin)
        for_budget, runs = _bandwidth_for_budget(costs, lk, name, H, d, round_cost_s, link_budget)
        evaluated += runs
        if for_budget > needed:
            needed = for_budget
            tail = f"{what} needs about {needed * 8 / 1e9:.3g} Gbit/s to keep the link within budget "
            tail += f"({link.bandwidth_Bps * 8 / 1e9:.3g} now)"
    head = f"no setting in the grid reaches {target}"
    if link_budget is not None:
        head += f" with the link busy at most {link_budget:.0%} of the period"
    if closest is not None:
        head += f" (closest: codec {closest.codec}, period {closest.period}, delay {closest.delay}: "
        head += f"{closest.utilization:.3f})"
    else:  # every setting was skipped: say how far off the link is
        head += f" (the link time alone caps it at {bound:.3f})"
    return Recommendation(target, None, closest, evaluated, needed, what, f"{head}; {tail}")
