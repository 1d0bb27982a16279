"""A user's own training loop under :class:`~dreamp2p.service.lifecycle.Checkpointer`, run as a process of its
own by test_library_lifecycle.py: a one-member cluster on loopback (or, with ``--ring``, one member of a ring),
local SGD, a LambdaLR on the sync object; a step that a stop leaves without its peer is abandoned, as README
shows.

Writes the step count to ``--progress`` after every step and a JSON summary to ``--out`` at the end.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import time
import zlib
from pathlib import Path

import torch
from torch import nn

from dreamp2p.config import PeerConfig, PeerInfo, TransportConfig
from dreamp2p.errors import RoundFailed
from dreamp2p.node import Node
from dreamp2p.service.lifecycle import Checkpointer


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", required=True)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--every", type=int, default=5)
    ap.add_argument("--out", required=True)
    ap.add_argument("--progress", required=True)
    ap.add_argument("--sleep", type=float, default=0.0)
    ap.add_argument("--node-id", default="solo")
    ap.add_argument("--ring", default="", help="id=host:port,... (this node's entry gives its listen address)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO)
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ring = tuple(PeerInfo(*entry.split("=", 1)) for entry in args.ring.split(",") if entry)
    listen = next((p.address for p in ring if p.node_id == args.node_id), "127.0.0.1:0")
    transport = TransportConfig(round_timeout_s=20.0, connect_timeout_s=60.0)
    node = Node(PeerConfig(node_id=args.node_id, cluster_id="lib", listen=listen, ring=ring, transport=transport))
    try:
        if not ring:
            node.connect([PeerInfo(args.node_id, node.address)])  # a ring of one
        with Checkpointer(node, args.dir, every_steps=args.every, stop_grace_s=5.0) as ckpt:
            sync = ckpt.attach(model, opt, strategy="localsgd", period=2)
            start = sync.step_count
            sched = torch.optim.lr_scheduler.LambdaLR(sync, lambda s: 1.0 / (1 + s))
            ckpt.track(scheduler=sched)
            lr_at_start = sync.param_groups[0]["lr"]
            while sync.step_count < args.steps and not ckpt.stop_requested:
                seed = zlib.crc32(args.node_id.encode()) + sync.step_count  # each member its own data
                x = torch.randn(16, 4, generator=torch.Generator().manual_seed(seed))
                nn.functional.mse_loss(model(x), x.sum(1, keepdim=True)).backward()
                try:
                    sync.step()
                except RoundFailed:
                    if not ckpt.stop_requested:
                        raise
                    ckpt.abandon_step()  # stopping, and the round needed a member that already left
                    break
                sync.zero_grad()
                sched.step()
                ckpt.maybe_save()
                # written aside and renamed, so a reader never sees the file truncated and not yet written
                Path(args.progress + ".tmp").write_text(str(sync.step_count))
                os.replace(args.progress + ".tmp", args.progress)
                time.sleep(args.sleep)
            path = ckpt.finish()
            params = b"".join(p.detach().numpy().tobytes() for p in model.parameters())
            result = {
                "start": start,
                "step": sync.step_count,
                "signal": ckpt.signal,
                "checkpoint": str(path),
                "resumed_from": str(ckpt.resumed_from) if ckpt.resumed_from else None,
                "joined": ckpt.joined,
                "lr_at_start": lr_at_start,
                "lr": sync.param_groups[0]["lr"],
                "last_epoch": sched.last_epoch,
                "digest": hashlib.sha256(params).hexdigest(),
            }
    finally:
        node.close()
    Path(args.out).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
