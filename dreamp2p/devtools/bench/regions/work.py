"""One local rank of `bench regions`: ``python -m dreamp2p.devtools.bench.regions.work SPEC REGION``.

Started by `dreamp2p.devtools.bench.regions.run` inside its rank's network namespace, with torchrun's
variables (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``) when its region has
more than one rank and none when it has one. It trains `bench lm`'s byte-level GPT (`lm.work`'s corpus,
shards, model and AdamW) as a user would: DDP inside the region over gloo (FSDP2 with ``"fsdp"`` in the spec),
``Node(config).attach(...)``
between regions, ``sync.step()`` in the loop. Step 0 warms up (connections, chunk sizes) and is not
timed; steps 1 .. ``steps`` - 1 are the measured loop; then ``quiet_steps`` at learning rate 0. Writes
``<out>/<region>.<local rank>.json``: the loop's wall time, its round payload (``totals.bytes_sent``) and
its WAN device's transmitted bytes (its tbf's counter, in this namespace), the
losses, and the parameter digest after the quiet stretch and ``sync.close()``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dreamp2p.config import PeerConfig
from dreamp2p.devtools.bench.lm.work import (
    lm_loss,
    load_corpus,
    make_model,
    make_optimizer,
    train_batch,
    train_shard,
)
from dreamp2p.devtools.netns import wire_bytes
from dreamp2p.manifest import param_digest
from dreamp2p.node import Node
from dreamp2p.service.region import data_parallel, data_position, fully_sharded, torchrun_place
from dreamp2p.sync.strategies.base import Strategy


def _steps(
    sync: Strategy, model: nn.Module, shard: torch.Tensor, data_rank: int, steps: range, w: dict[str, Any]
) -> list[float]:
    losses = []
    for step in steps:
        x, y = train_batch(shard, data_rank, step, w["batch"], w["context"], "cpu")
        loss = lm_loss(model, x, y)
        loss.backward()
        sync.step()
        sync.zero_grad()
        losses.append(loss.item())
    return losses


def run_rank(spec: dict[str, Any], region: int) -> dict[str, Any]:
    """Train this rank (see the module docstring); what it measured."""
    torch.set_num_threads(1)
    place = torchrun_place(os.environ)
    if place is not None:
        dist.init_process_group("gloo")
    rank = place.rank if place is not None else 0
    w = spec["workload"]
    data_rank, world = data_position(region, spec["regions"], place)
    train, _ = load_corpus()
    shard = train_shard(train, data_rank, world)
    inner = make_model(w["width"], w["layers"], w["heads"], w["context"], "cpu")
    if place is None:
        model = inner
    elif spec.get("fsdp"):
        model = inner = fully_sharded(inner)  # each rank holds and averages its own shards
    else:
        model = data_parallel(inner, "cpu")
    opt = make_optimizer(inner, w["lr"])
    ring = spec["ring"]
    config = PeerConfig.from_dict(
        {
            "node_id": ring[region]["node_id"],
            "cluster_id": "bench-regions",
            "listen": ring[region]["address"],
            "ring": ring,
            "allow_insecure": True,  # namespaces this bench created, on this host only
            "transport": spec["transport"],
        }
    )
    node = Node(config)
    try:
        sync = node.attach(model, opt, strategy=spec["strategy"], **spec["sync"])
        steps, quiet = spec["steps"], spec["quiet_steps"]
        losses = _steps(sync, model, shard, data_rank, range(0, 1), w)  # warm-up, not timed
        wire0, payload0 = wire_bytes(spec["wan_dev"]), sync.totals.bytes_sent
        t0 = time.perf_counter()
        losses += _steps(sync, model, shard, data_rank, range(1, steps), w)
        loop_s = time.perf_counter() - t0
        wire, payload = wire_bytes(spec["wan_dev"]) - wire0, sync.totals.bytes_sent - payload0
        for group in opt.param_groups:
            group["lr"] = 0.0
        _steps(sync, model, shard, data_rank, range(steps, steps + quiet), w)
        sync.close()
        result = {
            "node_id": node.config.node_id,
            "region": region,
            "rank": rank,
            "timed_steps": steps - 1,
            "loop_s": loop_s,
            "payload_bytes": payload,
            "wire_bytes": wire,
            "bytes_sent": sync.totals.bytes_sent,
            "losses": losses,
            "rounds_skipped": sync.rounds_skipped,
            "digest": param_digest(inner),
        }
    finally:
        node.close()
    if place is not None:
        dist.destroy_process_group()
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("spec", type=Path, help="the run's JSON spec, written by bench regions")
    p.add_argument("region", type=int, help="this region's index in the spec's ring")
    args = p.parse_args(argv)
    spec = json.loads(args.spec.read_text())
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(process)d %(name)s %(message)s")
    result = run_rank(spec, args.region)
    out = Path(spec["out"])
    (out / f"{args.region}.{result['rank']}.json").write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
