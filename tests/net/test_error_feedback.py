"""Error feedback through the real ring: 3 peers on loopback averaging increments in 4 or 2 bits, or sparse."""

from __future__ import annotations

import asyncio

import pytest
import torch
from conftest import ring_configs, running_ring

from dreamp2p.config import TransportConfig
from dreamp2p.errors import RoundFailed

FAST = TransportConfig(probe_interval_s=3600.0, chunk_min_bytes=4096, chunk_max_bytes=16384)
N = 20_000


def increments(rounds: int, rank: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(rank)
    return [torch.randn(N, generator=g) * 0.01 + 0.002 * (rank + 1) for _ in range(rounds)]


async def run(feedback: bool, rounds: int = 30, codec: str = "int4") -> tuple[float, list[torch.Tensor]]:
    """Mean |sum of applied means - sum of true means| after ``rounds`` rounds, and each member's sum."""
    data = [increments(rounds, r) for r in range(3)]
    applied = [torch.zeros(N) for _ in range(3)]
    async with running_ring(ring_configs(3, transport=FAST)) as peers:
        for k in range(rounds):
            outs = [torch.empty(N) for _ in range(3)]
            await asyncio.gather(
                *(
                    p.allreduce([data[r][k]], group_id=7, codec=codec, out=[outs[r]], error_feedback=feedback)
                    for r, p in enumerate(peers)
                )
            )
            for r in range(3):
                applied[r] += outs[r]
    true = sum(torch.stack(d).sum(0) for d in data) / 3
    return float((applied[0] - true).abs().mean()), applied


# topk sends 2% of each block per encode, so it needs more rounds than int4 before the residuals, not the
# truth, are what is left: each element reaches the top once its carried sum is large enough.
@pytest.mark.parametrize(("codec", "rounds", "ratio"), [("int4", 30, 0.5), ("int2", 30, 0.5), ("topk", 100, 0.4)])
async def test_feedback_keeps_the_applied_sum_on_the_true_sum_and_members_identical(
    codec: str, rounds: int, ratio: float
) -> None:
    err_fb, applied_fb = await run(True, rounds, codec)
    err_plain, applied_plain = await run(False, rounds, codec)
    # every member applied exactly the same values in both modes (each segment's mean is encoded once)
    assert all(torch.equal(applied_fb[0], a) for a in applied_fb[1:])
    assert all(torch.equal(applied_plain[0], a) for a in applied_plain[1:])
    # without feedback the rounding errors (for topk: the unsent 98%) pile up; with it they stay bounded
    assert err_fb < ratio * err_plain, (err_fb, err_plain)


async def test_a_failed_round_leaves_the_residuals_as_they_were() -> None:
    async with running_ring(ring_configs(3, transport=TransportConfig(probe_interval_s=3600.0))) as peers:
        x = [torch.randn(N) * 0.01 for _ in range(3)]
        await asyncio.gather(
            *(p.allreduce([x[r]], group_id=9, codec="int4", error_feedback=True) for r, p in enumerate(peers))
        )
        before = [p.feedback_norm(9) for p in peers]
        assert all(b > 0 for b in before)
        # p2 never joins this round: it fails everywhere, its drafts are dropped
        with pytest.raises(RoundFailed):
            await asyncio.gather(
                *(
                    p.allreduce([x[r]], group_id=9, codec="int4", error_feedback=True, timeout=1.0)
                    for r, p in enumerate(peers[:2])
                )
            )
        assert [p.feedback_norm(9) for p in peers] == before


async def test_residuals_of_plans_before_the_last_two_are_dropped() -> None:
    """A new plan's syncs are new groups: residuals of older plans would never be continued, so a round of
    plan v keeps only those of v and v - 1 (else each re-plan would keep a model's worth of them)."""
    async with running_ring(ring_configs(3, transport=TransportConfig(probe_interval_s=3600.0))) as peers:
        x = [torch.randn(N) * 0.01 for _ in range(3)]
        for version, group in ((1, 11), (2, 12), (2, 13), (3, 14)):
            await asyncio.gather(
                *(
                    p.allreduce([x[r]], group_id=group, codec="int2", plan_version=version, error_feedback=True)
                    for r, p in enumerate(peers)
                )
            )
            if version == 2:
                assert all(p.feedback_norm(11) > 0 for p in peers)  # v1 is the one before: kept
        for p in peers:
            assert p.feedback_norm(11) == 0.0
            assert min(p.feedback_norm(g) for g in (12, 13, 14)) > 0
