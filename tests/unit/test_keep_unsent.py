"""DreamDDP's ``keep_unsent``: what a lossy pseudo-gradient codec did not carry stays in the member's parameters.

The merge writes params <- theta' + (params - snap); `keep_unsent` moves the unsent part u = d - sent(d) of the
pseudo-gradient d = theta - snap into the snapshot, so each replica ends at its own params + sent(d) - mean(sent):
only the carried part is exchanged for the mean, and the replicas' mean is what it was (nothing dropped, as a
reset to theta' would drop 98% of a sparse codec's progress until error feedback resends it).
"""

from __future__ import annotations

import pytest
import torch

from dreamp2p.compression import get_codec
from dreamp2p.config.sync import SyncConfig
from dreamp2p.sync.comm.inprocess import InProcessHub
from dreamp2p.sync.model.groups import GROUP_PLAN_BASE
from dreamp2p.sync.model.layers import FlatGroup
from dreamp2p.sync.strategies.layersync import keep_unsent
from tests.unit.test_strategy_logic import config, digest, each, members, train


@pytest.mark.parametrize(
    ("settings", "plan_codec", "flush"),
    [
        ({"delta_codec": "int4", "keep_unsent": True}, "topk", "int2"),  # a tight link's plan: 2 bits, dense
        ({"delta_codec": "int4", "keep_unsent": True}, "int2", "int2"),
        ({"delta_codec": "int4", "keep_unsent": True}, "int4", "int4"),  # a fast link's plan: delta_codec
        ({"delta_codec": "topk", "keep_unsent": True}, "topk", "int2"),
        ({"delta_codec": "int4", "keep_unsent": True, "error_feedback": True}, "topk", "int4"),
        ({"delta_codec": "topk", "error_feedback": True}, "topk", "topk"),  # error feedback holds the rest instead
        ({"delta_fallbacks": ("int2",), "keep_unsent": False}, "int2", "int4"),
        ({"delta_codec": "int4", "keep_unsent": True, "flush_codec": "int8"}, "topk", "int8"),
        ({"delta_codec": "", "keep_unsent": True}, "", ""),  # no pseudo-gradients: flush() averages in fp32
    ],
)
def test_the_flush_codec_follows_the_plan_and_is_dense_where_unsent_parts_are_kept(
    settings: dict, plan_codec: str, flush: str
) -> None:
    assert SyncConfig(strategy="dreamddp", **settings).flush_delta_codec(plan_codec) == flush


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"delta_codec": "topk", "keep_unsent": False}, r"error_feedback = true \(or sync.keep_unsent = true\)"),
        ({"keep_unsent": False}, r"delta_fallbacks: topk is a sparse codec .*keep_unsent = true"),
        ({"keep_unsent": "yes"}, "keep_unsent must be true or false"),
        ({"flush_codec": "topk"}, "flush_codec must be a dense codec"),
        ({"flush_codec": "zip"}, "flush_codec must be a dense codec"),
    ],
)
def test_keep_unsent_settings_are_checked(settings: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SyncConfig(strategy="dreamddp", **settings)


def _replica(seed: int, theta: torch.Tensor) -> tuple[list[torch.Tensor], FlatGroup]:
    """Parameters that moved from ``theta`` (two tensors), their group snapshotted, and d = theta - snap in work."""
    g = torch.Generator().manual_seed(seed)
    flat = theta + 0.01 * torch.randn(theta.numel(), generator=g)
    params = [flat[:5000].clone().view(50, 100), flat[5000:].clone()]
    group = FlatGroup(params)
    group.snapshot()
    group.work.copy_(theta).sub_(group.snap)
    return params, group


@pytest.mark.parametrize("codec", ["topk", "int2", "int4", "fp32"])
def test_the_unsent_part_moves_into_the_snapshot(codec: str) -> None:
    theta = torch.randn(9000, generator=torch.Generator().manual_seed(0))
    _, group = _replica(1, theta)
    snap, d = group.snap.clone(), group.work.clone()
    keep_unsent(group, codec)
    c = get_codec(codec)
    sent = c.decode(c.encode(d), d.numel())
    torch.testing.assert_close(group.snap - snap, d - sent, rtol=0, atol=1e-6)
    assert torch.equal(group.work, d)  # what the ring sends is untouched
    if codec == "fp32":
        assert torch.equal(group.snap, snap)  # a lossless codec leaves nothing behind, to the bit


@pytest.mark.parametrize("codec", ["topk", "int2"])
@pytest.mark.parametrize("progress", [0.0, 0.003])
def test_replicas_keep_their_mean_and_exchange_only_what_was_sent(codec: str, progress: float) -> None:
    theta = torch.randn(9000, generator=torch.Generator().manual_seed(0))
    replicas = [_replica(seed, theta) for seed in (1, 2, 3)]
    c = get_codec(codec)
    before = torch.stack([torch.cat([p.reshape(-1) for p in params]) for params, _ in replicas])
    sent = []
    for _, group in replicas:
        sent.append(c.decode(c.encode(group.work), group.numel))
        keep_unsent(group, codec)
    mean = torch.stack(sent).mean(0)
    for params, group in replicas:
        for p in params:  # training goes on while the sync travels
            p.add_(progress)
        group.work.copy_(theta - mean)  # the landed sync: theta' = theta - mean(sent) (outer lr 1, momentum 0)
        group.merge()
    after = torch.stack([torch.cat([p.reshape(-1) for p in params]) for params, _ in replicas])
    # each replica: its own parameters (and progress), its sent part exchanged for the mean
    torch.testing.assert_close(after, before + progress + torch.stack(sent) - mean, rtol=0, atol=1e-5)
    # nothing dropped: the replicas' mean moved only by the progress made meanwhile
    torch.testing.assert_close(after.mean(0), before.mean(0) + progress, rtol=0, atol=1e-5)
    # and they came closer where the codec sent something
    assert (after - after.mean(0)).norm() < (before - before.mean(0)).norm()


@pytest.mark.parametrize(
    ("settings", "codec", "keeps"),
    [
        ({"keep_unsent": True}, "topk", True),
        ({"keep_unsent": True}, "int2", True),
        # a 4-bit sync merges as ever: replicas agree after it where nobody trained
        ({"keep_unsent": True}, "int4", False),
        ({"keep_unsent": True, "error_feedback": True}, "topk", False),  # error feedback holds the rest instead
        ({"keep_unsent": False, "delta_fallbacks": ("int2",)}, "int2", False),
        ({}, "int2", True),  # on by default
    ],
)
def test_unsent_parts_are_kept_for_2_bit_and_sparse_codecs_when_asked_unless_error_feedback_is_on(
    settings: dict, codec: str, keeps: bool
) -> None:
    assert SyncConfig(strategy="dreamddp", **settings).keeps_unsent(codec) is keeps


@pytest.mark.parametrize(
    ("settings", "warmup"),
    [
        ({}, "topk"),  # the defaults: ["int2", "topk"], keep_unsent
        # error feedback would reset replicas to 2% of progress
        ({"delta_fallbacks": ("int2", "topk"), "keep_unsent": False, "error_feedback": True}, "int4"),
        ({"delta_fallbacks": ("int2",)}, "int2"),
        ({"delta_fallbacks": ()}, "int4"),
    ],
)
def test_the_first_warm_up_sends_the_last_fallback_only_where_the_parameters_keep_the_rest(
    settings: dict, warmup: str
) -> None:
    """Before the link is measured, 4-bit syncs at 1 Mbit/s held `bench lm` 14.8 s: with keep_unsent the warm-up
    sends the chain's most compressive codec; the fast link's measured plan then sends delta_codec; flush()
    (int4 pseudo-gradients) leaves the replicas identical."""
    hub = InProcessHub(2, goodput_Bps=50e6, rtt_s=0.001)
    strategies = members(hub, config("dreamddp", period=4, max_delay=2, **settings))
    train(strategies, 16)
    codecs = [r.codec for r in hub.rounds if r.group_id >= GROUP_PLAN_BASE and r.elements > 17]
    assert (codecs[0], codecs[-1]) == (warmup, "int4"), codecs
    each(strategies, lambda rank, s: s.flush())
    assert len({digest(s) for s in strategies}) == 1
