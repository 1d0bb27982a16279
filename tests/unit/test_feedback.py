"""Error-feedback residuals of the compressed ring: drafted per round, kept only when the round commits."""

from __future__ import annotations

import pytest
import torch

from dreamp2p.collective.feedback import GATHER, REDUCE, GroupFeedback
from dreamp2p.compression import get_codec


def test_a_committed_round_carries_what_the_encode_lost_into_the_next() -> None:
    group = GroupFeedback()
    rnd = group.begin(("view", 0), 8)
    x = torch.linspace(-1, 1, 8)
    sent = rnd.compensate(REDUCE, 0, x)
    assert torch.equal(sent, x)  # nothing carried yet
    decoded = torch.round(sent * 2) / 2  # a coarse "codec"
    rnd.keep(REDUCE, 0, sent, decoded)
    rnd.commit()
    nxt = group.begin(("view", 0), 8)
    assert torch.allclose(nxt.compensate(REDUCE, 0, torch.zeros(8)), x - decoded)
    assert torch.equal(nxt.compensate(GATHER, 0, torch.zeros(8)), torch.zeros(8))  # the other encode: apart


def test_a_round_that_is_not_committed_changes_nothing() -> None:
    group = GroupFeedback()
    rnd = group.begin("layout", 4)
    rnd.keep(GATHER, 0, torch.ones(4), torch.zeros(4))  # drafted, then the round failed
    assert group.residual_norm() == 0.0
    assert torch.equal(group.begin("layout", 4).compensate(GATHER, 0, torch.zeros(4)), torch.zeros(4))


@pytest.mark.parametrize(("layout", "numel"), [("other members", 4), ("layout", 6)])
def test_a_new_layout_starts_from_zero(layout: str, numel: int) -> None:
    group = GroupFeedback()
    rnd = group.begin("layout", 4)
    rnd.keep(REDUCE, 0, torch.ones(4), torch.zeros(4))
    rnd.commit()
    assert group.residual_norm() > 0
    fresh = group.begin(layout, numel)
    assert torch.equal(fresh.compensate(REDUCE, 0, torch.zeros(numel)), torch.zeros(numel))


def test_slices_land_where_their_elements_are() -> None:
    group = GroupFeedback()
    rnd = group.begin("l", 10)
    rnd.keep(REDUCE, 6, torch.full((3,), 2.0), torch.full((3,), 1.5))
    rnd.commit()
    carried = group.begin("l", 10).compensate(REDUCE, 0, torch.zeros(10))
    assert carried.tolist() == [0, 0, 0, 0, 0, 0, 0.5, 0.5, 0.5, 0]


@pytest.mark.parametrize("codec", ["int4", "e3m0", "int8", "topk"])
def test_with_feedback_the_running_sum_of_decoded_values_tracks_the_true_sum(codec: str) -> None:
    """The property the ring relies on, for one encoder: sum(decoded) = sum(true) - residual, so the error
    stays within one quantization step (for topk: within what the selection has not reached yet) however
    many rounds pass; without feedback it keeps growing."""
    cod = get_codec(codec)
    torch.manual_seed(0)
    increments = [torch.randn(4096) * 0.01 + 0.003 for _ in range(50)]
    group = GroupFeedback()
    with_fb = torch.zeros(4096)
    without = torch.zeros(4096)
    for x in increments:
        rnd = group.begin("l", 4096)
        sent = rnd.compensate(REDUCE, 0, x)
        decoded = cod.decode(cod.encode(sent), 4096)
        rnd.keep(REDUCE, 0, sent, decoded)
        rnd.commit()
        with_fb += decoded
        without += cod.decode(cod.encode(x), 4096)
    true = torch.stack(increments).sum(0)
    err_fb = float((with_fb - true).abs().mean())
    err_plain = float((without - true).abs().mean())
    assert torch.allclose(with_fb + group.begin("l", 4096).compensate(REDUCE, 0, torch.zeros(4096)), true, atol=1e-5)
    assert err_fb < 0.5 * err_plain, (err_fb, err_plain)
