"""Group ids of every collective the strategies run, made in one place.

A peer keys rounds, frames and votes by (group id, round id), and round counters run per group id, so
two different uses must never share a group id. Whole-model rounds have fixed ids; fragments and plan
layer syncs get ranges. (The peer marks a round's retry by setting bit 31 of its group id, see
`dreamp2p.peer.RETRY_GROUP_BIT`: every id here stays below it.)
"""

from __future__ import annotations

GROUP_INIT = 1  # rank 0's state broadcast at attach
GROUP_GRADS = 2  # S-SGD gradients
GROUP_PARAMS = 3  # whole-model averages (local SGD, DiLoCo, CO2)
GROUP_BUFFERS = 4  # BatchNorm statistics and other buffers
GROUP_FLUSH = 5  # Strategy.flush()
GROUP_CO2_GAP = 6  # CO2's staleness gap, beside its parameters
GROUP_TOKENS = 7  # time-paced periods: each member's share of the period's steps, beside its pseudo-gradients
GROUP_AGREE = 8  # whether every member already holds the same state at attach: 64 digest bits
GROUP_FLUSH_CHECK = 10  # the same check within flush(), before a part of the state is averaged in fp32
GROUP_FLUSH_DELTA = 11  # DreamDDP's flush: every layer's pseudo-gradient at once, in its delta codec
GROUP_FLUSH_THETA = 12  # ... and the check of every layer's outer weights beside it
GROUP_CONTROL = 9  # DreamDDP's control round (link and profile gather)
GROUP_OUTER_CHECK = 20  # DiLoCo's and CO2's check of the members' outer state (17 floats, `sync.strategies.outercheck`)
GROUP_OUTER_HEAL = 21  # ... and the fp32 average of it where the check found the members apart
GROUP_FRAGMENT_BASE = 100  # Streaming DiLoCo fragment p: base + p (its checks and heals: + MAX_FRAGMENTS, + 2x)
GROUP_PLAN_BASE = 1_000_000  # DreamDDP plan v's sync i: base + v * SYNCS_PER_PLAN + i
# A plan syncs at most MAX_PLAN_SYNCS groups (a model with that many parameter-owning modules and every
# one its own all-reduce). Each sync's anchors (parameter averages) and their checks take the second and
# third part of the plan's range: a parameter average is not a pseudo-gradient round, and the peer keeps
# per group id what must not mix between the two (the contribution guard's running norm).
MAX_PLAN_SYNCS = 1 << 13
SYNCS_PER_PLAN = 3 * MAX_PLAN_SYNCS
ANCHOR_OFFSET = MAX_PLAN_SYNCS  # a sync's anchor rounds: its group id + this
ANCHOR_CHECK_OFFSET = 2 * MAX_PLAN_SYNCS  # an anchor's check round: its sync's group id + this
# every group id stays below the peer's retry bit (bit 31)
MAX_PLAN_VERSION = ((1 << 31) - GROUP_PLAN_BASE) // SYNCS_PER_PLAN - 1
MAX_FRAGMENTS = (GROUP_PLAN_BASE - GROUP_FRAGMENT_BASE) // 3


def fragment_group(fragment: int) -> int:
    if not 0 <= fragment < MAX_FRAGMENTS:
        raise ValueError(f"fragment {fragment} outside 0..{MAX_FRAGMENTS - 1}")
    return GROUP_FRAGMENT_BASE + fragment


def fragment_check_group(fragment: int) -> int:
    """Group id of the checks of fragment ``fragment``'s outer state (`dreamp2p.sync.strategies.outercheck`)."""
    return fragment_group(fragment) + MAX_FRAGMENTS


def fragment_heal_group(fragment: int) -> int:
    """Group id of the averages that heal fragment ``fragment``'s outer state where a check found it apart."""
    return fragment_group(fragment) + 2 * MAX_FRAGMENTS


def plan_sync_group(plan_version: int, index: int) -> int:
    """Group id of sync ``index`` of plan ``plan_version``; ValueError outside the ranges that keep ids unique."""
    if not 0 <= index < MAX_PLAN_SYNCS:
        raise ValueError(f"a plan syncs at most {MAX_PLAN_SYNCS} groups; sync index {index} is outside")
    if not 0 <= plan_version <= MAX_PLAN_VERSION:
        raise ValueError(f"plan version {plan_version} outside 0..{MAX_PLAN_VERSION}")
    return GROUP_PLAN_BASE + plan_version * SYNCS_PER_PLAN + index


def anchor_group(sync_group: int) -> int:
    """Group id of the parameter averages (anchors) of the sync whose pseudo-gradients use ``sync_group``."""
    return sync_group + ANCHOR_OFFSET


def anchor_check_group(sync_group: int) -> int:
    """Group id of the outer-weight checks that go with the anchors of ``sync_group``."""
    return sync_group + ANCHOR_CHECK_OFFSET
