"""Which part of a flat group each local rank of a region owns on the WAN, and each rank's peer settings.

Pure arithmetic, no torch.distributed and no network (see `dreamp2p.sync.comm.sharded` for their use). A
region runs N local ranks (a torchrun job); local rank k owns shard k of every group the plan syncs and
averages only that shard with local rank k of the other regions. Shards are contiguous, each
``ceil(numel / N)`` elements long except the last ones, which the region's all-gather pads to that length
(a shard past the end of a small group is empty: that rank sends nothing for it).

Each local rank runs its own peer: node id ``<region id>.<k>`` (rank 0 keeps the region's id), listening
(and reached) on the region's port plus k, in a ring of its own with local rank k of every other region. A
region spanning hosts lists each rank's address in its ring entry (``ranks``); a rank then listens on the
region's port plus its rank on its host.
"""

from __future__ import annotations

import dataclasses

from dreamp2p.config.peer import PeerConfig, PeerInfo


def shard_length(numel: int, ranks: int) -> int:
    """Elements per shard (the padded length every rank's all-gather slot has): ceil(numel / ranks)."""
    if ranks < 1:
        raise ValueError(f"a region has at least one rank, got {ranks}")
    if numel < 0:
        raise ValueError(f"a group has numel >= 0, got {numel}")
    return -(-numel // ranks)


def shard_bounds(numel: int, ranks: int, rank: int) -> tuple[int, int]:
    """``(start, stop)`` of rank ``rank``'s shard in a flat group of ``numel`` elements (may be empty)."""
    if not 0 <= rank < ranks:
        raise ValueError(f"local rank {rank} outside 0..{ranks - 1}")
    length = shard_length(numel, ranks)
    start = min(rank * length, numel)
    return start, min(start + length, numel)


def rank_node_id(region_id: str, local_rank: int) -> str:
    """The node id local rank ``local_rank`` of region ``region_id`` uses on the WAN: the region's own id
    for rank 0 (so a region of one rank, which runs no such arithmetic, meets rank 0 and is refused by
    the settings check with a clear message), ``<region id>.<k>`` for the others."""
    return region_id if local_rank == 0 else f"{region_id}.{local_rank}"


def shift_port(address: str, offset: int) -> str:
    """``host:port`` with ``offset`` added to the port (port 0, "any free port", stays 0)."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"address {address!r} must end in :port")
    value = int(port)
    if value == 0:
        return address
    if not 0 < value + offset < 65536:
        raise ValueError(f"{address} + {offset}: port {value + offset} outside 1..65535")
    return f"{host}:{value + offset}"


def rank_address(entry: PeerInfo, rank: int) -> str:
    """Where rank ``rank`` of the region ``entry`` names listens: its ``ranks`` entry (a region spanning hosts),
    else the region's address with the port plus ``rank``; ValueError past the ranks it lists."""
    if not entry.ranks:
        return shift_port(entry.address, rank)
    if rank >= len(entry.ranks):
        raise ValueError(f"ring entry {entry.node_id!r} lists {len(entry.ranks)} ranks; this is rank {rank}")
    return entry.ranks[rank]


def rank_config(config: PeerConfig, local_rank: int, host_rank: int | None = None) -> PeerConfig:
    """The peer settings of local rank ``local_rank`` (its rank in the region) from its region's: its node id,
    ports and ring.

    Every region's ``ring`` entry names the region (its id and the address of local rank 0); local rank k
    dials local rank k of each, at that address's port plus k, or at the entry's ``ranks[k]`` where it lists
    them (a region spanning hosts). This rank listens (and serves health) on the region's ports plus
    ``host_rank``, its rank among the region's ranks on this host (torchrun's LOCAL_RANK; default: ``local_rank``,
    every rank on one host), and advertises its own region's ``ranks[k]`` where listed.
    """
    if local_rank < 0 or (host_rank is not None and host_rank < 0):
        raise ValueError(f"local rank and host rank must be >= 0, got {local_rank} and {host_rank}")
    here = local_rank if host_rank is None else host_rank
    ring = tuple(
        PeerInfo(rank_node_id(p.node_id, local_rank), rank_address(p, local_rank), token_sha256=p.token_sha256)
        for p in config.ring
    )
    own = next((p for p in config.ring if p.node_id == config.node_id and p.ranks), None)
    if own is None and here != local_rank and config.ring:
        # the other regions would dial this rank on rank 0's host, where another rank (or nothing) listens
        raise ValueError(
            f"rank {local_rank} of region {config.node_id!r} is rank {here} on its host: the region spans hosts, so "
            "its ring entry must list every rank's address (ranks = [...], in region-rank order)"
        )
    if own is not None:
        advertise: str | None = rank_address(own, local_rank)
    else:
        advertise = shift_port(config.advertise, here) if config.advertise else None
    health = config.health_listen
    return dataclasses.replace(
        config,
        node_id=rank_node_id(config.node_id, local_rank),
        listen=shift_port(config.listen, here),
        advertise=advertise,
        ring=ring,
        health_listen=shift_port(health, here) if health else None,
    )
