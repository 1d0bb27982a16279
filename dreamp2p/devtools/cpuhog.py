"""Run a command beside busy processes, one per core by default: the slow tests under load (make test-loaded).

A shared CI machine or a laptop doing other work is what users run tests on; timing-sensitive code that
passes only on an idle machine is a bug this exposes. The hogs are killed however the command ends.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import subprocess
from collections.abc import Sequence


def _spin() -> None:
    x = 0
    while True:
        x = (x * 1103515245 + 12345) & 0xFFFFFFFF


def run_loaded(command: Sequence[str], procs: int) -> int:
    """Run ``command`` with ``procs`` busy-looping processes beside it; its exit code."""
    ctx = mp.get_context("spawn")
    hogs = [ctx.Process(target=_spin, daemon=True, name=f"cpuhog-{i}") for i in range(procs)]
    for h in hogs:
        h.start()
    try:
        return subprocess.run(list(command), check=False).returncode
    finally:
        for h in hogs:
            h.kill()
        for h in hogs:
            h.join(10)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dreamp2p.devtools.cpuhog", description=__doc__)
    p.add_argument("--procs", type=int, default=os.cpu_count() or 1, help="busy processes (default: one per core)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="the command to run, after --")
    args = p.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        p.error("give the command to run after --")
    return run_loaded(command, max(0, args.procs))


if __name__ == "__main__":
    raise SystemExit(main())
