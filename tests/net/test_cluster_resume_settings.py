"""A whole-cluster resume under settings changed since the checkpoint, through `Checkpointer` (the daemon's own
resume code) with two members on loopback, each in a thread of its own: a changed period or codec is adopted
and logged on every member, which then train together under it; a changed strategy is refused on every
member with CONFIG_MISMATCH naming it and both values, each from its own checkpoint and config, before it
connects to anyone. The rule itself, for every strategy: tests/unit/test_resume_settings.py."""

from __future__ import annotations

import concurrent.futures
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from dreamp2p.config import PeerConfig, PeerInfo, TransportConfig
from dreamp2p.devtools.localrun import free_ports
from dreamp2p.errors import PeerError, Status
from dreamp2p.node import Node
from dreamp2p.service.lifecycle import Checkpointer

SYNC = {"strategy": "dreamddp", "period": 4, "max_delay": 2, "warmup_steps": 2, "control_every": 4, "codec": "fp32"}
STEPS = 8  # the first run's, all of them checkpointed at its end
IDS = ("eu", "us")


@dataclass
class Outcome:
    start: int
    resumed_from: Path | None
    adopted: list[tuple[str, str, str]]
    period: int
    plan_digest: int


def configs(connect_timeout_s: float = 30.0) -> list[PeerConfig]:
    ring = tuple(PeerInfo(node, f"127.0.0.1:{port}") for node, port in zip(IDS, free_ports(len(IDS)), strict=True))
    transport = TransportConfig(connect_timeout_s=connect_timeout_s, round_timeout_s=20.0)
    return [
        PeerConfig(node_id=p.node_id, cluster_id="resume", listen=p.address, ring=ring, transport=transport)
        for p in ring
    ]


def member(config: PeerConfig, directory: Path, steps: int, sync: dict[str, Any]) -> Outcome:
    """One member's library loop: attach (fresh, or resumed by the agreement), ``steps`` steps, finish."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))
    node = Node(config)
    try:
        with Checkpointer(node, directory, every_steps=1000, signals=False) as ckpt:
            s = ckpt.attach(model, torch.optim.SGD(model.parameters(), lr=0.05), **sync)
            start = s.step_count
            for _ in range(steps):
                x = torch.randn(8, 6, generator=torch.Generator().manual_seed(s.step_count))
                nn.functional.mse_loss(model(x), torch.sin(x[:, :3])).backward()
                s.step()
                s.zero_grad()
            ckpt.finish()
            plan = s.plan  # type: ignore[attr-defined]
            return Outcome(start, ckpt.resumed_from, s.adopted, plan.period, plan.digest())
    finally:
        node.close()


def cluster(dirs: list[Path], steps: int, sync: dict[str, Any]) -> list[concurrent.futures.Future[Outcome]]:
    """Every member at once, each with its own checkpoint directory; their outcomes (or errors)."""
    with concurrent.futures.ThreadPoolExecutor(len(IDS)) as pool:
        futures = [pool.submit(member, c, d, steps, sync) for c, d in zip(configs(), dirs, strict=True)]
        concurrent.futures.wait(futures)
    return futures


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """The checkpoint directories of a first run under SYNC, ended at step STEPS."""
    dirs = [tmp_path_factory.mktemp("first") / node for node in IDS]
    outcomes = [f.result() for f in cluster(dirs, STEPS, SYNC)]
    assert [(o.start, o.period) for o in outcomes] == [(0, 4)] * 2
    return dirs


def copied(trained: list[Path], tmp_path: Path) -> list[Path]:
    return [Path(shutil.copytree(d, tmp_path / d.name)) for d in trained]


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    ("changed", "adopted"),
    [({"period": 8}, ("sync.period", "4", "8")), ({"codec": "fp16"}, ("sync.codec", "fp32", "fp16"))],
    ids=["period", "codec"],
)
def test_a_changed_period_or_codec_is_adopted_and_logged_on_every_member(
    trained: list[Path],
    tmp_path: Path,
    changed: dict[str, Any],
    adopted: tuple[str, str, str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    dirs = copied(trained, tmp_path)
    with caplog.at_level(logging.INFO, logger="dreamp2p.sync.strategies.base"):
        outcomes = [f.result() for f in cluster(dirs, 6, {**SYNC, **changed})]
    assert [(o.start, o.resumed_from) for o in outcomes] == [(STEPS, d / f"ckpt-{STEPS:010d}.pt") for d in dirs]
    assert [o.adopted for o in outcomes] == [[adopted]] * 2
    name, old, new = adopted
    said = f"resume: {name} {old} -> {new} (config changed since the checkpoint)"
    assert [r.getMessage() for r in caplog.records].count(said) == 2
    period = changed.get("period", SYNC["period"])
    assert [o.period for o in outcomes] == [period] * 2
    assert outcomes[0].plan_digest == outcomes[1].plan_digest  # the same plan on both, after 6 steps together


@pytest.mark.timeout(180)
def test_a_changed_strategy_is_refused_on_every_member_naming_it_and_both_values(
    trained: list[Path], tmp_path: Path
) -> None:
    """The user's report: one member refused clearly, the other waited 30 s and ended on TIMEOUT."""
    dirs = copied(trained, tmp_path)
    futures = cluster(dirs, 6, {**SYNC, "strategy": "localsgd"})
    for f, d in zip(futures, dirs, strict=True):
        err = f.exception()
        assert isinstance(err, PeerError), err
        assert err.status == Status.CONFIG_MISMATCH
        assert f"sync.strategy: dreamddp in {d / f'ckpt-{STEPS:010d}.pt'}, localsgd in the config" in err.detail
        assert "without --resume" in err.detail


@pytest.mark.timeout(180)
def test_a_changed_strategy_is_refused_before_waiting_for_any_member(trained: list[Path], tmp_path: Path) -> None:
    """Alone, its other member never started: the refusal needs no one, so it is CONFIG_MISMATCH, not the
    connect timeout that waiting for the member would end on."""
    (directory,) = copied(trained[:1], tmp_path)
    with pytest.raises(PeerError) as info:
        member(configs(connect_timeout_s=60.0)[0], directory, 1, {**SYNC, "strategy": "localsgd"})
    assert info.value.status == Status.CONFIG_MISMATCH and "sync.strategy" in info.value.detail
