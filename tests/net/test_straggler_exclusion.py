"""Stragglers (issue 14): a live member that holds rounds is left out of them, and comes back when it keeps up.

3 peer processes; p2's sends are paced to 100 kB/s from the start, so every round with it runs seconds
past its deadline (a floor of 1.5 s: the round's bytes at the others' loopback rate take milliseconds),
while ``round_timeout_s`` is 120 s, so no round runs out of time and only exclusion lets the others step
fast. After two such rounds every member excludes p2 (the same verdict from the same commit-vote
evidence); p0 and p1 keep stepping between themselves; once p0 counted enough rounds without p2 it writes
the control file that lifts p2's slowdown; after its probation p2 takes part again and keeps up. Bounds
are round counts. p2's steps drift from the others' while it runs its rounds alone, so its first rounds back
fail until the round ids meet again; their retries (round_retries 1, the default) must fail at once too
(`RoundRegistry` refuses frames of a retry that a member will never run), not wait out the 120 s.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from dreamp2p.devtools.launch import run_local

LIFT_AFTER = 10  # rounds p0 and p1 make without p2 before its slowdown is lifted
BACK = 5  # rounds with all three after p2's eviction (so after its return)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_slowed_member_is_excluded_the_others_step_and_it_returns(tmp_path: Path) -> None:
    transport = {
        "round_timeout_s": 120.0,
        "heartbeat_s": 0.5,
        "probe_interval_s": 1.0,
        "probe_burst_bytes": 32 << 10,
        "straggler_margin": 3.0,
        "straggler_floor_s": 1.5,
        "straggler_strikes": 2,
        "straggler_probation_s": 5.0,
    }
    results = run_local(
        3,
        "dreamp2p.devtools.stragglerjob:straggler_run",
        {
            "slow": 2,
            "control_dir": str(tmp_path),
            "numel": 64 << 10,
            "rate_Bps": 100_000.0,
            "lift_after": LIFT_AFTER,
            "back": BACK,
        },
        config={"transport": transport},
        timeout=240,
    )
    for rank, r in enumerate(results):
        # every member excluded p2 and let it back, and none is out at the end
        assert r["evictions"] >= 1 and r["returns"] >= 1, (rank, r)
        assert r["excluded"] == [], (rank, r)
        assert r["full_after_eviction"] >= BACK, (rank, r)
        # no round waited out its deadline: the slow rounds finished, the others went on without p2
        assert not [f for f in r["failures"] if f[2]], (rank, r["failures"])
    p0, p1, p2 = results
    # p0 and p1 kept stepping without p2 while it was out...
    assert p0["by_world"].get(2, 0) >= LIFT_AFTER and p1["by_world"].get(2, 0) >= LIFT_AFTER, (p0, p1)
    # ...the same rounds on both (all-or-none), and the same rounds with all three everywhere
    assert p0["by_world"].get(2) == p1["by_world"].get(2)
    assert p0["by_world"][3] == p1["by_world"][3] == p2["by_world"][3], results
    # p2 ran its rounds alone meanwhile, and its slowdown was lifted through the control file
    assert p2["by_world"].get(1, 0) >= 1 and p2["lifted_at"] > 0, p2
