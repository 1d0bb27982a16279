"""The command line: every subcommand's last line is JSON (or a readable report), errors are clear."""

from __future__ import annotations

import asyncio
import fcntl
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import dreamp2p
from dreamp2p.cli import build_parser, main
from dreamp2p.config import PeerConfig, PeerInfo
from dreamp2p.peer import Peer


def last_json(out: str) -> dict[str, object]:
    return json.loads(out.strip().splitlines()[-1])


def test_plan_prefers_dreamddp(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["plan", "--params", "1e8", "--layers", "24", "--step-time", "0.5", "--peers", "4"]
    assert main([*args, "--link", "1gbit", "--rtt", "80ms", "--max-delay", "3", "--json"]) == 0
    result = last_json(capsys.readouterr().out)
    preds = result["predictions"]
    assert isinstance(preds, dict)
    best = min(preds, key=lambda k: preds[k]["step_time_s"])
    assert preds["dreamddp"]["step_time_s"] <= preds[best]["step_time_s"] + 1e-9
    assert preds["ssgd"]["bytes_per_step"] > preds["dreamddp"]["bytes_per_step"]


def test_bench_codec_small(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "codec", "--json", "--mbytes", "1", "--repeats", "1", "--codecs", "int8", "int4"]) == 0
    result = last_json(capsys.readouterr().out)
    codecs = result["codecs"]
    assert isinstance(codecs, dict) and set(codecs) == {"int8", "int4"}
    assert codecs["int4"]["ratio"] > codecs["int8"]["ratio"] > 3


def test_bad_arguments_give_clear_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--params", "1e8", "--layers", "4", "--step-time", "1", "--link", "fast"]) == 1
    assert "cannot parse link rate 'fast'" in capsys.readouterr().err


async def status_cli(*args: str) -> tuple[int, bytes, bytes]:
    """Run `dreamp2p status ARGS` in a child process; (exit code, stdout, stderr)."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "dreamp2p.cli", "status", *args, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode is not None
    return proc.returncode, out, err


async def test_status_command_against_a_live_peer() -> None:
    peer = Peer(PeerConfig(node_id="eu-west", token="tok"))
    await peer.start()
    try:
        await peer.connect([PeerInfo("eu-west", peer.address)])
        code, out, err = await status_cli(peer.address, "--token", "tok")
        assert code == 0, err.decode()
        text = out.decode()
        assert "node eu-west" in text and "ring: eu-west" in text
        code, _, err = await status_cli(peer.address, "--token", "wrong")
        assert code == 1 and b"BAD_TOKEN" in err
    finally:
        await peer.close()


PLAN = ["plan", "--params", "1e8", "--layers", "24", "--step-time", "0.5"]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--period", "10", "--max-delay", "10"], "--max-delay (10) must be less than --period (10)"),
        (["--period", "4", "--max-delay", "9"], "--max-delay (9) must be less than --period (4)"),
        (["--max-delay", "-1"], "argument --max-delay: must be >= 0, got -1"),
        (["--period", "0"], "argument --period: must be >= 1, got 0"),
        (["--peers", "0"], "argument --peers: must be >= 1, got 0"),
    ],
)
def test_plan_refuses_invalid_options_with_a_usage_error(
    capsys: pytest.CaptureFixture[str], extra: list[str], message: str
) -> None:
    with pytest.raises(SystemExit) as info:
        main([*PLAN, *extra])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "dreamp2p plan: error: " in err and message in err, err


def test_bench_strategies_refuses_a_delay_of_a_whole_period(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["bench", "strategies", "--period", "5", "--max-delay", "5"])
    assert info.value.code == 2
    assert "--max-delay (5) must be less than --period (5)" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("address", "message"),
    [
        ("localhost", "address 'localhost' has no port; use HOST:PORT"),
        ("10.0.0.5", "address '10.0.0.5' has no port; use HOST:PORT"),
        ("[::1]", "address '[::1]' has no port; use [IPV6]:PORT"),
        ("::1", "put an IPv6 address in brackets"),
        (":7070", "address ':7070' has no host"),
        ("localhost:0", "port must be a number in 1..65535, got '0'"),
        ("localhost:http", "port must be a number in 1..65535, got 'http'"),
    ],
)
def test_status_refuses_an_address_without_a_port(
    capsys: pytest.CaptureFixture[str], address: str, message: str
) -> None:
    # gRPC would quietly dial port 443 for a bare host
    with pytest.raises(SystemExit) as info:
        main(["status", address])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "dreamp2p status: error: argument address: " in err and message in err, err


@pytest.mark.skipif(not hasattr(fcntl, "F_SETPIPE_SZ"), reason="needs Linux pipe resizing")
def test_a_closed_stdout_pipe_ends_the_cli_quietly() -> None:
    # `dreamp2p plan ... | head -1`: a pipe of one page (4 KiB) that the reader closes after one line, while
    # the CLI still has several KiB to write, so the write certainly hits the closed pipe
    plan = ["plan", "--params", "1e8", "--layers", "100", "--step-time", "0.5", "--peers", "1"]  # ~7 KB
    read_fd, write_fd = os.pipe()
    try:
        fcntl.fcntl(write_fd, fcntl.F_SETPIPE_SZ, 4096)
        proc = subprocess.Popen([sys.executable, "-m", "dreamp2p.cli", *plan], stdout=write_fd, stderr=subprocess.PIPE)
    finally:
        os.close(write_fd)
    try:
        line = b""
        while not line.endswith(b"\n"):
            byte = os.read(read_fd, 1)
            assert byte, "the CLI closed stdout before writing a line"
            line += byte
    finally:
        os.close(read_fd)
    _, err = proc.communicate(timeout=60)
    assert line.split() == [b"strategy", b"step", b"s", b"utilization", b"MB/step"]
    assert proc.returncode == 141, err.decode()  # 128 + SIGPIPE, as a C tool killed by the signal reports
    assert err == b"", err.decode()  # no traceback, no "Broken pipe"


NETNS_SCRIPT = Path(__file__).resolve().parents[2] / "deploy" / "netns-wan.sh"


def _namespaces(prefix: str) -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30, check=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(prefix)]


@pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root")
def test_sigterm_to_a_bench_removes_the_namespaces_it_made() -> None:
    """SIGTERM unwinds a bench like Ctrl-C: its shaped namespaces and child processes do not outlive it."""
    assert not _namespaces("dp2pbench"), "namespaces left from an earlier run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "dreamp2p.cli", "bench", "transport", "--netns", "--seconds", "120", "--json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        for _ in range(600):  # the namespaces come up once the bench has started
            if len(_namespaces("dp2pbench")) == 2 or proc.poll() is not None:
                break
            subprocess.run(["sleep", "0.1"], check=True)
        assert len(_namespaces("dp2pbench")) == 2, proc.stderr.read().decode() if proc.poll() is not None else ""
        proc.terminate()
        assert proc.wait(60) == 128 + 15
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        left = _namespaces("dp2pbench")
        if left:  # leave the machine clean for the next run whatever happened
            subprocess.run(
                ["bash", str(NETNS_SCRIPT), "down", "--prefix", "dp2pbench"],
                capture_output=True,
                timeout=60,
                check=False,
            )
    assert left == []


def test_python_dash_m_and_version() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "dreamp2p", "--version"], capture_output=True, text=True, timeout=60, check=False
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"dreamp2p {dreamp2p.__version__} (wire protocol {dreamp2p.PROTOCOL_VERSION})"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["demo", "--strategy", "foo"], "argument --strategy: invalid choice: 'foo' (choose from none, ssgd,"),
        (["demo", "--codec", "int3"], "argument --codec: invalid choice: 'int3' (choose from fp32,"),
    ],
)
def test_demo_refuses_bad_values_before_starting_anything(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        main(args)
    assert info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    ("args", "verbose"),
    [(["plan", "--table"], 0), (["-v", "plan", "--table"], 1), (["plan", "-v", "--table"], 1), (["plan", "-vv"], 2)],
)
def test_verbose_is_taken_before_or_after_the_subcommand(args: list[str], verbose: int) -> None:
    assert build_parser().parse_args(args).verbose == verbose
