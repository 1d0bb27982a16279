"""Launching local node daemons: the right package whatever the working directory, early exits seen at once.

Real child processes throughout; the demo test runs real `dreamp2p node` daemons that reject their config.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

import dreamp2p
from dreamp2p.devtools.demo import run_demo
from dreamp2p.devtools.localrun import NodeExited, child_env, python_command, stop_nodes, wait_started


@pytest.fixture
def shadow_dir(tmp_path: Path) -> Path:
    """A folder holding a ``dreamp2p/`` package that cannot be imported: what a user's cwd may contain."""
    d = tmp_path / "elsewhere"
    (d / "dreamp2p").mkdir(parents=True)
    (d / "dreamp2p" / "__init__.py").write_text('raise ImportError("shadow")\n')
    return d


def _run(args: list[str], cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=60, check=False)


def test_children_import_the_real_package_from_a_folder_that_shadows_it(shadow_dir: Path) -> None:
    code = "import dreamp2p; print(dreamp2p.__file__)"
    # the folder does shadow the package for a plain child (sys.path[0] is the cwd), as `python -m` had it
    plain = _run([sys.executable, "-c", code], shadow_dir)
    assert plain.returncode != 0 and "shadow" in plain.stderr
    # the launcher's way: the package this process imported
    out = _run(python_command("-c", code), shadow_dir, child_env())
    assert out.returncode == 0, out.stderr
    assert Path(out.stdout.strip()) == Path(dreamp2p.__file__)
    # and the very command line start_node runs, up to argument parsing
    cli = _run(python_command("-m", "dreamp2p.cli", "node", "--help"), shadow_dir, child_env())
    assert cli.returncode == 0, cli.stderr
    assert "--config" in cli.stdout


def _child(log: Path, code: str) -> subprocess.Popen[bytes]:
    with open(log, "ab") as out:
        return subprocess.Popen(python_command("-c", code), stdout=out, stderr=subprocess.STDOUT, env=child_env())


def test_wait_started_reports_a_node_that_exits_with_its_code_and_log(tmp_path: Path) -> None:
    procs = {
        "eu-west": _child(tmp_path / "eu-west.log", "import time; time.sleep(120)"),
        "us-east": _child(tmp_path / "us-east.log", "import sys; print('bad setting: x'); sys.exit(3)"),
    }
    try:
        with pytest.raises(NodeExited) as info:
            wait_started(procs, tmp_path, timeout=120.0)  # longer than this test's timeout: it must end early
        exc = info.value
        assert (exc.node, exc.code, exc.others) == ("us-east", 3, {})
        assert exc.log_path == tmp_path / "us-east.log"
        assert "bad setting: x" in exc.tail
        assert "node us-east exited with code 3 before it started training" in str(exc)
    finally:
        codes = stop_nodes(procs, grace_s=10.0)
    assert codes["us-east"] == 3 and codes["eu-west"] != 0  # the sleeper was stopped by a signal


def test_wait_started_times_out_naming_the_nodes_still_starting(tmp_path: Path) -> None:
    procs = {"ap-south": _child(tmp_path / "ap-south.log", "import time; time.sleep(120)")}
    try:
        with pytest.raises(TimeoutError, match=r"node\(s\) ap-south did not start training within 0.5 s"):
            wait_started(procs, tmp_path, timeout=0.5)
    finally:
        stop_nodes(procs, grace_s=10.0)
    assert procs["ap-south"].poll() is not None


@pytest.mark.timeout(60)
def test_demo_reports_daemons_that_die_at_start_at_once(
    tmp_path: Path, shadow_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # run from a folder whose dreamp2p/ would break the daemons' import, with a strategy the daemons reject;
    # the start-up wait (120 s) is longer than this test may take, so returning at all means it returned early
    monkeypatch.chdir(shadow_dir)
    code = run_demo(
        nodes=2, strategy="no-such-strategy", out=str(tmp_path / "run"), minutes=5, device="cpu", startup_timeout_s=120
    )
    out = capsys.readouterr().out
    assert code == 1, out
    reported = re.search(r"node (eu-west|us-east) exited with code 1 before it started training", out)
    assert reported, out
    assert "strategy must be one of" in out and "'no-such-strategy'" in out, out  # the tail of its log
    assert "shadow" not in out, out
    # the node reported wrote the cause to its log; the other may have been stopped before it got that far
    # (the demo stops the rest as soon as one fails: on a loaded machine, still inside its imports)
    assert "strategy must be one of" in (tmp_path / "run" / f"{reported[1]}.log").read_text()
