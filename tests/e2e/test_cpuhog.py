"""`make test-loaded`'s runner: the command's exit code comes back and no busy process outlives it."""

from __future__ import annotations

import multiprocessing as mp
import sys

import pytest

from dreamp2p.devtools.cpuhog import main, run_loaded


def test_the_command_runs_under_load_and_the_hogs_are_gone_after() -> None:
    before = {p.pid for p in mp.active_children()}
    code = "import time; time.sleep(0.5); raise SystemExit(3)"
    assert run_loaded([sys.executable, "-c", code], procs=2) == 3
    assert {p.pid for p in mp.active_children()} - before == set()


def test_a_command_is_required() -> None:
    with pytest.raises(SystemExit) as info:
        main(["--procs", "1", "--"])
    assert info.value.code == 2
