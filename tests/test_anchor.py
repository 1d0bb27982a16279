"""DreamDDP's anchor check: the reset decision every member derives alike from the averaged check vector."""

from __future__ import annotations

import pytest
import torch

from dreamp2p.sync.config import SyncConfig
from dreamp2p.sync.dreamddp import DIGEST_BITS, anchor_check_vector, anchor_verdict


def _mean(*vectors: torch.Tensor) -> torch.Tensor:
    return torch.stack(vectors).mean(0)


@pytest.mark.parametrize("world", [1, 2, 3, 5, 8])
def test_equal_digests_agree(world: int) -> None:
    vec = anchor_check_vector(False, 0xDEADBEEF)
    assert anchor_verdict(_mean(*[vec] * world)) == "agree"


@pytest.mark.parametrize("world", [2, 3, 5, 8])
@pytest.mark.parametrize("bit", [0, 7, DIGEST_BITS - 1])
def test_one_member_differing_in_one_bit_is_seen(world: int, bit: int) -> None:
    base = 0x1234
    vectors = [anchor_check_vector(False, base)] * (world - 1) + [anchor_check_vector(False, base ^ (1 << bit))]
    assert anchor_verdict(_mean(*vectors)) == "differ"


@pytest.mark.parametrize("world", [1, 2, 3])
def test_a_fresh_member_asks_for_a_reset(world: int) -> None:
    vectors = [anchor_check_vector(False, 5)] * (world - 1) + [anchor_check_vector(True, 5)]
    assert anchor_verdict(_mean(*vectors)) == "fresh"


def test_only_the_low_bits_travel() -> None:
    # digests equal in their low DIGEST_BITS bits look alike (a 1 in 65536 chance for unrelated thetas)
    assert anchor_verdict(_mean(anchor_check_vector(False, 1), anchor_check_vector(False, 1 + (1 << 40)))) == "agree"
    assert anchor_check_vector(False, 0).shape == (1 + DIGEST_BITS,)


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ({"anchor_every": 0}, "anchor_every"),
        ({"delta_codec": "int3"}, "delta_codec"),
        ({"group_outer_lr": 0.0}, "group_outer_lr"),
        ({"group_outer_momentum": 1.0}, "group_outer_momentum"),
    ],
)
def test_bad_anchor_settings_are_refused(bad: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SyncConfig(**bad)  # type: ignore[arg-type]


@pytest.mark.parametrize(("adaptive", "expected"), [(True, (0.7, 0.9)), (False, (1.0, 0.0))])
def test_group_outer_defaults_follow_the_inner_optimizer(adaptive: bool, expected: tuple[float, float]) -> None:
    assert SyncConfig().with_outer_defaults(adaptive).group_outer == expected
    assert SyncConfig(group_outer_lr=0.5).with_outer_defaults(adaptive).group_outer == (0.5, expected[1])
    with pytest.raises(ValueError, match="unresolved"):
        _ = SyncConfig().group_outer
