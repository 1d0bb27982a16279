"""Fast abort (issue 14): a member killed mid-round fails the rounds that need it at once, not at their deadline.

4 trainer processes with ``round_timeout_s`` 120; one, whose sends are rate-limited so that rounds with
it are always in flight, is killed with SIGKILL. Each survivor reports why each of its rounds failed, and
whether it failed by running out of its deadline: the survivors must make 25 more steps with no round
failed by deadline (a round that waited out its 120 s would be recorded so), and the victim's departure
(or the view change it caused) must be named. The scenario's time limit only guards against a hang; it
is generous so that a loaded host cannot fail the test by slowness alone.
"""

from __future__ import annotations

import pytest

from dreamp2p.devtools.faults import kill_and_rejoin

ROUND_TIMEOUT_S = 120.0
HANG_GUARD_S = 600.0  # a hang, not a bound: the deadline records below decide
SURVIVORS = (0, 1, 2)
VICTIM_RATE_BPS = 200_000.0


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_kill_one_of_four_mid_round_survivors_go_on_before_the_round_timeout() -> None:
    rep = kill_and_rejoin(
        n=4,
        victim=3,
        kill_at=30,
        progress=25,
        after_join=20,
        transport={"round_timeout_s": ROUND_TIMEOUT_S},
        timeout=HANG_GUARD_S,
        rejoin=False,
        # the victim sends slowly, so rounds with it are open whenever it is killed
        victim_transport={"rate_limit": VICTIM_RATE_BPS},
    )
    # kill_and_rejoin raises unless every survivor made `progress` more steps
    assert all(rep.survivor_steps_after_kill[r] >= rep.steps_at_kill[r] + 25 for r in SURVIVORS), rep
    failures = {r: rep.results[r]["failures"] for r in SURVIVORS}
    # rounds with the victim were in flight (it was killed mid-run); they failed because it left (named,
    # or the members' views of who is alive differed for a moment), or by a survivor's failed vote...
    reasons = [reason for r in SURVIVORS for _, reason, _ in failures[r]]
    assert reasons, "no round with the victim was in flight when it was killed"
    assert any("p3" in reason or "VIEW_MISMATCH" in reason for reason in reasons), failures
    # ...and none by running out of time
    assert not [f for r in SURVIVORS for f in failures[r] if f[2]], failures
    # all-or-none: a round that failed on one survivor failed on every survivor
    failed_keys = [{tuple(key) for key, _, _ in failures[r]} for r in SURVIVORS]
    assert failed_keys[0] == failed_keys[1] == failed_keys[2], failures
    # the survivors trained on among themselves to the same step with identical parameters
    assert len({rep.results[r]["step"] for r in SURVIVORS}) == 1
    assert len({rep.results[r]["digest"] for r in SURVIVORS}) == 1, [rep.results[r]["digest"][:12] for r in SURVIVORS]
    assert all(rep.results[r]["view_changes"] >= 1 for r in SURVIVORS)
