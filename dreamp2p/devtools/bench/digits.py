"""`bench digits`: a small BatchNorm CNN on scikit-learn's 8x8 digits, trained through the library only.

The user scenario it reproduces: ``peers`` processes on loopback, each with
``node = Node(PeerConfig(...))`` and ``sync = node.attach(model, opt, strategy=name, ...)``, run a plain
loop (forward, ``loss.backward()``, ``sync.step()``, ``sync.zero_grad()``) over mini-batches of their own
shard of the training set (rank r takes every ``peers``-th sample starting at r); at the end
``sync.flush()``, then each rank evaluates test accuracy with ``model.eval()`` (so BatchNorm uses its
running statistics). The model is Conv(1,16)-BN-ReLU-Conv(16,32)-BN-ReLU-AvgPool(2x2)-Linear(128,10); the
inner optimizer is SGD with momentum 0.9.

The one-process reference trains the same model from the same initialization with the same optimizer for
the same number of steps, each step on the union of every rank's batch of that step (``batch * peers``
samples), without any synchronization. Reported per strategy:

- ``accuracy`` of each rank, their ``mean_accuracy``, the ``reference_accuracy`` and ``gap`` (reference -
  mean);
- ``identical_state``: whether every rank ends with the same SHA-256 over all of ``model.state_dict()``
  (parameters and buffers: BatchNorm running mean/var and ``num_batches_tracked``); ``identical_params``
  and ``identical_buffers`` tell the two apart;
- ``wall_s``: the slowest rank's training loop plus flush; ``total_s``: the whole run as the parent saw
  it (process start, connect, attach included);
- ``rounds_skipped`` per rank, and the strategy's resolved sync settings (outer optimizer included).

``**knobs`` are SyncConfig overrides (``period``, ``outer_lr``, ``outer_momentum``, ``buffers``, ...), the
same for every strategy. Batches are a deterministic function of (seed, rank, step).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from dreamp2p.config.sync import SyncConfig
from dreamp2p.devtools.launch import run_local
from dreamp2p.node import Node

log = logging.getLogger(__name__)

JOB = "dreamp2p.devtools.bench.digits:digits_job"
SPLIT_SEED = 0  # the train/test split is fixed whatever the training seed
TEST_FRACTION = 0.2
DEFAULT_PERIOD = 10
# resolved SyncConfig settings shown per strategy (besides the knobs given)
REPORTED_SYNC = ("period", "codec", "buffers", "outer_lr", "outer_momentum", "max_delay")


def load_digits_split() -> dict[str, np.ndarray]:
    """scikit-learn's digits, scaled to [0, 1], as (N, 1, 8, 8) float32; a fixed stratified 80/20 split."""
    try:
        from sklearn.datasets import load_digits  # type: ignore[import-untyped]
        from sklearn.model_selection import train_test_split  # type: ignore[import-untyped]
    except ImportError as exc:
        raise RuntimeError(
            "bench digits needs scikit-learn (its load_digits data set): pip install 'scikit-learn>=1.3' "
            "(or install dreamp2p with the [dev] extra)"
        ) from exc
    data = load_digits()
    x = (np.asarray(data.images, dtype=np.float32) / 16.0)[:, None, :, :]
    y = np.asarray(data.target, dtype=np.int64)
    x_train, x_test, y_train, y_test = train_test_split(
        x, y, test_size=TEST_FRACTION, stratify=y, random_state=SPLIT_SEED
    )
    return {"x_train": x_train, "y_train": y_train, "x_test": x_test, "y_test": y_test}


def digits_cnn(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1),
        nn.BatchNorm2d(16),
        nn.ReLU(),
        nn.Conv2d(16, 32, 3, padding=1),
        nn.BatchNorm2d(32),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(2),
        nn.Flatten(),
        nn.Linear(32 * 2 * 2, 10),
    )


def steps_per_epoch(n_train: int, peers: int, batch: int) -> int:
    """Steps in which every rank goes once through its shard (the smallest shard decides)."""
    return max(1, (n_train // peers) // batch)


def batch_indices(shard_size: int, batch: int, step: int, rank: int, seed: int, per_epoch: int) -> torch.Tensor:
    """Positions within rank's shard for ``step``: a fresh permutation of the shard every epoch."""
    epoch, k = divmod(step, per_epoch)
    g = torch.Generator().manual_seed(seed * 1_000_003 + rank * 7919 + epoch)
    return torch.randperm(shard_size, generator=g)[k * batch : (k + 1) * batch]


def shard(x: torch.Tensor, y: torch.Tensor, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    return x[rank::world], y[rank::world]


def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    model.eval()
    with torch.no_grad():
        pred = model(x).argmax(dim=1)
    model.train()
    return float((pred == y).float().mean())


def _digest(items: Sequence[tuple[str, torch.Tensor]]) -> str:
    h = hashlib.sha256()
    for name, tensor in items:
        flat = tensor.detach().cpu().contiguous().reshape(-1)
        h.update(f"{name}:{flat.dtype}:{flat.numel()};".encode())
        h.update(flat.view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def state_digests(model: nn.Module) -> dict[str, str]:
    """SHA-256 of every ``state_dict`` entry, and of the parameters and the buffers apart."""
    state = list(model.state_dict(keep_vars=False).items())
    params = {name for name, _ in model.named_parameters()}
    return {
        "state": _digest(state),
        "params": _digest([(k, v) for k, v in state if k in params]),
        "buffers": _digest([(k, v) for k, v in state if k not in params]),
    }


def _jsonable(value: Any) -> Any:
    if isinstance(value, tuple):
        return list(value)
    return value


def digits_job(
    node: Node,
    rank: int,
    world: int,
    strategy: str,
    data: dict[str, np.ndarray],
    steps: int,
    batch: int,
    lr: float,
    momentum: float,
    seed: int,
    sync: dict[str, Any],
) -> dict[str, Any]:
    """One rank of the scenario (runs in a peer process started by `dreamp2p.devtools.launch.run_local`)."""
    x_train, y_train = torch.from_numpy(data["x_train"]), torch.from_numpy(data["y_train"])
    xs, ys = shard(x_train, y_train, rank, world)
    per_epoch = steps_per_epoch(len(x_train), world, batch)
    model = digits_cnn(seed)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    s = node.attach(model, opt, strategy=strategy, **sync)
    loss_fn = nn.CrossEntropyLoss()
    losses: list[float] = []
    t0 = time.perf_counter()
    for step in range(steps):
        idx = batch_indices(len(xs), batch, step, rank, seed, per_epoch)
        loss = loss_fn(model(xs[idx]), ys[idx])
        loss.backward()
        s.step()
        s.zero_grad()
        losses.append(loss.item())
    s.flush()
    wall = time.perf_counter() - t0
    acc = accuracy(model, torch.from_numpy(data["x_test"]), torch.from_numpy(data["y_test"]))
    return {
        "accuracy": acc,
        "digests": state_digests(model),
        "wall_s": wall,
        "final_loss": sum(losses[-per_epoch:]) / len(losses[-per_epoch:]) if losses else None,
        "rounds_skipped": getattr(s, "rounds_skipped", None),
        "bytes_sent": s.totals.bytes_sent,
        "sync": {k: _jsonable(v) for k, v in dataclasses.asdict(s.cfg).items()},
    }


def reference_run(
    data: dict[str, np.ndarray], peers: int, steps: int, batch: int, lr: float, momentum: float, seed: int
) -> dict[str, Any]:
    """One process, no synchronization: each step on the union of every rank's batch of that step."""
    x_train, y_train = torch.from_numpy(data["x_train"]), torch.from_numpy(data["y_train"])
    shards = [shard(x_train, y_train, r, peers) for r in range(peers)]
    per_epoch = steps_per_epoch(len(x_train), peers, batch)
    model = digits_cnn(seed)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    loss_fn = nn.CrossEntropyLoss()
    t0 = time.perf_counter()
    for step in range(steps):
        xb, yb = [], []
        for r, (xs, ys) in enumerate(shards):
            idx = batch_indices(len(xs), batch, step, r, seed, per_epoch)
            xb.append(xs[idx])
            yb.append(ys[idx])
        loss = loss_fn(model(torch.cat(xb)), torch.cat(yb))
        opt.zero_grad()
        loss.backward()
        opt.step()
    wall = time.perf_counter() - t0
    acc = accuracy(model, torch.from_numpy(data["x_test"]), torch.from_numpy(data["y_test"]))
    return {"accuracy": round(acc, 4), "wall_s": round(wall, 3)}


def _reference_run(
    data: dict[str, Any], peers: int, steps: int, batch: int, lr: float, momentum: float, seed: int
) -> dict[str, Any]:
    """reference_run on one torch thread, as in the peer processes."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as in the peer processes
    try:
        return reference_run(data, peers, steps, batch, lr, momentum, seed)
    finally:
        torch.set_num_threads(threads)


def _row(res: list[dict[str, Any]], total: float, reference: dict[str, Any], sync: dict[str, Any]) -> dict[str, Any]:
    """One strategy's entry in the report, from its ranks' results."""
    accs = [r["accuracy"] for r in res]
    mean = sum(accs) / len(accs)

    def same(kind: str, res: list[dict[str, Any]] = res) -> bool:
        return len({r["digests"][kind] for r in res}) == 1

    row = {
        "accuracy": [round(a, 4) for a in accs],
        "mean_accuracy": round(mean, 4),
        "reference_accuracy": reference["accuracy"],
        "gap": round(reference["accuracy"] - mean, 4) + 0.0,  # no "-0.0"
        "identical_state": same("state"),
        "identical_params": same("params"),
        "identical_buffers": same("buffers"),
        "wall_s": round(max(r["wall_s"] for r in res), 3),
        "total_s": round(total, 3),
        "rounds_skipped": [r["rounds_skipped"] for r in res],
        "final_train_loss": [None if r["final_loss"] is None else round(r["final_loss"], 4) for r in res],
        "bytes_sent_per_rank": round(sum(r["bytes_sent"] for r in res) / len(res)),
        "sync": {k: v for k, v in res[0]["sync"].items() if k in REPORTED_SYNC or k in sync},
    }
    return row


def bench_digits(
    strategies: Sequence[str] = ("ssgd", "dreamddp", "diloco"),
    peers: int = 3,
    epochs: int = 10,
    seed: int = 0,
    *,
    batch: int = 32,
    lr: float = 0.05,
    momentum: float = 0.9,
    timeout: float = 600.0,
    **knobs: Any,
) -> dict[str, Any]:
    """Train the digits CNN with each strategy on ``peers`` local processes and against the reference.

    ``epochs`` counts passes of every rank over its shard; ``batch`` is per rank. ``knobs`` are SyncConfig
    overrides (``period`` defaults to 10); unknown or invalid ones raise ValueError before anything starts.
    Returns a JSON-serialisable dict (see the module docstring).
    """
    if peers < 1:
        raise ValueError(f"peers must be >= 1, got {peers}")
    if epochs < 1 or batch < 1:
        raise ValueError("epochs and batch must be >= 1")
    if "strategy" in knobs:
        raise ValueError("give strategies through `strategies`, not as a knob")
    sync = {"period": DEFAULT_PERIOD, **knobs}
    for name in strategies:
        SyncConfig.from_dict({"strategy": name, **sync})  # fail early, here, on a bad name or knob
    data = load_digits_split()
    n_train = len(data["x_train"])
    if n_train // peers < batch:
        raise ValueError(f"batch {batch} is larger than a rank's shard ({n_train // peers} samples)")
    steps = epochs * steps_per_epoch(n_train, peers, batch)

    reference = _reference_run(data, peers, steps, batch, lr, momentum, seed)
    log.info("reference: accuracy %.4f", reference["accuracy"])

    out: dict[str, Any] = {}
    for name in strategies:
        args = {
            "strategy": name,
            "data": data,
            "steps": steps,
            "batch": batch,
            "lr": lr,
            "momentum": momentum,
            "seed": seed,
            "sync": sync,
        }
        t0 = time.perf_counter()
        res = run_local(peers, JOB, args, node_job=True, timeout=timeout)
        total = time.perf_counter() - t0
        out[name] = _row(res, total, reference, sync)
        log.info(
            "%s: mean accuracy %.4f (gap %.4f), identical %s",
            name,
            out[name]["mean_accuracy"],
            out[name]["gap"],
            out[name]["identical_state"],
        )
    return {
        "strategies": out,
        "reference": reference,
        "setup": {
            "peers": peers,
            "epochs": epochs,
            "steps": steps,
            "batch_per_rank": batch,
            "lr": lr,
            "momentum": momentum,
            "seed": seed,
            "train_samples": n_train,
            "test_samples": len(data["x_test"]),
            "params": sum(p.numel() for p in digits_cnn(seed).parameters()),
            "knobs": {k: _jsonable(v) for k, v in sync.items()},
        },
    }


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--strategies", default="ssgd,dreamddp,diloco", help="comma-separated")
    parser.add_argument("--peers", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument(
        "--knob", action="append", default=[], metavar="KEY=VALUE", help="SyncConfig override, value as JSON"
    )
    ns = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    extra: dict[str, Any] = {}
    for item in ns.knob:
        key, _, raw = item.partition("=")
        try:
            extra[key] = json.loads(raw)
        except json.JSONDecodeError:
            extra[key] = raw
    result = bench_digits(
        [s for s in ns.strategies.split(",") if s],
        peers=ns.peers,
        epochs=ns.epochs,
        seed=ns.seed,
        batch=ns.batch,
        lr=ns.lr,
        **extra,
    )
    print(json.dumps(result))
