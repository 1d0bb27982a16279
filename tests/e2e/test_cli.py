"""The command line: every subcommand's last line is JSON (or a readable report), errors are clear."""

from __future__ import annotations

import asyncio
import datetime
import fcntl
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import make_certs, make_dated_cert, server_credentials_of
from grpc import aio

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


def test_plan_prices_the_codec_a_run_takes_on_the_link(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["plan", "--params", "3.32e6", "--layers", "4", "--step-time", "0.28", "--json"]
    # 1 Mbit/s: the sparse fallback, the one that lands fresh (bench lm measures the run behind it)
    for link, codec in (("1gbit", "int4"), ("1mbit", "topk")):
        assert main([*args, "--link", link]) == 0
        assert last_json(capsys.readouterr().out)["codec"] == codec, link
    assert main([*args, "--link", "1mbit", "--codec", "int4"]) == 0  # pinned: priced as given
    assert last_json(capsys.readouterr().out)["codec"] == "int4"


def test_bench_codec_small(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "codec", "--json", "--mbytes", "1", "--repeats", "1", "--codecs", "int8", "int4"]) == 0
    result = last_json(capsys.readouterr().out)
    codecs = result["codecs"]
    assert isinstance(codecs, dict) and set(codecs) == {"int8", "int4"}
    assert codecs["int4"]["ratio"] > codecs["int8"]["ratio"] > 3


@pytest.mark.parametrize("netns", [False, True], ids=["loopback", "tbf"])
def test_bench_allreduce_reports_cpu_per_round(netns: bool, capsys: pytest.CaptureFixture[str]) -> None:
    if netns and os.geteuid() != 0:
        pytest.skip("shaped namespaces need root")
    args = ["bench", "allreduce", "--json", "--peers", "2", "--mbytes", "0.5", "--repeats", "2", "--codecs", "int4"]
    assert main([*args, *(["--netns", "--rate", "100mbit"] if netns else [])]) == 0
    result = last_json(capsys.readouterr().out)
    assert result["netns"] is netns and result.get("rate") == ("100mbit" if netns else None)
    row = result["codecs"]["int4"]  # type: ignore[index]
    # each of 2 peers sends half the buffer twice (reduce-scatter, all-gather) at 4 bits plus a scale per 64
    assert row["wire_MB_per_peer"] == pytest.approx(0.5 / 7.11, rel=0.1)
    assert row["cpu_ms_per_round"] > 0 and row["tiny_cpu_ms_per_round"] > 0
    # both figures are rounded to 0.01 and the per-round one is then doubled: up to 0.015 apart
    assert row["cpu_ms_per_input_MB"] == pytest.approx(row["cpu_ms_per_round"] / 0.5, abs=0.02)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["plan", "--link", "fast"], "argument --link: cannot parse link rate 'fast'"),
        (["plan", "--link", "20mb"], "argument --link: cannot parse link rate '20mb'"),
        (["plan", "--rtt", "soon"], "argument --rtt: cannot parse duration 'soon'"),
        (["bench", "lm", "--rate", "fast"], "argument --rate: cannot parse link rate"),
        (["bench", "lm", "--rtt", "1d"], "argument --rtt: cannot parse duration '1d'"),
        (["bench", "codec", "--codecs", "int3"], "argument --codecs: invalid choice: 'int3' (choose from 'fp32',"),
        (["demo", "--link", "fast"], "argument --link: cannot parse link rate"),
        (["node", "--config", "x.toml", "--log-format", "xml"], "argument --log-format: invalid choice: 'xml'"),
    ],
)
def test_bad_values_are_usage_errors_before_anything_runs(
    capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    with pytest.raises(SystemExit) as info:
        main(
            [
                *args[:1],
                *(["--params", "1e8", "--layers", "4", "--step-time", "1"] if args[0] == "plan" else []),
                *args[1:],
            ]
        )
    assert info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    "args",
    [
        ["plan", "--link", "20Mbit/s", "--rtt", "0.1s"],
        ["plan", "--link", "2.5MB/s", "--rtt", "1m"],
        ["plan", "--link", "100kbit", "--rtt", "80ms"],
    ],
)
def test_rates_and_durations_in_every_spelling(args: list[str]) -> None:
    parsed = build_parser().parse_args([*args[:1], "--params", "1e8", "--layers", "4", "--step-time", "1", *args[1:]])
    assert parsed.link == args[2] and parsed.rtt == args[4]  # checked, and kept as written for the report


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


async def test_status_of_an_unreachable_peer_says_the_grpc_status_plainly() -> None:
    code, out, err = await status_cli("127.0.0.1:1")
    text = err.decode()
    assert code == 1 and out == b""
    assert text.startswith("dreamp2p: error: UNAVAILABLE: failed to connect"), text
    assert "UNSPECIFIED" not in text


def _expired_pki(tmp_path: Path) -> tuple[dict[str, str], dict[str, str]]:
    """The cluster's CA with a good certificate, and one of that CA that expired in 2020."""
    start = datetime.datetime(2020, 1, 1, tzinfo=datetime.UTC)
    return make_certs(tmp_path), make_dated_cert(tmp_path, "expired", start, start + datetime.timedelta(days=1))


async def test_status_of_a_peer_with_an_expired_certificate_says_so_in_one_line(tmp_path: Path) -> None:
    """Its error names the problem, and gRPC core's own lines about the failed handshakes stay out of stderr
    (the console script sets GRPC_VERBOSITY=ERROR unless the environment says otherwise)."""
    good, expired = _expired_pki(tmp_path)
    server = aio.server()
    port = server.add_secure_port("127.0.0.1:0", server_credentials_of(expired))
    await server.start()
    try:
        env = {k: v for k, v in os.environ.items() if k != "GRPC_VERBOSITY"}
        args = ("-m", "dreamp2p.cli", "status", f"127.0.0.1:{port}", "--ca", good["ca_file"])
        proc = await asyncio.create_subprocess_exec(sys.executable, *args, stderr=subprocess.PIPE, env=env)
        _, err = await asyncio.wait_for(proc.communicate(), 60)
    finally:
        await server.stop(None)
    text = err.decode()
    assert proc.returncode == 1
    assert "TLS handshake failed: the peer's certificate has expired" in text, text
    assert "ssl_transport_security" not in text and text.count("\n") == 1, text


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
        (["demo", "--strategy", "foo"], "argument --strategy: invalid choice: 'foo' (choose from 'none', 'ssgd',"),
        (["demo", "--codec", "int3"], "argument --codec: invalid choice: 'int3' (choose from 'fp32',"),
        (["demo", "--codec", "topk"], "argument --codec: invalid choice: 'topk'"),  # sparse: zeroes parameters
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


def _node_file(path: Path, address: str, token: str | None) -> Path:
    token_line = f'token = "{token}"\n' if token else ""
    path.write_text(f'[node]\nnode_id = "eu-west"\nlisten = "{address}"\n{token_line}')
    return path


async def test_status_watch_json_with_the_token_from_the_node_config(tmp_path: Path) -> None:
    peer = Peer(PeerConfig(node_id="eu-west", token="tok"))
    await peer.start()
    try:
        await peer.connect([PeerInfo("eu-west", peer.address)])
        config = _node_file(tmp_path / "eu-west.toml", peer.address, "tok")
        # the address and the token both come from the file
        code, out, err = await status_cli("--config", str(config), "--json", "--watch", "0.1", "--count", "3")
        assert code == 0, err.decode()
        lines = [json.loads(line) for line in out.decode().splitlines()]
        assert len(lines) == 3
        assert all(st["node_id"] == "eu-west" and st["ring"] == ["eu-west"] for st in lines)
        assert lines[0]["t"] <= lines[1]["t"] <= lines[2]["t"] and "links" in lines[0]
        # one answer, as text, to an address given on the command line with the file's token
        code, out, err = await status_cli(peer.address, "--config", str(config))
        assert code == 0 and "node eu-west" in out.decode(), err.decode()
        # a file without the token: refused, the error said, the watch goes on and ends non-zero
        code, out, err = await status_cli("--config", str(_node_file(tmp_path / "x.toml", peer.address, None)))
        assert code == 1 and b"BAD_TOKEN" in err
        args = ("--config", str(tmp_path / "x.toml"), "--json", "--watch", "0.1", "--count", "2")
        code, out, err = await status_cli(*args)
        assert code == 1 and out == b"" and err.count(b"dreamp2p status: BAD_TOKEN") == 2  # one per attempt
    finally:
        await peer.close()


@pytest.mark.parametrize(
    ("args", "message"),
    [([], "give the peer's HOST:PORT, or --config FILE"), (["h:1", "--count", "2"], "--count needs --watch")],
)
def test_status_usage_errors(capsys: pytest.CaptureFixture[str], args: list[str], message: str) -> None:
    with pytest.raises(SystemExit) as info:
        main(["status", *args])
    assert info.value.code == 2 and message in capsys.readouterr().err


def test_config_check_reports_every_error_then_exits_1(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text('[node]\nnode_id = "a"\n[sync]\nstratgy = "dreamddp"\nperiod = 0\n[task]\nsteps = 0\n')
    assert main(["config", "check", str(bad)]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 4 and lines[-1] == f"{bad}: 3 errors"
    assert "unknown key sync.stratgy (did you mean 'strategy'?)" in lines[0]
    assert "sync.period must be >= 1" in lines[1] and "task.steps must be >= 1" in lines[2]
    assert main(["config", "check", str(bad), "--json"]) == 1
    result = last_json(capsys.readouterr().out)
    assert result["ok"] is False and len(result["errors"]) == 3  # type: ignore[arg-type]
    good = tmp_path / "good.toml"
    good.write_text('[node]\nnode_id = "a"\n')
    assert main(["config", "check", str(good)]) == 0
    assert capsys.readouterr().out.strip() == f"{good}: ok"


def test_config_check_names_a_misspelt_strategy_and_an_expired_certificate(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _, expired = _expired_pki(tmp_path)
    tls = "".join(f'{key} = "{value}"\n' for key, value in expired.items())
    path = tmp_path / "node.toml"
    path.write_text(f'[node]\nnode_id = "a"\n[node.tls]\n{tls}[sync]\nstrategy = "dilocco"\n')
    assert main(["config", "check", str(path)]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3 and lines[-1] == f"{path}: 2 errors", lines
    assert f"node.tls.cert_file {expired['cert_file']}: the certificate expired on 2020-01-02" in lines[0]
    assert "sync.strategy must be one of" in lines[1] and "got 'dilocco' (did you mean 'diloco'?)" in lines[1]


def test_health_service_choices_are_the_ones_the_listener_serves() -> None:
    from dreamp2p.cli.node import HEALTH_SERVICES
    from dreamp2p.transport.health import PEER_SERVICE

    assert HEALTH_SERVICES == ("", PEER_SERVICE)


def test_config_check_as_a_process_exits_non_zero(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[node\n")
    out = subprocess.run(
        [sys.executable, "-m", "dreamp2p.cli", "config", "check", str(bad)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 1 and "not valid TOML" in out.stdout, out.stderr
