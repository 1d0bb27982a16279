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

import math
import os
import subprocess
import threading
import time
from pathlib import Path

import pytest

from dreamp2p.devtools.launch import run_local
from dreamp2p.devtools.netns import Namespaces

JOB = "dreamp2p.devtools.bench.training:train_job"


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
        sync = {"period": 5, "warmup_steps": 60, "control_every": 5, "max_delay": 2}
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
    # one plan in force everywhere, and identical replicas after the quiet stretch at the end
    assert len({tuple(r["plan_history"][-1]) for r in results}) == 1, [r["plan_history"] for r in results]
    assert len({r["digest"] for r in results}) == 1
