"""The command line: every subcommand's last line is JSON (or a readable report), errors are clear."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import pytest

from dreamp2p.cli import main
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
