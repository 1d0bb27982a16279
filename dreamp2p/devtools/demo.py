"""`dreamp2p demo`: a multi-region run on one machine, from nothing to a report folder.

Starts N real node daemons (`dreamp2p node`, one process each) joined by emulated WAN links, trains the
embedded byte-level transformer with DreamDDP for a few minutes, shows live progress, stops every node
cleanly after the same step, and writes plots (loss vs time, link bandwidth, the layer schedule's Gantt
chart) and a summary into the run folder.

The links, said in one line at the start. As root (two nodes or more), each daemon runs in a network
namespace of its own and the packet emulator (`dreamp2p.devtools.wanemu`) joins them: every directed pair
of nodes is a path at the rate with one-way delay rtt/2, so TCP itself sees the round trip and the
bottleneck queue; its counters and CPU are printed at the end. Otherwise, or when the emulator cannot start
(no gcc, no /dev/net/tun), the daemons run on 127.0.0.1 and the transport paces each link and delays it in
process (``transport.rate_limit``, ``transport.delay_s``).

A daemon that exits early (a config it rejects, a port taken, a crash) is noticed within a fraction of a
second, during start-up as well as during training: the demo then stops the others and prints which node
exited with which code and the end of its log.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time
from pathlib import Path
from typing import Any

from dreamp2p.config import parse_duration, parse_rate
from dreamp2p.devtools.localrun import (
    NAMES,
    NodeExited,
    check_nodes,
    last_step,
    read_records,
    start_node,
    stop_nodes,
    wait_started,
    write_configs,
)
from dreamp2p.devtools.netns import Namespaces
from dreamp2p.service.metrics import RecordKind

POLL_S = 0.25  # how often the daemons are checked for an early exit
PROGRESS_S = 10.0  # how often progress is printed


def _progress_line(run_dir: Path, names: list[str]) -> list[str]:
    rows = []
    for name in names:
        recs = read_records(run_dir, name)
        steps = [r for r in recs if r.get("kind") == RecordKind.STEP][-20:]
        links = [r for r in recs if r.get("kind") == RecordKind.LINK]
        if not steps:
            rows.append(f"  {name:<9} starting...")
            continue
        loss = sum(r["loss"] for r in steps) / len(steps)
        tps = sum(r["tokens_per_s"] for r in steps) / len(steps)
        hidden = steps[-1]["hidden_fraction"]
        comm = sum(r["comm_s"] for r in steps)
        exposed = sum(r["exposed_s"] for r in steps)
        hid = 1.0 - exposed / comm if comm > 0 else hidden
        mbit = max((r["goodput_Bps"] for r in links[-4:]), default=0.0) * 8 / 1e6
        rows.append(
            f"  {name:<9} step {steps[-1]['step']:>5}  loss {loss:6.3f}  {tps:8.0f} tok/s  "
            f"link {mbit:7.1f} Mbit/s  hidden {hid:5.2f}  plan v{steps[-1]['plan_version']}"
        )
    return rows


def _emulated_links(stack: contextlib.ExitStack, nodes: int, link: str, rtt: str) -> tuple[Namespaces | None, str]:
    """The packet emulator's namespaces (entered on ``stack``) when this process can make them, else None;
    and the line saying which emulation runs."""
    path = f"{parse_rate(link) * 8 / 1e6:g} Mbit/s, {parse_duration(rtt) * 1e3:g} ms RTT"
    in_process = f"links: in-process delay and rate limit, {path}"
    if os.geteuid() != 0:
        return None, f"{in_process} (not root)"
    if nodes < 2:
        return None, f"{in_process} (one node: no links)"
    if shutil.which("ip") is None:
        return None, f"{in_process} (no ip command: iproute2)"
    try:
        ns = stack.enter_context(Namespaces(nodes, link, rtt=rtt))
    except (OSError, RuntimeError, ValueError) as exc:  # no gcc, no /dev/net/tun, ip failing: say why
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return None, f"{in_process} (the packet emulator did not start: {reason})"
    return ns, f"links: packet emulator, {path} (a network namespace per node, a path per pair)"


def _emulator_line(ns: Namespaces) -> str:
    from dreamp2p.devtools.wanemu import summary

    s = summary(ns.emulator_stats())
    return (
        f"packet emulator: {s['MB']} MB in {s['packets']} packets, {s['queue_drops']} queue drops, "
        f"{s['lost']} lost, {s['cpu_s']} s CPU ({s['cpu_ms_per_MB']} ms/MB)"
    )


def _report(run_dir: Path, names: list[str], t0: float) -> int:
    """After a clean stop: `dreamp2p report`'s folder and summary; 0 when every node's eval loss fell."""
    from dreamp2p.devtools.reportcmd import show_report

    print()
    show_report(run_dir)
    ok = True
    for name in names:
        evals = [r["eval_loss"] for r in read_records(run_dir, name) if r.get("kind") == RecordKind.EVAL]
        falls = len(evals) >= 2 and evals[-1] < evals[0]
        ok &= falls
        if evals:
            print(f"{name}: eval loss {evals[0]:.3f} -> {evals[-1]:.3f} ({'falls' if falls else 'DOES NOT FALL'})")
        else:
            print(f"{name}: no eval loss logged (DOES NOT FALL)")
    print(f"done in {time.monotonic() - t0:.0f} s")
    return 0 if ok else 1


def run_demo(
    nodes: int = 3,
    link: str = "20mbit",
    rtt: str = "80ms",
    minutes: float = 3.0,
    codec: str = "int8",
    strategy: str = "dreamddp",
    out: str | None = None,
    device: str = "auto",
    startup_timeout_s: float = 300.0,
) -> int:
    """Run the demo; 0 when every node's eval loss fell. ``startup_timeout_s`` bounds the wait for every
    node's first training step (imports, connecting the ring, the first step); training time starts after it.
    """
    rate = parse_rate(link)
    delay = parse_duration(rtt) / 2
    run_dir = Path(out or f"runs/demo-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    names = NAMES[:nodes]
    sync: dict[str, Any] = {
        "strategy": strategy,
        "period": 10,
        "max_delay": 9,  # a sync may span the whole period: 80 ms RTT chains need it
        "codec": codec,
        "warmup_steps": 5,
        "control_every": 20,
    }
    task: dict[str, Any] = {"steps": 1_000_000, "eval_every": 50}
    with contextlib.ExitStack() as stack:
        ns, links = _emulated_links(stack, nodes, link, rtt)
        where = "in network namespaces" if ns is not None else "on 127.0.0.1"
        print(
            f"dreamp2p demo: {nodes} node daemons {where}, links {link} with {rtt} RTT per hop, "
            f"{strategy} ({codec}), ~{minutes:g} min of training"
        )
        print(links)
        if ns is None:
            configs = write_configs(
                run_dir, nodes, rate_Bps=rate, delay_s=delay, sync=sync, task=task, checkpoint_every=500, device=device
            )
        else:  # the emulator's paths pace and delay: nothing in process
            configs = write_configs(
                run_dir,
                nodes,
                rate_Bps=None,
                delay_s=0.0,
                sync=sync,
                task=task,
                checkpoint_every=500,
                device=device,
                hosts=[addr for _, addr in ns.hosts],
            )
        code = _run(
            run_dir, names, configs, [h for h, _ in ns.hosts] if ns else [None] * nodes, minutes, startup_timeout_s
        )
        if ns is not None:
            print(_emulator_line(ns))
    return code


def _run(
    run_dir: Path,
    names: list[str],
    configs: list[Path],
    netns: list[str | None],
    minutes: float,
    startup_timeout_s: float,
) -> int:
    """Start the daemons (each in its namespace, if any), train ``minutes``, stop them together, report."""
    stop_file = run_dir / "stop_at"
    print(f"run folder: {run_dir}")
    procs = {
        name: start_node(c, stop_at_file=stop_file, netns=n) for name, c, n in zip(names, configs, netns, strict=True)
    }
    t0 = time.monotonic()

    def progress() -> None:
        print(f"[{time.monotonic() - t0:5.0f} s]")
        print("\n".join(_progress_line(run_dir, names)))

    try:
        print("waiting for every node's first training step...")
        wait_started(procs, run_dir, startup_timeout_s, interval=POLL_S, progress=progress, progress_every=PROGRESS_S)
        t_train = time.monotonic()
        next_progress = t_train
        while time.monotonic() - t_train < minutes * 60:
            check_nodes(procs, run_dir, clean_exit_ok=True, when="during training")
            if time.monotonic() >= next_progress:
                progress()
                next_progress += PROGRESS_S
            time.sleep(POLL_S)
        # every node stops after the same step, so nobody waits for a round a stopped node skips
        final = max(last_step(run_dir, n) for n in names) + 10
        stop_file.write_text(str(final))
        print(f"stopping all nodes after step {final}...")
        codes = [p.wait(600) for p in procs.values()]
    except (NodeExited, TimeoutError) as exc:
        print(f"dreamp2p demo: {exc}")
        print("stopping the other nodes...")
        stop_nodes(procs, grace_s=5.0)
        return 1
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
    if any(codes):
        print(f"node exit codes {dict(zip(names, codes, strict=True))}; see {run_dir}/<node>.log")
        return 1
    return _report(run_dir, names, t0)
