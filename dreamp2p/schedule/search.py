"""The delay-0 DreamDDP search: the cut of backward-order layers into one segment per iteration, and the
best bucketing of each segment into all-reduces, for the least total exposed wait.

The algorithm (the paper's depth-first search with pruning, memoised and evaluated bottom-up, and the
O(1)-amortized bucketing dynamic program) is described in `schedule.dreamddp`'s module docstring; the
delays, spread starting points and bubble filling of the WAN extension build on its result there. Pure:
no I/O, no clocks, every tie broken by a fixed rule.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence

from dreamp2p.schedule.cost import LinkModel, ring_comm_time
from dreamp2p.schedule.timing import Profile


class _Bucketing:
    """Best bucketing of backward positions [s, j) for growing j: one start s, extended lazily.

    ``f[j - s]`` is the earliest finish of positions [s, j) with the link idle at backward start, ``cut[j - s]``
    the first position of the last bucket achieving it; ``f`` is non-decreasing in j. With ``r`` the ready
    time of position j-1 (when the last bucket launches), a last bucket [i, j) finishes at
    ``max(r, f[i]) + comm(i, j)``. The candidates i fall into three runs, each with a known best, so a step
    costs O(1) amortized instead of O(j - s):

    * ``f[i] <= r`` (a prefix, as f is non-decreasing): the link is idle at launch, fewer bytes win, so the
      largest such i;
    * ``f[i] > r`` with a non-empty bucket: ``f[i] + lat + k * (P[j] - P[i])``, the least ``f[i] - k * P[i]``
      over a window whose both ends only move right: a monotone deque;
    * ``f[i] > r`` with only zero-byte layers in the bucket (no all-reduce at all): the least i.

    Finishes are then computed with ``ring_comm_time`` exactly as the simulator does, so the linear key only
    selects (it may pick a candidate a few ulps from the true optimum, never more). Ties between the runs go to
    the smaller i, i.e. the larger last bucket.
    """

    def __init__(self, s: int, ready_b: Sequence[float], prefix: Sequence[int], link: LinkModel) -> None:
        self.s = s
        self.ready_b = ready_b
        self.prefix = prefix
        self.link = link
        self.f = [0.0]  # the link is idle when backward starts: nothing of an earlier iteration is pending
        self.cut = [s]
        self.idle_end = s + 1  # positions [s, idle_end) have f <= r (f[s] = 0 <= every ready time)
        self.nonzero_end = s  # positions [s, nonzero_end) leave bytes in the bucket [i, j)
        self.pushed = s
        self.window: deque[tuple[float, int]] = deque()  # (f[i] - k * P[i], i), keys ascending
        world = link.world
        self.k = link.codec_ratio * (2.0 * (world - 1) / world) / link.bandwidth_Bps if world > 1 else 0.0

    def _value(self, i: int, j: int, r: float) -> float:
        return max(r, self.f[i - self.s]) + ring_comm_time(self.prefix[j] - self.prefix[i], self.link)

    def finish(self, e: int) -> float:
        s, f, prefix = self.s, self.f, self.prefix
        for j in range(s + len(f), e + 1):
            r = self.ready_b[j - 1]
            while self.idle_end < j and f[self.idle_end - s] <= r:
                self.idle_end += 1
            while self.nonzero_end < j and prefix[self.nonzero_end] < prefix[j]:
                self.nonzero_end += 1
            while self.pushed < self.nonzero_end:
                i = self.pushed
                key = f[i - s] - self.k * prefix[i]
                while self.window and self.window[-1][0] > key:
                    self.window.pop()
                self.window.append((key, i))
                self.pushed += 1
            while self.window and self.window[0][1] < self.idle_end:
                self.window.popleft()
            best_i = self.idle_end - 1
            best = self._value(best_i, j, r)
            if self.window:
                i = self.window[0][1]
                v = self._value(i, j, r)
                if v < best:
                    best, best_i = v, i
            i = max(self.idle_end, self.nonzero_end)
            if i < j:
                v = self._value(i, j, r)
                if v < best:
                    best, best_i = v, i
            f.append(best)
            self.cut.append(best_i)
        return f[e - s]


class Segments:
    """Earliest finish and bucketing of any segment [s, e) of backward positions (position k = layer L-1-k)."""

    def __init__(self, prof: Profile, link: LinkModel) -> None:
        L = prof.L
        self.L = L
        self.link = link
        self.ready_b = [prof.ready[L - 1 - k] for k in range(L)]
        self.prefix = [0] * (L + 1)
        for k in range(L):
            self.prefix[k + 1] = self.prefix[k] + prof.nbytes[L - 1 - k]
        self._by_start: list[_Bucketing | None] = [None] * L

    def comm(self, i: int, j: int) -> float:
        return ring_comm_time(self.prefix[j] - self.prefix[i], self.link)

    def _start(self, s: int) -> _Bucketing:
        b = self._by_start[s]
        if b is None:
            b = _Bucketing(s, self.ready_b, self.prefix, self.link)
            self._by_start[s] = b
        return b

    def finish(self, s: int, e: int) -> float:
        return self._start(s).finish(e)

    def buckets(self, s: int, e: int) -> list[tuple[int, int]]:
        b = self._start(s)
        b.finish(e)
        out = []
        j = e
        while j > s:
            i = b.cut[j - s]
            out.append((i, j))
            j = i
        out.reverse()
        return out


def search(seg: Segments, B: float, H: int) -> list[tuple[int, int]]:
    """Optimal contiguous segments (backward positions [s, e)) of the non-empty iterations, in order."""
    L = seg.L
    He = min(H, L)  # at-least-one: with L layers at most L iterations are non-empty
    cost = [[0.0] * (L + 1) for _ in range(He + 1)]
    end = [[L] * (L + 1) for _ in range(He + 1)]
    for h in range(He - 1, -1, -1):
        for s in range(h, L):  # at-least-one: iteration h is opened by layer s >= h
            if h == He - 1:
                cost[h][s] = max(0.0, seg.finish(s, L) - B)
                continue
            best, best_e = math.inf, L
            e = s + 1
            while True:
                cur = max(0.0, seg.finish(s, e) - B)
                if cur >= best:
                    break  # prune: taking more layers never lowers this iteration's wait
                if e == L:
                    best, best_e = cur, L
                    break
                if seg.finish(s, e + 1) <= B:  # optimal hiding: the next layer hides here too
                    e += 1
                    continue
                total = cur + cost[h + 1][e]  # delayed assignment: close here, the rest starts iteration h+1
                if total < best:
                    best, best_e = total, e
                e += 1
            cost[h][s], end[h][s] = best, best_e
    out = []
    s, h = 0, 0
    while s < L:
        e = end[h][s]
        out.append((s, e))
        s, h = e, h + 1
    return out
