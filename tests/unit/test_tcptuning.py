"""Streams per link from RTT, rate, loss and the kernel's window; the warning when TCP caps a link; /proc reading."""

from __future__ import annotations

import logging
import math
from pathlib import Path

import pytest

from dreamp2p.transport.linkrate.kernelnet import KernelCheck, read_tcp_limits
from dreamp2p.transport.linkrate.linkstats import LinkEstimator
from dreamp2p.transport.linkrate.tcptuning import (
    MSS_BYTES,
    TcpLimits,
    buffer_for,
    cap_warning,
    choose_streams,
    mathis_rate_Bps,
    per_flow_rate_Bps,
    sysctl_lines,
    window_rate_Bps,
)

MiB = 1 << 20
MBIT = 1e6 / 8  # bytes/s per Mbit/s


def limits(buf: int = 4 * MiB, congestion: str = "cubic", available: tuple[str, ...] = ("reno", "cubic")) -> TcpLimits:
    return TcpLimits(buf, buf, buf, buf, congestion, available)


@pytest.mark.parametrize(
    ("rtt_s", "loss", "expected_Bps"),
    [
        (0.1, 0.0, math.inf),
        (0.1, 0.01, MSS_BYTES / 0.1 * 1.2247 / 0.1),  # 1.45 Mbit/s: 1% loss at 100 ms
        (0.1, 0.001, MSS_BYTES / 0.1 * 1.2247 / math.sqrt(0.001)),
        (0.01, 0.001, MSS_BYTES / 0.01 * 1.2247 / math.sqrt(0.001)),  # ten times more at a tenth of the RTT
    ],
)
def test_mathis_bound(rtt_s: float, loss: float, expected_Bps: float) -> None:
    assert mathis_rate_Bps(rtt_s, loss) == pytest.approx(expected_Bps, rel=1e-3)


@pytest.mark.parametrize(
    ("rtt_s", "rate_mbit", "loss", "window", "loss_based", "expected"),
    [
        (0.002, 100, 0.0, 2 * MiB, True, 1),  # a short path: one connection fills it
        (0.1, 100, 0.0, 2 * MiB, True, 1),  # 2 MiB / 100 ms = 168 Mbit/s per connection
        (0.1, 1000, 0.0, 2 * MiB, True, 6),  # 1 Gbit/s / 168 Mbit/s -> 6
        (0.1, 1000, 0.0, 32 * MiB, True, 1),  # a 64 MiB buffer: one connection carries 2.7 Gbit/s
        (0.1, 20, 0.001, 2 * MiB, True, 5),  # cubic at 0.1%: Mathis 4.49 Mbit/s a connection, 20 / 4.49 -> 5
        (0.1, 100, 0.001, 2 * MiB, True, 16),  # 100 / 4.49 -> 23, bounded by 16
        (0.1, 100, 0.001, 2 * MiB, False, 1),  # BBR: only the window bounds it
        (0.1, 1000, 0.01, 2 * MiB, True, 16),  # 1% loss under cubic: bounded by 16
        (0.3, 10_000, 0.0, 64 * 1024, False, 16),  # a tiny window on a long fat path: bounded by 16
    ],
)
def test_choose_streams(
    rtt_s: float, rate_mbit: float, loss: float, window: int, loss_based: bool, expected: int
) -> None:
    got = choose_streams(rtt_s, rate_mbit * MBIT, loss, window, loss_based=loss_based)
    assert got == expected
    flow = per_flow_rate_Bps(rtt_s, loss, window, loss_based=loss_based)
    if 1 < got < 16:  # just enough: one fewer would not reach the rate
        assert got * flow >= rate_mbit * MBIT > (got - 1) * flow


def test_cubic_at_a_tenth_of_a_percent_needs_more_than_bbr() -> None:
    flow = mathis_rate_Bps(0.1, 0.001)
    assert flow == pytest.approx(MSS_BYTES / 0.1 * 1.2247 / math.sqrt(0.001), rel=1e-3)
    assert flow * 8 / 1e6 == pytest.approx(4.49, rel=0.01)  # Mbit/s per connection
    # 100 Mbit/s / 4.49 = 22.3 connections; the window (168 Mbit/s) is not the bound there
    assert choose_streams(0.1, 100 * MBIT, 0.001, 2 * MiB, hi=64) == 23


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"rtt_s": 0.0}, "rtt_s"),
        ({"rtt_s": math.nan}, "rtt_s"),
        ({"rate_Bps": 0.0}, "rate_Bps"),
        ({"rate_Bps": math.inf}, "rate_Bps"),
        ({"loss": 1.0}, "loss"),
        ({"loss": -0.1}, "loss"),
        ({"window_bytes": 0}, "window_bytes"),
        ({"lo": 0}, "lo"),
        ({"lo": 5, "hi": 4}, "lo"),
    ],
)
def test_choose_streams_refuses_bad_inputs(kwargs: dict[str, float], match: str) -> None:
    args: dict[str, float] = {"rtt_s": 0.1, "rate_Bps": 1e6, "loss": 0.0, "window_bytes": MiB} | kwargs
    with pytest.raises(ValueError, match=match):
        choose_streams(**args)  # type: ignore[arg-type]


def test_window_and_buffer_arithmetic() -> None:
    assert window_rate_Bps(2 * MiB, 0.1) == pytest.approx(20.97e6, rel=1e-3)
    assert limits(4 * MiB).window_bytes == 2 * MiB
    assert TcpLimits(6 * MiB, 4 * MiB, MiB, MiB, "bbr").window_bytes == 2 * MiB  # the smaller ceiling
    assert buffer_for(1000 * MBIT, 0.1, 1) == 32 * MiB  # 2 x 12.5 MB, rounded up to a power of two
    assert buffer_for(1000 * MBIT, 0.1, 8) == 4 * MiB
    with pytest.raises(ValueError, match="tcp_wmem_max"):
        TcpLimits(MiB, 0, MiB, MiB, "cubic")


@pytest.mark.parametrize(
    ("lim", "rtt_s", "rate_mbit", "streams", "loss", "warns", "names"),
    [
        # 4 MiB buffers (the kernel default for tcp_wmem): 168 Mbit/s per connection at 100 ms
        (limits(4 * MiB, "bbr", ("bbr",)), 0.1, 160, 1, 0.0, True, "tcp_wmem max 4194304"),
        (limits(4 * MiB, "bbr", ("bbr",)), 0.1, 100, 1, 0.0, False, ""),  # below 80% of the cap
        (limits(4 * MiB, "bbr", ("bbr",)), 0.1, 160, 2, 0.0, False, ""),  # two connections: 336 Mbit/s
        (limits(64 * MiB, "bbr", ("bbr",)), 0.1, 900, 1, 0.0, False, ""),  # the deploy file's buffers
        (limits(256 * 1024, "bbr", ("bbr",)), 0.05, 20, 1, 0.0, True, "window per connection"),
        # cubic at 0.1% loss: 4.5 Mbit/s per connection at 100 ms, whatever the buffers
        (limits(64 * MiB), 0.1, 8.5, 2, 0.001, True, "cubic's back-off"),
        (limits(64 * MiB), 0.1, 8.5, 4, 0.001, False, ""),
    ],
)
def test_cap_warning(
    lim: TcpLimits, rtt_s: float, rate_mbit: float, streams: int, loss: float, warns: bool, names: str
) -> None:
    text = cap_warning(lim, rtt_s, rate_mbit * MBIT, streams, loss, peer="r2")
    assert (text is not None) == warns
    if text is not None:
        assert names in text and text.startswith("r2 measured")
        assert "90-dreamp2p.conf" in text


def test_the_warning_carries_the_sysctl_lines_that_lift_the_cap() -> None:
    text = cap_warning(limits(4 * MiB, "cubic", ("reno", "cubic")), 0.1, 160 * MBIT, 1)
    assert text is not None
    for line in (
        "sysctl -w net.core.rmem_max=67108864",
        "sysctl -w net.ipv4.tcp_wmem='4096 65536 67108864'",
        "modprobe tcp_bbr",  # cubic, BBR not loaded
        "sysctl -w net.ipv4.tcp_congestion_control=bbr",
    ):
        assert line in text


@pytest.mark.parametrize(
    ("lim", "expected"),
    [
        (limits(4 * MiB, "bbr", ("bbr",)), ["rmem_max", "wmem_max", "tcp_rmem", "tcp_wmem"]),
        (limits(64 * MiB, "bbr", ("bbr",)), []),
        (limits(64 * MiB, "cubic", ("cubic", "bbr")), ["default_qdisc", "tcp_congestion_control"]),
        (limits(64 * MiB, "cubic", ("cubic",)), ["modprobe", "default_qdisc", "tcp_congestion_control"]),
    ],
)
def test_sysctl_lines(lim: TcpLimits, expected: list[str]) -> None:
    lines = sysctl_lines(lim, 64 * MiB)
    assert len(lines) == len(expected)
    for line, key in zip(lines, expected, strict=True):
        assert key in line


def _proc(tmp_path: Path, wmem: str = "4096\t16384\t4194304\n") -> Path:
    for rel, text in {
        "net/ipv4/tcp_rmem": "4096\t131072\t33554432\n",
        "net/ipv4/tcp_wmem": wmem,
        "net/core/rmem_max": "4194304\n",
        "net/core/wmem_max": "4194304\n",
        "net/ipv4/tcp_congestion_control": "cubic\n",
        "net/ipv4/tcp_available_congestion_control": "reno cubic\n",
    }.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    return tmp_path


def test_read_tcp_limits(tmp_path: Path) -> None:
    got = read_tcp_limits(_proc(tmp_path))
    assert got == TcpLimits(33554432, 4194304, 4194304, 4194304, "cubic", ("reno", "cubic"))
    assert read_tcp_limits(_proc(tmp_path / "bad", wmem="4096\n")) is None  # unreadable: no check, no error
    assert read_tcp_limits(tmp_path / "missing") is None


def test_the_node_side_check_logs_one_warning_per_link(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    check = KernelCheck(read_tcp_limits(_proc(tmp_path)))
    stats = LinkEstimator()
    stats.observe_rtt(0.1)
    stats.observe_transfer(int(19e6), 1.0)  # 152 Mbit/s: at the 2 MiB window's 168 Mbit/s
    with caplog.at_level(logging.WARNING, logger="dreamp2p.transport.linkrate.kernelnet"):
        assert check.check("r1", stats, streams=1) is not None
        assert check.check("r1", stats, streams=1) is None  # once per link
        assert check.check("r2", stats, streams=4) is None  # four connections: far from their ceiling
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and warnings[0].startswith("r1 measured 152 Mbit/s at 100 ms RTT")
