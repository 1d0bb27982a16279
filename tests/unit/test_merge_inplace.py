"""The in-place host merge and outer step give, bit for bit, what the formulas with temporaries gave.

Members of different versions must agree to the last bit (a merge without local progress is exactly the
mean everywhere; the outer weights' digest decides whether a check passes), so these compare bit patterns,
which also tells +0.0 from -0.0.
"""

from __future__ import annotations

import pytest
import torch
import xxhash
from torch import nn

from dreamp2p.sync.model.layers import FlatGroup, discover_layers
from dreamp2p.sync.strategies.outer import OuterWeights, anchor_check_vector


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.int32)


def _params(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ps = [torch.randn(shape, generator=g) * scale for shape, scale in (((33, 7), 1.0), ((1,), 1e-30), ((4096,), 1e4))]
    ps[0][0, :3] = torch.tensor([0.0, -0.0, 1e-45])  # signed zeros and a denormal
    return ps


@pytest.mark.parametrize("progress", [0.0, 0.125, -3.5e-8])
@pytest.mark.parametrize("mean", ["linspace", "snap", "negzero"])
def test_fp32_merge_matches_avg_plus_progress(progress: float, mean: str) -> None:
    params = _params(1)
    group = FlatGroup(params)
    group.snapshot()
    if mean == "linspace":
        group.work.copy_(torch.linspace(-3.0, 3.0, group.numel))
    elif mean == "snap":
        group.work.copy_(group.snap)
    else:
        group.work.fill_(-0.0)
    if progress:
        for p in params:
            p.add_(progress)
    want, offset = [], 0
    for p in params:
        n = p.numel()
        avg, snap = group.work[offset : offset + n].view(p.shape), group.snap[offset : offset + n].view(p.shape)
        want.append(avg + (p - snap))
        offset += n
    group.merge()
    for p, w in zip(params, want, strict=True):
        assert torch.equal(_bits(p), _bits(w))
    if not progress:  # no local progress: the mean's values (a -0.0 in it comes back +0.0, as it always did)
        assert torch.equal(torch.cat([p.reshape(-1) for p in params]), group.work)


def test_merge_keeps_parameter_identity_and_rounds_integer_tensors() -> None:
    weight = nn.Parameter(torch.randn(5, 3))
    counts = torch.tensor([3, 7], dtype=torch.int64)
    group = FlatGroup([weight, counts])
    group.snapshot()
    group.work.copy_(torch.arange(17, dtype=torch.float32) + 0.6)  # counts get 15.6 and 16.6
    ref = weight.data_ptr()
    group.merge()
    assert weight.data_ptr() == ref and weight.requires_grad  # the optimizer still holds the same tensor
    assert counts.tolist() == [16, 17]  # rounded, not truncated


def _reference_outer(theta: torch.Tensor, mom: torch.Tensor, a: torch.Tensor, lr: float, mu: float) -> None:
    """The outer step as written before it reused the mean as scratch (pseudo-gradient syncs)."""
    g = a.clone()
    mom.mul_(mu).add_(g)
    theta.sub_(g.add_(mom, alpha=mu), alpha=lr)
    a.copy_(theta)


@pytest.mark.parametrize(("lr", "mu"), [(1.0, 0.0), (1.0, 0.5), (0.7, 0.9)])
def test_outer_step_on_pseudo_gradients_matches_the_reference(lr: float, mu: float) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.LayerNorm(5), nn.Linear(5, 2))
    layers = discover_layers(model)
    weights = OuterWeights(layers, lr, mu)
    weights.start()
    every = tuple(range(len(layers)))
    ref = [(weights.theta(li).clone(), torch.zeros_like(weights.theta(li))) for li in every]
    for _ in range(3):  # momentum builds up over landings
        mean = torch.randn(sum(layer.numel for layer in layers))
        want = mean.clone()
        offset = 0
        for theta, mom in ref:
            n = theta.numel()
            _reference_outer(theta, mom, want[offset : offset + n], lr, mu)
            offset += n
        assert weights.land(mean, every, anchor=False, verdict="agree")
        assert torch.equal(_bits(mean), _bits(want))  # the new theta, written into the mean
        for li, (theta, _) in zip(every, ref, strict=True):
            assert torch.equal(_bits(weights.theta(li)), _bits(theta))
    out = torch.empty(sum(layer.numel for layer in layers))
    weights.copy_theta(every, out)
    assert torch.equal(out, torch.cat([theta for theta, _ in ref]))
    # the check's digest is over the same bytes as before (members of older versions still agree)
    digest = xxhash.xxh3_64()
    for theta, mom in ref:
        digest.update(theta.numpy().tobytes())
        digest.update(mom.numpy().tobytes())
    assert torch.equal(weights.check_vector(every), anchor_check_vector(False, digest.intdigest()))
