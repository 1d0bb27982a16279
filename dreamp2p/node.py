"""A node's library entry point: the peer (on its comm thread or comm process) plus `attach` for the model.

node = Node(config)                       # or Node.from_toml(path)
sync = node.attach(model, optimizer)      # DreamDDP by default
for batch in loader:
    loss = loss_fn(model(batch)); loss.backward()
    sync.step(); sync.zero_grad()
node.close()

In a region of many ranks (a torchrun job: torch.distributed initialized with more than one rank, or a
process group passed as ``region``), each local rank makes its own Node from the region's config: its
peer gets its own node id and port and rings with the same local rank of the other regions, and the
strategy averages one shard of each group per rank (`dreamp2p.sync.comm.sharded`); wrap the model in
DistributedDataParallel before ``attach``, or shard it with FSDP2 (``fully_shard``): each rank then averages
its own shards of every parameter with the same local rank of the other regions.

A node joining a running cluster (a new member, or one restarted after a crash) passes ``joining=True``
and ``attach(..., join=True)``: it takes the training state from the live members (`dreamp2p.state`),
starts at their step, and only then takes part in rounds (see :meth:`Node.join`). In a region every local
rank does so at once: local rank 0 fetches, the region shares it (`dreamp2p.sync.comm.regionjoin`).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from dreamp2p.config import PeerConfig, PeerInfo
from dreamp2p.config.sync import SyncConfig
from dreamp2p.errors import PeerError
from dreamp2p.manifest import manifest_hash
from dreamp2p.messages import PeerStatus
from dreamp2p.state.donor import StateDonor
from dreamp2p.state.snapshot import unflatten_state
from dreamp2p.sync.comm.collective import Collective
from dreamp2p.sync.comm.process import CommProcess, RemoteDonor
from dreamp2p.sync.comm.regionjoin import join_owned, join_region, resync_owned, resync_region
from dreamp2p.sync.comm.sharded import ShardedCollective, region_group
from dreamp2p.sync.comm.shards import rank_config
from dreamp2p.sync.comm.thread import CommThread
from dreamp2p.sync.model.agreement import inner_momentum, is_adaptive, training_settings
from dreamp2p.sync.model.shardlocal import is_dtensor, is_sharded
from dreamp2p.sync.strategies.base import Strategy
from dreamp2p.sync.strategies.registry import strategy_class
from dreamp2p.sync.strategies.replicas import broadcast_state, state_tensors

log = logging.getLogger(__name__)

# A joiner starts this many steps after the newest step a member reports: rounds it cannot take part
# in any more are refused at once (they fail everywhere and are skipped), later ones include it.
JOIN_LEAD_STEPS = 2
JOIN_ATTEMPTS = 3


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module inside DistributedDataParallel and ``torch.compile`` wrappers.

    Both keep the module's parameters and layout (a one-rank job's); ``torch.compile`` only adds an
    ``_orig_mod.`` prefix to every state_dict key, which must not reach the model manifest or checkpoints.
    Compiled or not, the user calls the wrapper as before; the strategy holds the module inside.
    """
    while True:
        # torch._dynamo.eval_frame.OptimizedModule, known by name: importing dynamo is slow
        orig = getattr(model, "_orig_mod", None) if type(model).__name__ == "OptimizedModule" else None
        if isinstance(model, DistributedDataParallel):
            model = model.module
        elif isinstance(orig, nn.Module):
            model = orig
        else:
            return model


# why a region of many ranks refuses sync.periods = "time" (for now)
TIMED_IN_REGION = (
    "sync.periods = 'time' runs with one rank per region for now: the ranks of a region would each follow the "
    "cluster's clock on their own and take different numbers of DDP steps"
)


class Node:
    """``comm``: run the peer on a thread of this process ("thread") or in a child process ("process",
    off the trainer's GIL); None takes ``config.comm``. ``region``: this process is one local rank of a
    region (see the module docstring): None detects it from torch.distributed, a process group names the
    region's ranks, False runs as a region of one. Constructing it is collective over the region."""

    def __init__(
        self,
        config: PeerConfig,
        model: nn.Module | None = None,
        joining: bool = False,
        comm: str | None = None,
        region: dist.ProcessGroup | bool | None = None,
    ) -> None:
        if model is not None and not config.manifest_hash:
            # peers only average with peers that hold the same model layout
            config = dataclasses.replace(config, manifest_hash=manifest_hash(unwrap(model).state_dict().items()))
        if comm is not None:
            config = dataclasses.replace(config, comm=comm)
        group = region_group(region)
        if group is not None:
            config = rank_config(config, dist.get_rank(group), host_rank(os.environ))
        self.config = config
        self.comm: CommThread | CommProcess
        self.donor: StateDonor
        if config.comm == "process":
            self.comm = CommProcess(config, ready=not joining)
            self.donor = RemoteDonor(self.comm)
        else:
            self.comm = CommThread(config, ready=not joining)
            self.donor = StateDonor()
        self.comm.set_state_donor(self.donor)
        # what strategies talk to: the peer itself, or (in a region) its shard rounds plus the region's gathers
        self.region: ShardedCollective | None = ShardedCollective(self.comm, group) if group is not None else None
        self.collective: Collective = self.region if self.region is not None else self.comm
        self._connected = False
        self.strategy: Strategy | None = None
        self.resyncs = 0  # times this node took the members' state after missing their plan (see resync)

    @staticmethod
    def from_toml(path: str | Path) -> Node:
        return Node(PeerConfig.from_toml(path))

    @property
    def address(self) -> str:
        return self.comm.address

    def connect(
        self, ring: Sequence[PeerInfo] | None = None, timeout: float | None = None, require_all: bool = True
    ) -> None:
        self.comm.connect(ring, timeout, require_all)
        self._connected = True

    def attach(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        strategy: str | None = None,
        sync: SyncConfig | None = None,
        broadcast: bool = True,
        join: bool = False,
        **overrides: Any,
    ) -> Strategy:
        """Wrap ``optimizer`` with a synchronization strategy; replicas start from rank 0's state.

        Before anything is averaged, every live member's settings and model layout are compared with
        ours: a difference raises PeerError(CONFIG_MISMATCH) naming the setting and both values, here
        and on the other side. Then rank 0's parameters (frozen ones too) and buffers are broadcast.
        ``join=True``: take the state from the live members instead (see the module docstring).
        """
        cfg = _outer_defaults(self.sync_config(strategy, sync, **overrides), optimizer)
        if self.region is not None and cfg.timed_periods:
            raise ValueError(TIMED_IN_REGION)
        sharded = _region_model(self.region, model)
        model = unwrap(model)  # the strategy moves the user's module; DDP's hooks stay on its parameters
        if not self._connected:
            self.connect(require_all=not join)
        timeout = self.config.transport.round_timeout_s
        settings = training_settings(cfg, model)
        if self.region is not None:
            # regions whose rank counts differ would average shards of different sizes: refused at once
            settings["region.ranks"] = str(self.region.ranks)
            # a replicated region's rank k averages shard k of the whole model, an FSDP2 one its own shards
            settings["region.model"] = "fsdp2" if sharded else "replicated"
        self.comm.agree(settings, self.config.transport.connect_timeout_s)
        if broadcast and not join:  # a node resuming from its checkpoint keeps its own parameters
            if self.region is not None:
                # what every rank of the region holds whole (under FSDP2: buffers; each rank's shards come
                # from the same rank of region 0 over its ring, below)
                whole = [t for t in state_tensors(model) if not is_dtensor(t)]
                self.region.broadcast(whole, timeout)
            broadcast_state(self.collective, model, timeout)
        strat = strategy_class(cfg.strategy)(model, optimizer, self.collective, cfg, donor=self.donor)
        self.strategy = strat
        strat.on_diverged(lambda ahead: self.resync(strat, ahead))
        if join:
            self.join(strat, timeout=timeout)
        return strat

    @staticmethod
    def sync_config(strategy: str | None = None, sync: SyncConfig | None = None, **overrides: Any) -> SyncConfig:
        """The settings :meth:`attach` runs under for the same arguments (before the outer optimizer's
        defaults, which follow the optimizer)."""
        cfg = sync or SyncConfig()
        if strategy is not None:
            overrides["strategy"] = strategy
        return dataclasses.replace(cfg, **overrides) if overrides else cfg

    def join(self, strategy: Strategy, timeout: float) -> None:
        """Load the live members' state into ``strategy``, start at their step, then take part in rounds.

        Until now our heartbeat answers said we are joining, so the members trained on without us while we
        started. Now we ask in, and every live member must count us in its view: from then on each round
        they start includes us and fails while we refuse frames (JOINING), so neither an average nor a
        plan decision can be made without us. Only then is the state requested, so the snapshot it comes
        from is the members' state at our first step. State comes from several members at once, each
        tensor verified by its SHA-256 (a member that dies mid-transfer is replaced by another); the
        newest step any member reports, plus a small lead, is where we start.
        """
        others = self._others_alive(timeout)

        def admitted() -> None:
            self._ask_in()
            self._await_admission(others, timeout)

        if self.region is None:
            admitted()
            start = self._fetch_state(strategy, others, timeout)[0]
        elif self.region.owns_shards:  # FSDP2: each rank fetches its own shards from its ring
            start = join_owned(
                self.region,
                admitted,
                lambda: self._fetch_state(strategy, others, timeout)[0],
                timeout * (JOIN_ATTEMPTS + 2),
            )
            if start > strategy.step_count:
                strategy.jump_to(start)
        else:
            # every rank joins its shard ring; local rank 0 fetches and hands the state to the others
            start = join_region(
                self.region,
                admitted,
                lambda: self._fetch_state(strategy, others, timeout),
                _loader(strategy),
                timeout * (JOIN_ATTEMPTS + 2),  # the other ranks wait while rank 0 fetches
            )
        self.comm.admit_from(start + 1)  # rounds are numbered step + 1 (Strategy._round)

    def resync(self, strategy: Strategy, ahead: Sequence[str]) -> None:
        """Take the state of ``ahead``, members training with a plan this node missed, and train on with them.

        Called from ``strategy.step()`` when the peer noticed it (`dreamp2p.peer.drift`: after a partition
        each side may have decided its own plan, and no round between the two can complete). The peer
        already stands aside, so the members' rounds that include us fail at once meanwhile, as while a
        new member joins; the rest is :meth:`join`'s transfer, from those members only (the members on
        our side of the partition hold the same stale plan). If none of them can serve it, we train on
        with our own state and the peer checks again. A region of many ranks does it as one replica: every
        rank at the step local rank 0's verdict reaches them, with the state local rank 0 fetches
        (`dreamp2p.sync.comm.regionjoin.resync_region`).
        """
        timeout = self.config.transport.round_timeout_s
        log.warning("taking the training state of %s, whose plan this node missed", ", ".join(ahead))
        self.resyncs += 1
        strategy.abandon()  # the peer failed our rounds in flight: nobody applies them
        ours = strategy.step_count
        if self.region is not None and self.region.owns_shards:
            # every rank is here at this step; each takes its own shards from its ring, all start together
            taken = resync_owned(
                self.region,
                tuple(ahead),
                lambda names: self._fetch_state(strategy, list(names), timeout)[0],
                timeout * (JOIN_ATTEMPTS + 2),
            )
            start = taken if taken is not None else ours
            if start > strategy.step_count:
                strategy.jump_to(start)
        elif self.region is not None:
            # every rank is here at this step (local rank 0's verdict, see ShardedCollective.diverged_from);
            # the other ranks wait while rank 0 fetches
            fetch = functools.partial(self._fetch_state, strategy, list(ahead), timeout)
            taken = resync_region(self.region, fetch, _loader(strategy), timeout * (JOIN_ATTEMPTS + 2))
            start = taken if taken is not None else ours
        else:
            try:
                start = self._fetch_state(strategy, list(ahead), timeout)[0]
            except (PeerError, RuntimeError, TimeoutError) as exc:
                log.error("could not take the state of %s (%s): training on with our own", ", ".join(ahead), exc)
                start = strategy.step_count
        if start <= ours:
            # the members with the newer plan may be behind us in steps: round ids never go back (our peer
            # has run rounds up to ours), so we go on from our step; their rounds up to it fail as stale
            start = ours + 1
            strategy.jump_to(start)
        strategy.publish_progress()  # before admission: the peer compares plans again from then on
        self.comm.admit_from(start + 1)

    def _fetch_state(
        self, strategy: Strategy, others: list[str], timeout: float
    ) -> tuple[int, bytes, dict[str, torch.Tensor]]:
        """Load the members' newest state into ``strategy``; the step it starts at, and what was loaded."""
        for _ in range(JOIN_ATTEMPTS):
            fetched = self.comm.fetch_state(others, timeout, manifest_hash=self.config.manifest_hash)
            strategy.load_state_dict(unflatten_state(fetched.skeleton, fetched.tensors))
            steps, plans = [fetched.step], [0]
            for status in self._statuses(others, timeout):
                if status.training is not None:
                    steps.append(status.training.step)
                    plans.append(status.training.plan_version)
            start = max(steps) + JOIN_LEAD_STEPS
            strategy.jump_to(start)
            # a plan decided by a control round already in flight at the snapshot lands with the state; a
            # newer one means the members decided without us after all: fetch again
            if strategy.plan_version >= max(plans):
                break
            log.warning("members moved to plan v%d during the transfer; fetching again", max(plans))
        else:
            raise RuntimeError(f"could not catch up with the members' plan in {JOIN_ATTEMPTS} transfers")
        log.warning(
            "joined at step %d with state of step %d from %s (%d bytes)",
            start,
            fetched.step,
            ", ".join(fetched.donors_used),
            fetched.bytes,
        )
        return start, fetched.skeleton, fetched.tensors

    def _others_alive(self, timeout: float) -> list[str]:
        """The other members our view holds, waiting while it holds only us.

        A node that just started may have counted the others dead before their first heartbeat answers came
        (a loaded host): its view is then only itself for a few heartbeats. Joining with no one to ask would
        wait out the admission for nothing, so wait for the view to hold someone else first.
        """
        me = self.config.node_id
        limit, deadline = _join_deadline(timeout, self.config.transport.heartbeat_s)
        while not (others := [n for n in self.comm.members if n != me]):
            if time.monotonic() > deadline:
                raise RuntimeError(f"joining: no other member answered heartbeats within {limit:.0f} s")
            _join_pause(self.config.transport.heartbeat_s)
        return others

    def _statuses(self, members: list[str], timeout: float) -> list[PeerStatus]:
        out = []
        for member in members:
            try:
                out.append(self.comm.member_status(member, timeout))
            except PeerError as exc:
                log.warning("%s gave no status while joining: %s", member, exc)
        return out

    def _ask_in(self) -> None:
        """Be counted in the members' rounds from now on (see :meth:`join`); each member hears it at once."""
        self.comm.ask_in(max(1.0, 2 * self.config.transport.heartbeat_s))

    def _await_admission(self, members: list[str], timeout: float) -> None:
        """Wait until every member that answers counts us in its view (see :meth:`join`)."""
        me = self.config.node_id
        t = self.config.transport
        limit, deadline = _join_deadline(timeout, self.config.transport.heartbeat_s)
        while True:
            statuses = self._statuses(members, t.rpc_deadline_s)
            waiting = [s.node_id for s in statuses if me not in s.live]
            if statuses and not waiting:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"joining: {', '.join(waiting) or 'no member'} did not count this node alive within "
                    f"{limit:.0f} s (heartbeats every {t.heartbeat_s} s)"
                )
            _join_pause(self.config.transport.heartbeat_s)

    def stand_aside(self) -> None:
        """Stop taking part in rounds until :meth:`join` is done (a resuming node that must join instead)."""
        self.comm.stand_aside()

    def begin_drain(self) -> None:
        """The node is stopping: its health turns NOT_SERVING while rounds in flight still land."""
        self.comm.begin_drain()

    @property
    def connected(self) -> bool:
        """Whether :meth:`connect` ran (``attach`` connects first if not)."""
        return self._connected

    def close(self) -> None:
        try:
            if self.strategy is not None:
                self.strategy.close()
        finally:
            try:
                if self.region is not None:
                    self.region.close()
            finally:
                self.comm.close()


def host_rank(env: Mapping[str, str]) -> int | None:
    """This process's rank among its region's ranks on this host: torchrun's LOCAL_RANK (None without it, when
    every rank of the region is taken to be on one host); ValueError when it is not a number >= 0."""
    text = env.get("LOCAL_RANK")
    if text is None:
        return None
    if not text.isdigit():
        raise ValueError(f"LOCAL_RANK must be an integer >= 0, got {text!r}")
    return int(text)


def _region_model(region: ShardedCollective | None, model: nn.Module) -> bool:
    """Whether ``model`` is sharded with FSDP2 (`dreamp2p.sync.model.shardlocal`); in a region of many ranks, a
    model neither DDP nor FSDP2 is refused, and an FSDP2 one makes each rank average its own shards."""
    sharded = is_sharded(model)
    if region is not None and not (sharded or isinstance(model, DistributedDataParallel)):
        raise ValueError(
            "in a region of many ranks, wrap the model in torch.nn.parallel.DistributedDataParallel or shard it "
            "with torch.distributed.fsdp.fully_shard before attach: the ranks average their gradients with it "
            "every step, the WAN rounds only between regions"
        )
    if region is not None and sharded:
        region.own_shards()  # each rank averages its own shards over its ring, nothing gathered
    return sharded


def _outer_defaults(cfg: SyncConfig, optimizer: torch.optim.Optimizer) -> SyncConfig:
    """Resolve the outer optimizer left unset from the inner one, and warn about a known bad pairing."""
    resolved = cfg.with_outer_defaults(is_adaptive(optimizer))
    if cfg.strategy in ("diloco", "streaming"):
        lr, momentum = resolved.outer
        log.info(
            "%s outer optimizer: lr %g, momentum %g (%s for a %s inner optimizer)",
            cfg.strategy,
            lr,
            momentum,
            "set" if cfg.outer_lr is not None else "default",
            type(optimizer).__name__,
        )
        if momentum > 0 and not is_adaptive(optimizer) and inner_momentum(optimizer) > 0:
            log.warning(
                "%s: outer momentum %g over an inner %s with momentum %g compounds two momenta and "
                "usually overshoots; outer_lr = 1, outer_momentum = 0 (the default for SGD) suits it",
                cfg.strategy,
                momentum,
                type(optimizer).__name__,
                inner_momentum(optimizer),
            )
    return resolved


def _join_deadline(timeout: float, heartbeat_s: float) -> tuple[float, float]:
    """How long one wait of a join may last (``timeout``, at least ten heartbeats) and when it ends."""
    limit = max(timeout, 10 * heartbeat_s)
    return limit, time.monotonic() + limit


def _join_pause(heartbeat_s: float) -> None:
    """The pause between two looks while joining: a quarter heartbeat, so a change is seen soon after."""
    time.sleep(max(0.05, heartbeat_s / 4))


def _loader(strategy: Strategy) -> Callable[[Any, int], None]:
    """How a rank other than local rank 0 loads the state local rank 0 fetched, and starts at its step."""

    def load(state: Any, step: int) -> None:
        strategy.load_state_dict(state)
        strategy.jump_to(step)

    return load
