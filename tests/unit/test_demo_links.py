"""The demo says which link emulation it runs (issue 37): in process without root or with one node."""

from __future__ import annotations

import contextlib

import pytest

from dreamp2p.devtools import demo


@pytest.mark.parametrize(
    ("uid", "nodes", "why"),
    [(1000, 3, "(not root)"), (0, 1, "(one node: no links)")],
)
def test_demo_links_in_process(monkeypatch: pytest.MonkeyPatch, uid: int, nodes: int, why: str) -> None:
    monkeypatch.setattr(demo.os, "geteuid", lambda: uid)
    with contextlib.ExitStack() as stack:
        ns, line = demo._emulated_links(stack, nodes, "20mbit", "80ms")
    assert ns is None
    assert line == f"links: in-process delay and rate limit, 20 Mbit/s, 80 ms RTT {why}"


def test_demo_links_say_why_the_emulator_did_not_start(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*_: object, **__: object) -> None:
        raise RuntimeError("the WAN emulator needs a C compiler (gcc) to build dreamp2p/devtools/wanemu.c")

    monkeypatch.setattr(demo.os, "geteuid", lambda: 0)
    monkeypatch.setattr(demo.shutil, "which", lambda _: "/usr/sbin/ip")
    monkeypatch.setattr(demo, "Namespaces", broken)
    with contextlib.ExitStack() as stack:
        ns, line = demo._emulated_links(stack, 3, "20mbit", "80ms")
    assert ns is None
    assert line.startswith("links: in-process delay and rate limit, 20 Mbit/s, 80 ms RTT (the packet emulator did")
    assert "C compiler" in line
