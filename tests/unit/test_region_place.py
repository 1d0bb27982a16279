"""A `dreamp2p node` under torchrun: its place in the region and its own daemon settings (pure, no process group)."""

from __future__ import annotations

import pytest

from dreamp2p.config import DaemonConfig
from dreamp2p.service.region import (
    RankPlace,
    data_position,
    elastic_restart,
    rank_daemon_config,
    rank_device,
    restart_store,
    torchrun_place,
)


@pytest.mark.parametrize(
    ("env", "want"),
    [
        ({}, None),
        ({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}, None),  # a one-rank job is a one-process region
        ({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"}, RankPlace(1, 2, 1)),
        ({"RANK": "3", "WORLD_SIZE": "4"}, RankPlace(3, 4, 3)),
    ],
)
def test_torchrun_place(env: dict[str, str], want: RankPlace | None) -> None:
    assert torchrun_place(env) == want


@pytest.mark.parametrize(
    "env",
    [
        {"RANK": "2", "WORLD_SIZE": "2"},
        {"RANK": "x", "WORLD_SIZE": "2"},
        {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "-1"},
    ],
)
def test_torchrun_place_refuses_nonsense(env: dict[str, str]) -> None:
    with pytest.raises(ValueError):
        torchrun_place(env)


@pytest.mark.parametrize(("device", "want"), [("cuda", "cuda:3"), ("cpu", "cpu"), ("cuda:1", "cuda:1")])
def test_rank_device_takes_the_local_rank_s_gpu(device: str, want: str) -> None:
    assert rank_device(device, RankPlace(1, 4, 3)) == want


@pytest.mark.parametrize(
    ("region", "regions", "place", "want"),
    [
        (1, 3, None, (1, 3)),
        (0, 2, RankPlace(1, 2, 1), (1, 4)),
        (1, 2, RankPlace(0, 2, 0), (2, 4)),
        (2, 3, RankPlace(3, 4, 3), (11, 12)),
    ],
)
def test_data_position_is_unique_per_rank(
    region: int, regions: int, place: RankPlace | None, want: tuple[int, int]
) -> None:
    assert data_position(region, regions, place) == want


def _daemon(**tables: dict[str, object]) -> DaemonConfig:
    return DaemonConfig.from_dict({"node": {"node_id": "eu", "listen": "127.0.0.1:7000"}, **tables})


def test_rank_daemon_config_gives_each_rank_its_metrics_port_and_the_region_one_checkpoint_folder() -> None:
    cfg = rank_daemon_config(
        _daemon(metrics={"listen": "127.0.0.1:9100"}, checkpoint={"dir": "ck"}), RankPlace(2, 4, 2), False, False
    )
    assert cfg.metrics.listen == "127.0.0.1:9102"
    assert cfg.checkpoint.dir == "ck"  # the region's: local rank 0 writes it, every rank resumes from it
    # a region spanning hosts: rank 3 of the region is rank 1 on its host, whose ports it shares with rank 2
    spanning = rank_daemon_config(_daemon(metrics={"listen": "127.0.0.1:9100"}), RankPlace(3, 4, 1), False, False)
    assert spanning.metrics.listen == "127.0.0.1:9101"
    assert cfg.node.node_id == "eu"  # the node itself derives its rank's peer settings (sync.shards.rank_config)


@pytest.mark.parametrize(("resume", "join"), [(True, False), (False, True)])
def test_a_region_of_many_ranks_resumes_and_joins(resume: bool, join: bool) -> None:
    assert rank_daemon_config(_daemon(), RankPlace(1, 2, 1), resume, join).node.node_id == "eu"


@pytest.mark.parametrize(
    ("env", "want"),
    [
        ({}, False),  # not under torchrun
        ({"TORCHELASTIC_RESTART_COUNT": "0"}, False),  # the first attempt
        ({"TORCHELASTIC_RESTART_COUNT": "2"}, True),  # torchrun restarted the region after a rank died
    ],
)
def test_elastic_restart(env: dict[str, str], want: bool) -> None:
    assert elastic_restart(env) is want
    assert want or restart_store(env) is None  # the first attempt keeps torchrun's own store


def test_elastic_restart_refuses_a_bad_count() -> None:
    with pytest.raises(ValueError, match="TORCHELASTIC_RESTART_COUNT"):
        elastic_restart({"TORCHELASTIC_RESTART_COUNT": "x"})
