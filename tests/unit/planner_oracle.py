"""Exhaustive optimum of the DreamDDP delay-0 timing model: the oracle the planner's search is checked against.

Written apart from ``dreamp2p.schedule.dreamddp`` (it shares only the cost model), so it checks the planner
rather than repeating it. It enumerates C(L + H - 1, H - 1) segmentations times 2^(n-1) bucketings, so it is
for tests only and refuses more than :data:`MAX_LAYERS` layers.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

from dreamp2p.schedule.cost import LayerCost, LinkModel, ring_comm_time

MAX_LAYERS = 10


def brute_force(costs: Sequence[LayerCost], link: LinkModel, H: int) -> tuple[float, tuple[tuple[int, ...], ...]]:
    """The least total exposed wait over one period and, per iteration, the forward indices it syncs.

    Every split of the backward-order layers into H contiguous, possibly empty segments (iteration h syncs
    segment h) and every bucketing of each segment is tried; a bucket is launched when its last layer's
    gradient is ready and the link serves buckets in order. Ties keep the lexicographically first split.
    """
    L = len(costs)
    if L > MAX_LAYERS:
        raise ValueError(f"brute_force is exhaustive; at most {MAX_LAYERS} layers, got {L}")
    # backward position k is forward layer L-1-k; it is ready once backward has passed it
    ready_b = list(itertools.accumulate(costs[L - 1 - k].bwd_s for k in range(L)))
    backward_s = ready_b[-1] if ready_b else 0.0
    prefix = [0, *itertools.accumulate(costs[L - 1 - k].nbytes for k in range(L))]
    waits: dict[tuple[int, int], float] = {}

    def wait(s: int, e: int) -> float:
        if s == e:
            return 0.0
        if (s, e) not in waits:
            best = math.inf
            for mask in range(1 << (e - s - 1)):
                bounds = [s] + [s + 1 + p for p in range(e - s - 1) if mask >> p & 1] + [e]
                f = 0.0
                for i, j in itertools.pairwise(bounds):
                    f = max(ready_b[j - 1], f) + ring_comm_time(prefix[j] - prefix[i], link)
                best = min(best, f)
            waits[(s, e)] = max(0.0, best - backward_s)
        return waits[(s, e)]

    best_total, best_bounds = math.inf, (0,) * H + (L,)
    for cuts in itertools.combinations_with_replacement(range(L + 1), H - 1):
        bounds = (0, *cuts, L)
        total = math.fsum(wait(a, b) for a, b in itertools.pairwise(bounds))
        if total < best_total:
            best_total, best_bounds = total, bounds
    segments = tuple(tuple(range(L - b, L - a)) for a, b in itertools.pairwise(best_bounds))
    return best_total, segments
