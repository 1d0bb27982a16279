"""Streaming DiLoCo fragment schedule: which blocks form each fragment and at which steps each fragment syncs.

Streaming DiLoCo ("Streaming DiLoCo with overlapping communication", arXiv 2501.18512) splits the model's
blocks into ``P`` fragments and staggers their outer synchronizations over the period ``H`` so that some
fragment syncs every ``H / P`` steps and the peak bandwidth drops by ``P``. Fragments are strided (the paper's
fragment 1 is blocks {1, 9, 17} with P = 8) so that every fragment spans the depth of the network.

Step convention: ``step`` counts completed inner steps, so the first call comes with ``step == 1``; step 0
(nothing trained yet) is never due. Fragment ``p`` with offset ``o_p`` (0 <= o_p < H) is due at every step
``t >= 1`` with ``(t - o_p) % H == 0``: offset 0 first syncs after ``H`` steps, exactly like DiLoCo, and every
fragment is due exactly once in any ``H`` consecutive steps. Pure arithmetic.
"""

from __future__ import annotations

from collections.abc import Sequence


def _positive_int(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")


def strided_fragments(num_blocks: int, num_fragments: int) -> list[list[int]]:
    """Fragment ``p`` holds blocks ``p, p + P, p + 2P, ...`` (0-based), for ``P = num_fragments``."""
    _positive_int("num_blocks", num_blocks)
    _positive_int("num_fragments", num_fragments)
    if num_fragments > num_blocks:
        raise ValueError(f"need 1 <= num_fragments <= num_blocks, got {num_fragments} fragments of {num_blocks} blocks")
    return [list(range(p, num_blocks, num_fragments)) for p in range(num_fragments)]


def fragment_offsets(num_fragments: int, H: int) -> list[int]:
    """Sync offset of each fragment: ``floor(p * H / P)``, spread evenly over ``[0, H)``.

    With ``P > H`` several fragments share an offset (they sync together); the schedule stays valid.
    """
    _positive_int("num_fragments", num_fragments)
    _positive_int("H", H)
    return [p * H // num_fragments for p in range(num_fragments)]


def fragments_due(step: int, offsets: Sequence[int], H: int) -> list[int]:
    """Fragments (ascending) whose outer sync is due after completed inner step ``step``."""
    _positive_int("H", H)
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be an int >= 0, got {step!r}")
    for p, off in enumerate(offsets):
        if isinstance(off, bool) or not isinstance(off, int) or not 0 <= off < H:
            raise ValueError(f"offset of fragment {p} must be an int in [0, {H}), got {off!r}")
    if step == 0:
        return []
    return [p for p, off in enumerate(offsets) if (step - off) % H == 0]
