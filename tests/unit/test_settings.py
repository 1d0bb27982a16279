"""Pure pieces of issue 15: settings comparison, outer-optimizer defaults, config errors, integer buffers."""

from __future__ import annotations

import pytest
import torch

from dreamp2p.config.sync import ADAPTIVE_OUTER, PLAIN_OUTER, SyncConfig
from dreamp2p.settings import MAX_NAMED, settings_mismatch
from dreamp2p.sync.model.agreement import inner_momentum, is_adaptive, model_settings, training_settings
from dreamp2p.sync.model.layers import FlatGroup


@pytest.mark.parametrize(
    ("mine", "theirs", "expected"),
    [
        ({}, {"a": "1"}, None),  # the other side has not declared yet
        ({"a": "1"}, {}, None),
        ({"a": "1", "b": "x"}, {"b": "x", "a": "1"}, None),
        ({"a": "1"}, {"a": "2"}, ["a: 1 on A, 2 on B"]),
        ({"a": "1"}, {"a": "1", "c": "3"}, ["c: unset on A, 3 on B"]),
        ({"a": "1", "b": "2"}, {"a": "9", "b": "8"}, ["a: 1 on A, 9 on B", "b: 2 on A, 8 on B"]),
    ],
)
def test_settings_mismatch_names_each_difference(
    mine: dict[str, str], theirs: dict[str, str], expected: list[str] | None
) -> None:
    got = settings_mismatch(mine, theirs, "A", "B")
    if expected is None:
        assert got is None
    else:
        assert got is not None
        for part in expected:
            assert part in got


def test_settings_mismatch_caps_the_list() -> None:
    mine = {f"k{i}": "1" for i in range(MAX_NAMED + 3)}
    theirs = {k: "2" for k in mine}
    got = settings_mismatch(mine, theirs)
    assert got is not None and got.endswith("and 3 more")


@pytest.mark.parametrize(
    ("optimizer", "adaptive", "momentum"),
    [
        (lambda p: torch.optim.SGD(p, lr=0.1), False, 0.0),
        (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), False, 0.9),
        (lambda p: torch.optim.AdamW(p, lr=1e-3), True, 0.0),
        (lambda p: torch.optim.Adam(p, lr=1e-3), True, 0.0),
        (lambda p: torch.optim.RMSprop(p, lr=1e-3, momentum=0.5), True, 0.5),
    ],
)
def test_outer_defaults_follow_the_inner_optimizer(optimizer: object, adaptive: bool, momentum: float) -> None:
    opt = optimizer([torch.nn.Parameter(torch.zeros(2))])  # type: ignore[operator]
    assert is_adaptive(opt) == adaptive
    assert inner_momentum(opt) == momentum
    cfg = SyncConfig(strategy="diloco").with_outer_defaults(is_adaptive(opt))
    assert cfg.outer == (ADAPTIVE_OUTER if adaptive else PLAIN_OUTER)


def test_explicit_outer_settings_win_and_unresolved_ones_are_refused() -> None:
    cfg = SyncConfig(strategy="diloco", outer_lr=0.5).with_outer_defaults(adaptive_inner=True)
    assert cfg.outer == (0.5, ADAPTIVE_OUTER[1])
    with pytest.raises(ValueError, match="unresolved"):
        _ = SyncConfig().outer


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"round_timeout_s": 30}, r"node\.transport\] round_timeout_s"),
        ({"buffers": "sum"}, "sync.buffers must be one of average, broadcast"),
        ({"outer_momentum": 1.0}, r"sync.outer_momentum must be in \[0, 1\)"),
        ({"outer_lr": 0}, "sync.outer_lr and sync.co2_lr must be > 0"),
    ],
)
def test_sync_config_errors(data: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SyncConfig.from_dict(data)


def test_training_settings_cover_sync_and_model_layout() -> None:
    a = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    b = torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.BatchNorm1d(5))
    sa = training_settings(SyncConfig(period=5), a)
    sb = training_settings(SyncConfig(period=10), b)
    assert sa["sync.period"] == "5" and sb["sync.period"] == "10"
    assert sa["model.manifest"] != sb["model.manifest"]
    a[0].weight.requires_grad_(False)
    assert model_settings(a)["model.frozen_elements"] == "16"
    assert model_settings(a)["model.buffer_elements"] == str(4 + 4 + 1)


def test_flat_group_rounds_integer_and_bool_tensors_back() -> None:
    counts = torch.tensor([3, 7], dtype=torch.int64)
    flags = torch.tensor([True, False])
    group = FlatGroup([counts, flags])
    group.snapshot()
    # a mean that is a hair below the integer, as the broadcast trick (N x value / N) can produce
    group.work.copy_(torch.tensor([2.9999998, 7.0000005, 0.9999999, 1e-7]))
    group.write(group.work)
    assert counts.tolist() == [3, 7]
    assert flags.tolist() == [True, False]
