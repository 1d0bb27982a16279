"""`bench lm --slow`: regions of different speeds, made by a duty-cycle throttle on a region's trainer.

A region at speed ``f`` idles ``(1 / f - 1)`` times the CPU time each of its steps kept its trainer busy, so it
steps at ``f`` of its own pace, as a region of slower accelerators (or one sharing its cluster) would; the
ceiling's processes run at the same speeds, so ``compute_utilization`` is then the cluster's throughput
(every region's steps, each step the same tokens) against the sum of the regions' solo speeds. Pure logic.
"""

from __future__ import annotations

from collections.abc import Sequence


def parse_slow(items: Sequence[str], regions: int) -> tuple[float, ...]:
    """``["1=0.5"]`` -> every region's speed (``(1.0, 0.5)`` for 2 regions); ValueError naming a bad item.

    Regions are numbered from 0 as the bench starts them; a speed is in (0, 1]; a region is named once."""
    speeds = [1.0] * regions
    named: set[int] = set()
    for item in items:
        region, eq, factor = item.partition("=")
        try:
            if not eq:
                raise ValueError
            r, f = int(region), float(factor)
        except ValueError:
            raise ValueError(f"--slow {item!r}: expected REGION=FACTOR, e.g. 1=0.5") from None
        if not 0 <= r < regions:
            raise ValueError(f"--slow {item!r}: region must be in 0..{regions - 1}")
        if not 0.0 < f <= 1.0:
            raise ValueError(f"--slow {item!r}: factor must be in (0, 1], got {f:g}")
        if r in named:
            raise ValueError(f"--slow {item!r}: region {r} is named twice")
        named.add(r)
        speeds[r] = f
    return tuple(speeds)


def throttle_s(busy_s: float, speed: float) -> float:
    """Seconds to idle after a step that kept the trainer busy ``busy_s`` so that it runs at ``speed``."""
    if not 0.0 < speed <= 1.0:
        raise ValueError(f"speed must be in (0, 1], got {speed}")
    return max(0.0, busy_s) * (1.0 / speed - 1.0)
