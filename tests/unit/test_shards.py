"""Shard arithmetic of a region of many ranks and each local rank's peer settings (pure, no network)."""

from __future__ import annotations

import pytest

from dreamp2p.config import PeerConfig, PeerInfo
from dreamp2p.sync.comm.shards import rank_config, rank_node_id, shard_bounds, shard_length, shift_port


@pytest.mark.parametrize(
    ("numel", "ranks", "length"),
    [(0, 1, 0), (0, 4, 0), (1, 1, 1), (1, 2, 1), (7, 2, 4), (8, 2, 4), (9, 4, 3), (10, 3, 4), (1000, 8, 125)],
)
def test_shard_length_is_ceil(numel: int, ranks: int, length: int) -> None:
    assert shard_length(numel, ranks) == length


@pytest.mark.parametrize("numel", [0, 1, 2, 3, 5, 16, 17, 1001])
@pytest.mark.parametrize("ranks", [1, 2, 3, 4, 8])
def test_shards_cover_the_group_once_in_order(numel: int, ranks: int) -> None:
    bounds = [shard_bounds(numel, ranks, k) for k in range(ranks)]
    covered = [i for a, b in bounds for i in range(a, b)]
    assert covered == list(range(numel))  # every element once, shard k before shard k + 1
    length = shard_length(numel, ranks)
    assert all(0 <= b - a <= length for a, b in bounds)  # no shard longer than its padded gather slot
    assert all(b - a == length for a, b in bounds[:-1] if b < numel)  # only the tail is short


@pytest.mark.parametrize(
    ("numel", "ranks", "empty"), [(1, 2, [1]), (2, 4, [2, 3]), (5, 4, [3]), (9, 4, [3]), (8, 4, [])]
)
def test_ranks_past_a_small_group_own_nothing(numel: int, ranks: int, empty: list[int]) -> None:
    assert [k for k in range(ranks) if shard_bounds(numel, ranks, k)[0] == shard_bounds(numel, ranks, k)[1]] == empty


@pytest.mark.parametrize(("numel", "ranks", "rank"), [(4, 0, 0), (4, 2, 2), (4, 2, -1), (-1, 2, 0)])
def test_bad_shard_arguments_are_refused(numel: int, ranks: int, rank: int) -> None:
    with pytest.raises(ValueError):
        shard_bounds(numel, ranks, rank)


@pytest.mark.parametrize(
    ("address", "offset", "want"),
    [
        ("127.0.0.1:5000", 0, "127.0.0.1:5000"),
        ("127.0.0.1:5000", 3, "127.0.0.1:5003"),
        ("127.0.0.1:0", 3, "127.0.0.1:0"),
        ("[::1]:7000", 1, "[::1]:7001"),
        ("eu.example.org:443", 2, "eu.example.org:445"),
    ],
)
def test_shift_port(address: str, offset: int, want: str) -> None:
    assert shift_port(address, offset) == want


@pytest.mark.parametrize("address", ["127.0.0.1", "host:http", "127.0.0.1:65535"])
def test_shift_port_refuses_what_it_cannot_shift(address: str) -> None:
    with pytest.raises(ValueError):
        shift_port(address, 1)


@pytest.mark.parametrize("local_rank", [0, 1, 3])
def test_rank_config_rings_with_the_same_local_rank(local_rank: int) -> None:
    ring = (PeerInfo("eu", "127.0.0.1:7000"), PeerInfo("us", "127.0.0.1:8000"))
    base = PeerConfig(node_id="us", listen="127.0.0.1:8000", ring=ring, health_listen="127.0.0.1:9000")
    cfg = rank_config(base, local_rank)
    name = "{}" if local_rank == 0 else "{}." + str(local_rank)  # rank 0 keeps the region's id
    assert cfg.node_id == rank_node_id("us", local_rank) == name.format("us")
    assert cfg.listen == f"127.0.0.1:{8000 + local_rank}"
    assert cfg.health_listen == f"127.0.0.1:{9000 + local_rank}"
    assert cfg.ring == (
        PeerInfo(name.format("eu"), f"127.0.0.1:{7000 + local_rank}"),
        PeerInfo(name.format("us"), f"127.0.0.1:{8000 + local_rank}"),
    )
    assert cfg.transport == base.transport and cfg.codec == base.codec


def test_rank_config_refuses_a_negative_rank() -> None:
    with pytest.raises(ValueError):
        rank_config(PeerConfig(node_id="a"), -1)


# a region of two hosts with two ranks each: ranks 0, 1 on 10.0.0.1, ranks 2, 3 on 10.0.0.2 (each host's ranks
# on its port 7070 + its LOCAL_RANK), beside a region of one host that lists none
SPANNING = PeerInfo("eu", "10.0.0.1:7070", ("10.0.0.1:7070", "10.0.0.1:7071", "10.0.0.2:7070", "10.0.0.2:7071"))
ONE_HOST = PeerInfo("us", "10.1.0.1:7070")


@pytest.mark.parametrize(
    ("rank", "host_rank", "listen", "advertise", "us"),
    [
        (0, 0, "0.0.0.0:7070", "10.0.0.1:7070", "10.1.0.1:7070"),
        (1, 1, "0.0.0.0:7071", "10.0.0.1:7071", "10.1.0.1:7071"),
        (2, 0, "0.0.0.0:7070", "10.0.0.2:7070", "10.1.0.1:7072"),
        (3, 1, "0.0.0.0:7071", "10.0.0.2:7071", "10.1.0.1:7073"),
    ],
)
def test_a_region_spanning_hosts_listens_per_host_and_is_dialled_at_each_ranks_address(
    rank: int, host_rank: int, listen: str, advertise: str, us: str
) -> None:
    cfg = PeerConfig(node_id="eu", listen="0.0.0.0:7070", ring=(SPANNING, ONE_HOST), allow_insecure=True)
    mine = rank_config(cfg, rank, host_rank)
    assert (mine.node_id, mine.listen, mine.advertise) == (rank_node_id("eu", rank), listen, advertise)
    assert [(p.node_id, p.address) for p in mine.ring] == [
        (rank_node_id("eu", rank), advertise),
        (rank_node_id("us", rank), us),  # a region without ranks: its host, port + rank
    ]
    # the other side: the one-host region's rank k dials the spanning region's rank k where it listed it
    theirs = rank_config(
        PeerConfig(node_id="us", listen="0.0.0.0:7070", ring=(SPANNING, ONE_HOST), allow_insecure=True), rank
    )
    assert theirs.ring[0].address == advertise and theirs.listen == f"0.0.0.0:{7070 + rank}"


def test_a_rank_past_the_ranks_a_region_lists_is_refused() -> None:
    cfg = PeerConfig(
        node_id="us", ring=(PeerInfo("eu", "127.0.0.1:7070", ("127.0.0.1:7070",)), PeerInfo("us", "127.0.0.1:7080"))
    )
    with pytest.raises(ValueError, match="'eu' lists 1 ranks; this is rank 1"):
        rank_config(cfg, 1)


@pytest.mark.parametrize(
    ("ranks", "message"),
    [
        (("10.0.0.9:7070",), r"ranks\[0\] \('10.0.0.9:7070'\) must be its address"),
        ("10.0.0.1:7070", "ranks must be a list of host:port strings"),
        (("10.0.0.1:7070", 7071), "ranks must be a list of host:port strings"),
    ],
)
def test_bad_rank_lists_are_refused_naming_the_entry(ranks: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        PeerInfo("eu", "10.0.0.1:7070", ranks)  # type: ignore[arg-type]


def test_rank_addresses_off_the_host_need_tls_or_allow_insecure() -> None:
    ring = (PeerInfo("eu", "127.0.0.1:7070", ("127.0.0.1:7070", "10.0.0.2:7070")), PeerInfo("us", "127.0.0.1:7080"))
    with pytest.raises(ValueError, match=r"ring\[0\].ranks\[1\] '10.0.0.2:7070'"):
        PeerConfig(node_id="us", listen="127.0.0.1:7080", ring=ring)


def test_a_ring_entry_from_a_toml_table_takes_its_ranks_as_a_list() -> None:
    cfg = PeerConfig.from_dict(
        {
            "node_id": "us",
            "listen": "127.0.0.1:7080",
            "ring": [
                {"node_id": "eu", "address": "127.0.0.1:7070", "ranks": ["127.0.0.1:7070", "127.0.0.1:7075"]},
                {"node_id": "us", "address": "127.0.0.1:7080"},
            ],
        }
    )
    assert cfg.ring[0].ranks == ("127.0.0.1:7070", "127.0.0.1:7075") and hash(cfg.ring[0])


def test_a_region_spanning_hosts_without_its_ranks_listed_is_refused() -> None:
    cfg = PeerConfig(node_id="eu", ring=(PeerInfo("eu", "127.0.0.1:7070"), PeerInfo("us", "127.0.0.1:7080")))
    assert rank_config(cfg, 1, 1).ring[0].address == "127.0.0.1:7071"  # one host: rank k is host rank k
    with pytest.raises(ValueError, match="rank 2 of region 'eu' is rank 0 on its host: the region spans hosts"):
        rank_config(cfg, 2, 0)
