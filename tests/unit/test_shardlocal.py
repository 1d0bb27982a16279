"""An FSDP2 model seen as this rank's shards (`dreamp2p.sync.model.shardlocal`) and its sharded checkpoints
(`dreamp2p.service.dcp`), on a one-rank gloo group.

One rank holds every shard, so each DTensor's local tensor is the whole parameter; what is checked is that
flat groups, saved state and loads go through the local tensors and put DTensors back where FSDP2 needs
them (a two-rank region, where shards differ, is tests/net/test_regions.py's).
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

from dreamp2p.config.sync import SyncConfig
from dreamp2p.devtools.bench.memory.solo import SoloCollective
from dreamp2p.errors import PeerError, Status
from dreamp2p.service.dcp import ShardedCheckpoints
from dreamp2p.sync.model.layers import FlatGroup, discover_layers
from dreamp2p.sync.model.shardlocal import (
    is_dtensor,
    is_sharded,
    load_model_state,
    load_optimizer_state,
    local_state,
    local_view,
    shard_like,
)
from dreamp2p.sync.strategies.base import Strategy
from dreamp2p.sync.strategies.registry import strategy_class


@pytest.fixture(scope="module")
def one_rank_group() -> Iterator[None]:
    if dist.is_initialized():
        pytest.fail("torch.distributed is initialized already in this test process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def sharded_model(seed: int = 0) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    for layer in list(model.children()):
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    return model


def train(model: nn.Module, opt: torch.optim.Optimizer, steps: int = 2) -> None:
    for step in range(steps):
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(step))
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


def test_a_plain_model_passes_through_unchanged() -> None:
    model = nn.Linear(3, 2)
    assert not is_sharded(model)
    assert local_view(model.weight) is model.weight
    assert shard_like(model.weight, model.bias) is model.bias
    state = {"w": model.weight.detach(), "nested": [1, (torch.ones(2), "x")]}
    out = local_state(state)
    assert out["w"] is not None and torch.equal(out["w"], model.weight)
    assert out["nested"][0] == 1 and out["nested"][1][1] == "x" and isinstance(out["nested"][1], tuple)
    # a module's state_dict keeps its modules' versions (load_state_dict migrates old layouts by them)
    saved = local_state(nn.BatchNorm1d(3).state_dict())
    assert saved._metadata[""]["version"] == nn.BatchNorm1d._version


@pytest.mark.usefixtures("one_rank_group")
def test_flat_groups_read_and_write_the_local_shards() -> None:
    model = sharded_model()
    assert is_sharded(model) and all(is_dtensor(p) for p in model.parameters())
    layers = discover_layers(model)
    group = FlatGroup([p for layer in layers for p in layer.params])
    assert group.numel == sum(local_view(p).numel() for p in model.parameters())
    assert not any(is_dtensor(t) for t in group.params)
    group.snapshot()
    group.write(torch.full_like(group.snap, 0.5))  # written through to the DTensors' storage
    assert all(bool((local_view(p) == 0.5).all()) for p in model.parameters())
    assert sum(layer.numel for layer in layers) == group.numel


@pytest.mark.usefixtures("one_rank_group")
def test_saved_local_state_loads_back_into_dtensors_and_trains_on_alike() -> None:
    source, target = sharded_model(seed=1), sharded_model(seed=2)
    opt_s = torch.optim.AdamW(source.parameters(), lr=1e-2)
    opt_t = torch.optim.AdamW(target.parameters(), lr=1e-2)
    train(source, opt_s)
    # copies, as a checkpoint or a joiner's transfer has (local_state shares the tensors' storage)
    model_state = copy.deepcopy(local_state(source.state_dict()))
    optim_state = copy.deepcopy(local_state(opt_s.state_dict()))
    assert not any(is_dtensor(v) for v in model_state.values())
    assert not any(is_dtensor(v) for per in optim_state["state"].values() for v in per.values())
    # a fresh optimizer (no state yet) gets DTensor moments beside its DTensor parameters
    load_model_state(target, model_state)
    load_optimizer_state(opt_t, optim_state)
    for p in target.parameters():
        assert all(is_dtensor(v) for k, v in opt_t.state[p].items() if k != "step")
    train(source, opt_s)
    train(target, opt_t)  # an optimizer step that mixed tensors and DTensors would raise here
    for a, b in zip(source.parameters(), target.parameters(), strict=True):
        assert torch.equal(local_view(a), local_view(b))


@pytest.mark.usefixtures("one_rank_group")
def test_a_model_state_of_other_keys_or_shapes_is_refused_before_anything_loads() -> None:
    model = sharded_model()
    before = [local_view(p).clone() for p in model.parameters()]
    state = local_state(model.state_dict())
    with pytest.raises(ValueError, match="missing keys"):
        load_model_state(model, {k: v for k, v in state.items() if not k.endswith("bias")})
    wrong = {k: (torch.zeros(5) if k == "2.bias" else torch.zeros_like(v)) for k, v in state.items()}
    with pytest.raises(ValueError, match=r"'2.bias': shape \(5,\)"):
        load_model_state(model, wrong)
    # the check runs before any copy: entries before the bad one were not written either
    assert all(torch.equal(a, local_view(p)) for a, p in zip(before, model.parameters(), strict=True))


def solo_strategy(name: str, model: nn.Module, **settings: Any) -> Strategy:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return strategy_class(name)(model, opt, SoloCollective(), SyncConfig(strategy=name, period=2, **settings))


@pytest.mark.usefixtures("one_rank_group")
def test_a_sharded_checkpoint_round_trips_and_refuses_another_strategy(tmp_path: Path) -> None:
    source = solo_strategy("diloco", sharded_model(seed=3))
    for step in range(3):
        source.model(torch.randn(4, 6, generator=torch.Generator().manual_seed(step))).pow(2).mean().backward()
        source.step()
        source.zero_grad()
    ShardedCheckpoints(source).save(tmp_path / "ck", blocking=True)
    target = solo_strategy("diloco", sharded_model(seed=4))
    assert ShardedCheckpoints(target).load(tmp_path / "ck") == 3 == target.step_count
    for a, b in zip(source.model.parameters(), target.model.parameters(), strict=True):
        assert torch.equal(local_view(a), local_view(b))
    for kind, views in source.outer_shards().items():  # the global copy and outer momentum, exactly
        assert all(torch.equal(x, y) for x, y in zip(views, target.outer_shards()[kind], strict=True)), kind
    other = solo_strategy("localsgd", sharded_model(seed=5))
    before = [local_view(p).clone() for p in other.model.parameters()]
    with pytest.raises(ValueError, match="saved by diloco; this node runs localsgd"):
        ShardedCheckpoints(other).load(tmp_path / "ck")
    assert all(torch.equal(x, local_view(p)) for x, p in zip(before, other.model.parameters(), strict=True))
    with pytest.raises(ValueError, match="not a dreamp2p sharded checkpoint"):
        (tmp_path / "plain").mkdir()
        dcp.save({"x": torch.zeros(2)}, checkpoint_id=str(tmp_path / "plain"))
        ShardedCheckpoints(other).load(tmp_path / "plain")


@pytest.mark.usefixtures("one_rank_group")
def test_a_region_shards_each_transformer_block_then_the_rest() -> None:
    from torch.distributed.fsdp import FSDPModule

    from dreamp2p.service.region import fully_sharded
    from dreamp2p.service.tasks import ByteTransformer

    model = fully_sharded(ByteTransformer(context=8, dim=16, layers=2, heads=2))
    units = {name for name, m in model.named_modules() if isinstance(m, FSDPModule)}
    assert units == {"", "blocks.0", "blocks.1"}  # each block a unit; embeddings, final norm and head in the root's
    assert is_sharded(model)
    # a model without ModuleLists: each child that holds parameters
    mlp = fully_sharded(nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)))
    assert {name for name, m in mlp.named_modules() if isinstance(m, FSDPModule)} == {"", "0", "2"}


@pytest.mark.usefixtures("one_rank_group")
def test_a_sharded_checkpoint_under_a_setting_its_state_is_laid_out_for_is_refused_before_loading(
    tmp_path: Path,
) -> None:
    ShardedCheckpoints(solo_strategy("streaming", sharded_model(seed=6), fragments=2)).save(tmp_path, blocking=True)
    other = solo_strategy("streaming", sharded_model(seed=7), fragments=1)  # per-fragment outer state: fixed
    before = [local_view(p).clone() for p in other.model.parameters()]
    with pytest.raises(PeerError, match=r"sync\.fragments") as refused:
        ShardedCheckpoints(other).load(tmp_path)
    assert refused.value.status == Status.CONFIG_MISMATCH
    assert all(torch.equal(x, local_view(p)) for x, p in zip(before, other.model.parameters(), strict=True))
