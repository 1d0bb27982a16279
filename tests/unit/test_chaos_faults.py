"""`bench chaos`'s faults on a cluster and a network stood in for: each action done, recorded and undone, flaps
cutting the cluster in halves, and which kinds a run without root or with few members leaves out."""

from __future__ import annotations

import subprocess
from typing import Any

import pytest

from dreamp2p.devtools.bench.chaos.faults import FLAP_LAYER, Flapper, Injector, Span
from dreamp2p.devtools.bench.chaos.plan import FAULT_KINDS, Action, ChaosTiming, Fault, KillOutcome
from dreamp2p.devtools.bench.chaos.report import Off, fault_log
from dreamp2p.devtools.bench.chaos.run import ChaosRun, off_reasons, run_timing

MEMBERS = ["a", "b", "c", "d", "e"]


class FakeCluster:
    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []
        self.frozen: set[str] = set()
        self.started_at: dict[str, float] = {}
        self.clock = 100.0

    def _t(self, what: str, member: str) -> float:
        self.calls.append((what, member))
        self.clock += 1.0
        return self.clock

    def start(self, member: str, join: bool = False) -> None:
        self.started_at[member] = self._t("start", member)

    def kill(self, member: str) -> float:
        return self._t("kill", member)

    def freeze(self, member: str) -> float:
        self.frozen.add(member)
        return self._t("freeze", member)

    def thaw(self, member: str) -> float:
        self.frozen.discard(member)
        return self._t("thaw", member)

    def thaw_all(self) -> None:
        for m in sorted(self.frozen):
            self.thaw(m)


class FakeNet:
    """Blocking rules as a set of (src, dst) ranks per layer (``rules``: layer 0's, the partitions'); ``fail_after``
    blocks make the next one fail half-way. ``emulated``: paths through the packet emulator (no star to split)."""

    def __init__(self, n: int = 5, fail_after: int | None = None, emulated: bool = False) -> None:
        self.n = n
        self.rules: set[tuple[int, int]] = set()
        self.layers: dict[int, set[tuple[int, int]]] = {0: self.rules}
        self.fail_after = fail_after
        self.events: list[str] = []
        self.emulator = object() if emulated else None

    def block(self, src: list[int], dst: list[int], layer: int = 0) -> None:
        rules = self.layers.setdefault(layer, set())
        for j in dst:
            for i in src:
                if self.fail_after is not None and len(self.rules) >= self.fail_after:
                    raise subprocess.CalledProcessError(2, ["ip", "rule", "add"])
                if (i, j) in rules:
                    raise subprocess.CalledProcessError(2, ["ip", "rule", "add"])  # RTNETLINK: File exists
                rules.add((i, j))

    def unblock(self, src: list[int], dst: list[int], layer: int = 0) -> None:
        rules = self.layers.setdefault(layer, set())
        for j in dst:
            for i in src:
                if (i, j) not in rules:
                    raise subprocess.CalledProcessError(2, ["ip", "rule", "del"])
                rules.discard((i, j))

    def split(self, apart: list[int]) -> None:
        self.events.append(f"split {apart}")

    def join(self) -> None:
        self.events.append("join")


def injector(net: FakeNet | None = None) -> tuple[Injector, FakeCluster, FakeNet]:
    cluster, net = FakeCluster(), net or FakeNet()
    return Injector(cluster, net, MEMBERS), cluster, net  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("oneway", "rules"),
    [
        (True, {(i, j) for i in (1, 2) for j in (0, 3, 4)}),  # only the group's packets to the rest
        (False, {(i, j) for i in (1, 2) for j in (0, 3, 4)} | {(j, i) for i in (1, 2) for j in (0, 3, 4)}),
    ],
)
def test_a_partition_blocks_the_group_and_its_heal_removes_every_rule(
    oneway: bool, rules: set[tuple[int, int]]
) -> None:
    inj, _, net = injector()
    inj.do(Action("partition", group=("b", "c"), oneway=oneway), set(MEMBERS), {"b", "c"})
    assert net.rules == rules
    inj.do(Action("heal", group=("b", "c"), oneway=oneway), set(MEMBERS), {"e"})
    assert net.rules == set()
    (fault,) = inj.faults
    assert (fault.kind, fault.members, fault.others, fault.oneway) == ("partition", ("b", "c"), ("a", "d"), oneway)
    assert [(s.kind, s.members, s.end is not None) for s in inj.spans] == [("partition", ("b", "c"), True)]


@pytest.mark.parametrize(
    ("actions", "calls", "spans"),
    [
        (
            [Action("kill", "b"), Action("restart", "b")],
            [("kill", "b"), ("start", "b")],
            [("kill", ("b",), 101.0, 102.0)],
        ),
        (
            [Action("stop", "c", lasts_s=3.0), Action("cont", "c")],
            [("freeze", "c"), ("thaw", "c")],
            [("stop", ("c",), 101.0, 102.0)],
        ),
        (  # a restart after a crash closes no fault of ours
            [Action("restart", "d")],
            [("start", "d")],
            [],
        ),
    ],
)
def test_kills_and_freezes_reach_the_cluster_and_are_recorded(
    actions: list[Action], calls: list[tuple[str, str]], spans: list[tuple[Any, ...]]
) -> None:
    inj, cluster, _ = injector()
    for a in actions:
        inj.do(a, set(MEMBERS), set())
    assert cluster.calls == calls
    assert [(s.kind, s.members, s.start, s.end) for s in inj.spans] == spans
    assert inj.restarts == sum(1 for a in actions if a.kind == "restart")


def test_a_kill_counts_as_survivors_only_the_members_under_no_fault() -> None:
    inj, _, _ = injector()
    inj.do(Action("kill", "b"), {"a", "b", "c", "d"}, {"b", "c"})  # c frozen, e not training
    assert inj.kills[0].survivors == ("a", "d")


def test_a_stop_ending_records_who_trained_under_no_fault() -> None:
    inj, _, _ = injector()
    inj.do(Action("stop", "c"), set(MEMBERS), {"c"})
    inj.do(Action("cont", "c"), {"a", "b", "c", "d"}, {"d"})
    assert inj.faults == [Fault("stop", 101.0, 102.0, ("c",), ("a", "b"))]


@pytest.mark.parametrize("fail_after", [None, 0, 4])  # made whole, failed at once, failed half-way
def test_undo_all_thaws_and_heals_whatever_is_open(fail_after: int | None) -> None:
    inj, cluster, net = injector(FakeNet(fail_after=fail_after))
    inj.do(Action("stop", "d"), set(MEMBERS), {"d"})
    try:
        inj.do(Action("partition", group=("b",), oneway=False), set(MEMBERS), {"b", "d"})
    except subprocess.CalledProcessError:
        assert fail_after is not None
    inj.undo_all()
    assert cluster.frozen == set() and ("thaw", "d") in cluster.calls
    assert net.rules == set(), sorted(net.rules)
    inj.undo_all()  # twice: nothing left, nothing raised


def test_a_partition_without_namespaces_is_refused() -> None:
    inj = Injector(FakeCluster(), None, MEMBERS)  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="namespaces"):
        inj.do(Action("partition", group=("b",)), set(MEMBERS), set())
    with pytest.raises(ValueError, match="unknown action"):
        inj.do(Action("explode", "b"), set(MEMBERS), set())


def test_a_flap_cuts_the_star_in_halves_then_joins_it() -> None:
    net = FakeNet()
    flapper = Flapper(net, [5.0, 20.0], 3.0, half=[0, 1, 2])
    for t in (0.0, 5.0, 6.0, 8.0, 20.0):
        flapper.poll(t)
    assert net.events == ["split [0, 1, 2]", "join", "split [0, 1, 2]"]
    flapper.end()  # the flap under way ends
    assert net.events[-1] == "join" and len(flapper.done) == 2
    flapper.poll(100.0)
    assert len(flapper.done) == 2


def test_a_flap_through_the_emulator_blocks_the_halves_both_ways_beside_a_partition() -> None:
    """No star to split through the packet emulator: the flap drops what each half sends the other, in rules
    of its own layer, so a partition under way (layer 0) keeps its rules through the flap and after it."""
    net = FakeNet(emulated=True)
    net.block([4], [0, 1, 2, 3])  # a one-way partition of member 4, under way
    partition = set(net.rules)
    flapper = Flapper(net, [5.0], 3.0, half=[0, 1, 2])
    flapper.poll(5.0)
    halves = {(i, j) for i in (0, 1, 2) for j in (3, 4)} | {(j, i) for i in (0, 1, 2) for j in (3, 4)}
    assert net.layers[FLAP_LAYER] == halves and net.rules == partition
    flapper.poll(8.0)
    assert net.layers[FLAP_LAYER] == set() and net.rules == partition and net.events == []
    assert len(flapper.done) == 1


def test_no_namespaces_no_flaps() -> None:
    flapper = Flapper(None, [1.0], 3.0, half=[0])
    flapper.poll(2.0)
    flapper.end()
    assert flapper.done == []


@pytest.mark.parametrize("min_step_s", [-0.1, 60.0])
def test_a_step_floor_outside_0_to_60_seconds_is_refused(min_step_s: float) -> None:
    with pytest.raises(ValueError, match=r"min_step_s must be in \[0, 60\) seconds"):
        ChaosRun(min_step_s=min_step_s)


def run_with(kinds: tuple[str, ...] = FAULT_KINDS, nodes: int = 5, flaps: bool = True) -> ChaosRun:
    return ChaosRun(nodes=nodes, timing=ChaosTiming(max_down=1, kinds=kinds), flaps=flaps)


@pytest.mark.parametrize(
    ("run", "missing", "off", "kinds"),
    [
        (run_with(), None, Off(None, None), FAULT_KINDS),
        (run_with(), "not root", Off("not root", "not root"), ("kill", "stop")),
        (run_with(flaps=False), None, Off("disabled (--no-flaps)", None), FAULT_KINDS),
        (run_with(flaps=False), "not root", Off("disabled (--no-flaps)", "not root"), ("kill", "stop")),
        (run_with(("kill",)), None, Off(None, "not in --kinds"), ("kill",)),
        (run_with(("partition",)), "not root", Off("not root", "not root"), ()),
        (run_with(nodes=2), None, Off(None, "no minority group to cut off: needs 3 members or more"), ("kill", "stop")),
    ],
)
def test_what_a_run_leaves_out(run: ChaosRun, missing: str | None, off: Off, kinds: tuple[str, ...]) -> None:
    assert off_reasons(run, missing) == off
    assert run_timing(run.timing, off).kinds == kinds


def test_the_shipped_run_draws_every_kind_with_long_freezes() -> None:
    timing = ChaosRun().timing
    assert timing.kinds == FAULT_KINDS and timing.long_stop_p > 0 and timing.long_stop_max_s >= 180.0


def test_fault_log_in_order_with_each_recovery() -> None:
    spans = [
        Span("kill", ("b",), 105.0, 110.0),
        Span("partition", ("c", "d"), 112.0, 120.0, oneway=True),
        Span("stop", ("e",), 125.0, None),
    ]
    log = fault_log(spans, 100.0, [KillOutcome(1.5, 2.0)], {("partition", 112.0): 0.75})
    assert log == [
        {"kind": "kill", "members": ["b"], "t": 5.0, "end": 10.0, "recovery_s": 1.5},
        {"kind": "partition", "members": ["c", "d"], "t": 12.0, "end": 20.0, "recovery_s": 0.75, "oneway": True},
        {"kind": "stop", "members": ["e"], "t": 25.0, "end": None, "recovery_s": None},
    ]
