"""A partition during which the two sides decide different DreamDDP plans, then heals (issue 14).

Three regions in network namespaces (a star through a bridge, tbf-shaped); region 2's link goes down as
training starts, before the first measured plan: region 2 plans alone and regions 0 and 1 plan together,
so each side adopts its own plan v1. No round between the sides can complete after the link returns
(different schedules, different round groups): without help the side whose rounds wait for the other
stands still until its round deadline. What must happen instead: the side with the lesser plan notices it
from the others' heartbeat answers, stands aside, takes their state and trains on with them, and every
member ends with the same plan and the same parameters.

The round deadline (20 s) is far above a round here (milliseconds) but within the test's time: after the
heal, a round of the member that served the state can still be held by a member that jumped past it until
that deadline (an open gap, noted on issue 14), and the member left behind meanwhile may then take the
state of the members ahead too (`peer.drift`'s lag rule), so more than one side may resync. Needs root.
"""

from __future__ import annotations

import itertools
import math
import os
import subprocess
import threading
import time
from pathlib import Path

import pytest

from dreamp2p.devtools.launch import run_local
from dreamp2p.devtools.netns import Namespaces

JOB = "dreamp2p.devtools.bench.jobs.training:train_job"


@pytest.mark.slow
@pytest.mark.netns
@pytest.mark.timeout(360)
@pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root")
@pytest.mark.parametrize("comm", ["thread", "process"])
def test_sides_that_planned_apart_converge_on_one_plan_after_the_heal(tmp_path: Path, comm: str) -> None:
    started = tmp_path / "started"
    timeline: dict[str, float] = {}
    with Namespaces(3, "10mbit") as ns:
        hub_ns, far = f"{ns.prefix}-x", f"{ns.prefix}-p2"

        def cut_link() -> None:
            deadline = time.monotonic() + 240
            while not all(Path(f"{started}.{r}").exists() for r in range(3)) and time.monotonic() < deadline:
                time.sleep(0.05)
            subprocess.run(["ip", "-n", hub_ns, "link", "set", far, "down"], check=True, timeout=30)
            timeline["down"] = time.time()
            # long enough to notice the loss (3 missed heartbeats) and for each side to plan alone
            time.sleep(25.0)
            subprocess.run(["ip", "-n", hub_ns, "link", "set", far, "up"], check=True, timeout=30)
            timeline["up"] = time.time()

        cutter = threading.Thread(target=cut_link, daemon=True)
        cutter.start()
        # the first measured plan comes after warm-up, i.e. while the link is down
        sync = {"period": 5, "warmup_steps": 60, "control_every": 5, "max_delay": 2, "max_stretch": 1}  # as quiet_steps
        results = run_local(
            3,
            JOB,
            {
                "strategy": "dreamddp",
                "steps": 900,
                "sync": sync,
                "step_sleep": 0.03,
                # the check every 4th period and the anchor it calls for in the period after fall inside
                "quiet_steps": 6 * sync["period"] + sync["max_delay"] + 1,
                "flush": True,
                "step_times": True,
                "started_file": str(started),
            },
            {"comm": comm, "transport": {"heartbeat_s": 0.5, "round_timeout_s": 20.0}},
            node_job=True,
            timeout=300,
            hosts=ns.hosts,
        )
        cutter.join(60)
    assert "down" in timeline and "up" in timeline, "the run ended before the link came back"
    resyncs = [r["resyncs"] for r in results]
    # a side yielded: region 2, or regions 0 and 1 (the two sides' plans cannot otherwise become one)
    assert resyncs[2] >= 1 or min(resyncs[:2]) >= 1, resyncs
    for r in results:
        assert all(math.isfinite(x) for x in r["losses"])
        assert any(t > timeline["up"] for t in r["step_times"]), "no training after the link healed"
    # one plan in force everywhere, and after the quiet stretch at the end one set of outer weights: flush()
    # went through its compressed path (taken only where they agree) and left identical replicas (the quiet
    # stretch alone leaves each the part of its 2-bit or sparse syncs they did not carry, keep_unsent)
    assert len({tuple(r["plan_history"][-1]) for r in results}) == 1, [r["plan_history"] for r in results]
    assert [r["flush_path"] for r in results] == ["compressed"] * 3
    assert len({r["digest"] for r in results}) == 1


@pytest.mark.slow
@pytest.mark.netns
@pytest.mark.timeout(400)
@pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root")
def test_a_2_plus_2_split_that_keeps_one_plan_heals_without_a_held_round(tmp_path: Path) -> None:
    """Issue 40, item 2: 4 regions split 2+2 while training, keep the same plan, heal.

    While apart, each side runs its own control rounds and their re-planning memories part. The model is wide
    (512) so that its syncs (over 256 KB) are paced: the first plan is made from that pace before any link is
    measured, and the goodput measured next lies far below it, on both sides alike, so every control round
    counts one more change (``replan_sustain`` is out of reach: no re-plan). The side whose link
    drops to 4 Mbit/s steps more slowly, runs fewer control rounds while apart, and ends the split with
    another count than the other side. (With the default tiny model no sync is paced and a busy link's
    goodput is measured once, so both sides saw the same thing, their memories stayed one, nothing needed
    healing, and the test asserted a resync that had no reason to happen: CI on 96827bd, [0, 0, 0, 0].)
    No plan tells the sides apart: before the fix each
    side then launched control rounds at steps the other skipped after the heal, and every member stood
    still until the round deadline, when sync.step() raised. Now the control memory is named in the
    heartbeats beside the plan, one side takes the other's state, and training goes on.
    """
    started = tmp_path / "started"
    timeline: dict[str, float] = {}
    round_timeout_s = 30.0
    with Namespaces(4, "20mbit") as ns:

        def split_and_heal() -> None:
            deadline = time.monotonic() + 240
            while not all(Path(f"{started}.{r}").exists() for r in range(4)) and time.monotonic() < deadline:
                time.sleep(0.05)
            time.sleep(6.0)  # the first measured plan is in force everywhere
            ns.split([2, 3])
            ns.set_rate([2, 3], "4mbit")
            timeline["down"] = time.time()
            time.sleep(20.0)  # several control rounds on each side
            ns.set_rate([2, 3], "20mbit")
            ns.join()
            timeline["up"] = time.time()

        cutter = threading.Thread(target=split_and_heal, daemon=True)
        cutter.start()
        # the quiet stretch assumes the configured period; int4 syncs throughout: the int2 fallback (issue 34)
        # halves them below the paced size this test needs (it failed 2 of 2 with it, passed without)
        sync = {"replan_sustain": 1_000_000, "max_stretch": 1, "delta_fallbacks": []}
        results = run_local(
            4,
            JOB,
            {
                "strategy": "dreamddp",
                "steps": 1000,
                "width": 512,
                "sync": sync,
                "step_sleep": 0.04,
                "quiet_steps": 60,
                "step_times": True,
                "started_file": str(started),
            },
            {"transport": {"round_timeout_s": round_timeout_s}},
            node_job=True,
            timeout=330,
            hosts=ns.hosts,
        )  # raises if sync.step() raised in any member
        cutter.join(60)
    assert "down" in timeline and "up" in timeline, "the run ended before the split healed"
    for r in results:
        stamps = r["step_times"]
        after = [b for b in stamps if b > timeline["up"]]
        assert len(after) >= 50, f"too little training after the heal to judge: {len(after)} steps"
        # a round held until its deadline shows as a gap of round_timeout_s between two steps
        held = max(b - a for a, b in itertools.pairwise(stamps) if b > timeline["up"])
        assert held < round_timeout_s, f"a step waited {held:.1f} s after the heal: a round was held to its deadline"
    # the sides' control schedules parted while apart (or the test proves nothing) and are one again: left
    # apart, each side's control rounds wait for members that never launch them
    assert len({r["next_control"] for r in results}) == 1, [r["next_control"] for r in results]
    resyncs = [r["resyncs"] for r in results]
    assert min(resyncs[:2]) >= 1 or min(resyncs[2:]) >= 1, resyncs  # one side took the other's state
    assert len({tuple(r["plan_history"][-1]) for r in results}) == 1, [r["plan_history"] for r in results]
    assert len({r["digest"] for r in results}) == 1
