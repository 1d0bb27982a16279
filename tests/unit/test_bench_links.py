"""How `bench lm` emulates its links (issue 37): the packet emulator as root when a round trip, jitter or
loss is asked for, tbf without them, in process without root; loss and jitter refused in process."""

from __future__ import annotations

import pytest

from dreamp2p.devtools.bench.lm import links
from dreamp2p.devtools.bench.lm.links import choose_shaping, stats_delta


def as_root(monkeypatch: pytest.MonkeyPatch, root: bool) -> None:
    monkeypatch.setattr(links.os, "geteuid", lambda: 0 if root else 1000)


@pytest.mark.parametrize(
    ("root", "netns", "rtt_ms", "loss", "regions", "expected"),
    [
        (True, None, 80.0, 0.0, 2, ("wanemu", {})),
        (True, None, 0.0, 0.001, 3, ("wanemu", {})),
        (True, None, 0.0, 0.0, 2, ("tbf", {"delay_s": 0.0})),
        (True, None, 80.0, 0.0, 1, ("tbf", {"delay_s": 0.04})),  # one region: no path to emulate
        (True, False, 80.0, 0.0, 2, ("in-process", {"delay_s": 0.04, "rate_limit": 2.5e6})),
        (False, None, 80.0, 0.0, 2, ("in-process", {"delay_s": 0.04, "rate_limit": 2.5e6})),
    ],
)
def test_lm_shaping(
    monkeypatch: pytest.MonkeyPatch,
    root: bool,
    netns: bool | None,
    rtt_ms: float,
    loss: float,
    regions: int,
    expected: tuple[str, dict[str, float]],
) -> None:
    as_root(monkeypatch, root)
    rate_Bps, how, transport = choose_shaping("20mbit", netns, rtt_ms, loss, 0.0, regions)
    assert rate_Bps == 2.5e6
    assert (how, transport) == expected


@pytest.mark.parametrize(("loss", "jitter_ms"), [(0.001, 0.0), (0.0, 5.0)])
def test_lm_refuses_loss_and_jitter_without_root(
    monkeypatch: pytest.MonkeyPatch, loss: float, jitter_ms: float
) -> None:
    as_root(monkeypatch, False)
    with pytest.raises(ValueError, match=r"loss and jitter need the packet emulator.*not root.*cannot lose"):
        choose_shaping("20mbit", None, 80.0, loss, jitter_ms)
    as_root(monkeypatch, True)
    with pytest.raises(ValueError, match="netns=False"):
        choose_shaping("20mbit", False, 80.0, loss, jitter_ms)


def test_lm_refuses_bad_loss_and_jitter(monkeypatch: pytest.MonkeyPatch) -> None:
    as_root(monkeypatch, True)
    with pytest.raises(ValueError, match="loss must be a fraction"):
        choose_shaping("20mbit", None, 0.0, 1.0)
    with pytest.raises(ValueError, match="jitter_ms must be >= 0"):
        choose_shaping("20mbit", None, 0.0, 0.0, -1.0)


def test_emulator_stats_delta() -> None:
    before = {
        "paths": [{"src": 0, "dst": 1, "in_pkts": 2, "in_bytes": 100, "queue_drops": 0, "lost": 0, "out_pkts": 2}],
        **{"cpu_s": 1.0, "user_s": 0.25, "sys_s": 0.75, "wakeups": 10},
    }
    after = {
        "paths": [{"src": 0, "dst": 1, "in_pkts": 5, "in_bytes": 400, "queue_drops": 1, "lost": 1, "out_pkts": 3}],
        **{"cpu_s": 1.5, "user_s": 0.5, "sys_s": 1.0, "wakeups": 14},
    }
    d = stats_delta(after, before)
    assert d["paths"] == [
        {"src": 0, "dst": 1, "in_pkts": 3, "in_bytes": 300, "queue_drops": 1, "lost": 1, "out_pkts": 1}
    ]
    assert (d["cpu_s"], d["user_s"], d["sys_s"], d["wakeups"]) == (0.5, 0.25, 0.25, 4)
