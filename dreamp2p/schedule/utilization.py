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

from dreamp2p.schedule.cost import LinkModel, ring_comm_time

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
# Periods the target search tries when --period does not pin one.
SEARCH_PERIODS = (1, 2, 5, 10, 20, 50, 100)


def _real(name: str, value: float, low: float, high: float = math.inf, open_low: bool = True) -> None:
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < low or (open_low and value == low) or value > high:
        bound = f"({low}, {high}]" if open_low else f"[{low}, {high}]"
        raise ValueError(f"{name} must be a finite number in {bound}, got {value!r}")


def check_positive_int(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")


def check_target(target: float) -> None:
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
        check_positive_int("layers", self.layers)
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
        check_positive_int("peers", self.peers)
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
        check_positive_int("period", self.period)
        check_positive_int("fragment_layers", self.fragment_layers)
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
    check_target(target)
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
    """The table's rows: data-parallel fp32/bf16, DiLoCo, Streaming DiLoCo fp32/4-bit, DreamDDP fp32/4-bit
    (delay <= H-1). DreamDDP's 4-bit row is what a dreamp2p run sends between its rare anchors: 4-bit
    pseudo-gradients."""
    d = period - 1 if delay is None else delay
    return (
        Method("data-parallel fp32", "data-parallel", RATIO_FP32),
        Method("data-parallel bf16", "data-parallel", RATIO_BF16),
        Method(f"DiLoCo fp32 H={period}", "diloco", RATIO_FP32, period),
        Method(f"Streaming DiLoCo fp32 H={period} tau={tau}", "streaming", RATIO_FP32, period, overlap=tau),
        Method(f"Streaming DiLoCo 4-bit H={period} tau={tau}", "streaming", RATIO_4BIT, period, overlap=tau),
        Method(f"DreamDDP fp32 H={period} d<={d}", "dreamddp", RATIO_FP32, period, overlap=d),
        Method(f"DreamDDP 4-bit H={period} d<={d}", "dreamddp", RATIO_4BIT, period, overlap=d),
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
        check_target(t)
    rows = []
    for work in workloads:
        for m in methods:
            needed = tuple(needed_bandwidth(m, work, net, t) for t in targets)
            at = next((b for b in reversed(needed) if b is not None), None)
            frags = _fragments(m, work, net, at)
            rows.append(TableRow(work.name, work.params, work.layers, work.step_time_s, m.label, m.kind, frags, needed))
    return tuple(rows)
