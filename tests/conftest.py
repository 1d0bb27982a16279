"""What many test files share: a ring of real peers on loopback (127.0.0.1), TLS material, test kinds.

Tests are grouped by kind, one folder each, and marked with it (``pytest -m unit``): ``unit`` (pure logic,
no sockets), ``net`` (real peers on loopback sockets or in network namespaces), ``adversarial`` (hostile
and malformed input against real servers), ``e2e`` (node daemons, the CLI and benches as processes).
Helpers are imported by name (``from conftest import start_ring``); pytest puts this folder on the path.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import os
import secrets
import shutil
import subprocess
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import grpc
import pytest

from dreamp2p.config import STRATEGIES, PeerConfig, PeerInfo
from dreamp2p.peer import Peer

ROOT = Path(__file__).resolve().parents[1]
MAKE_CERTS = ROOT / "deploy" / "tls" / "make-certs.sh"
KINDS = ("unit", "net", "adversarial", "e2e")
# Every strategy that averages something: the registry's names (dreamp2p.config.STRATEGIES) but "none". Tests
# that mean "every strategy" parametrize over this, so a strategy added to the registry is tested at once.
SYNC_STRATEGIES = tuple(s for s in STRATEGIES if s != "none")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark every test with its kind, which is the folder it lives in; the longest kinds run first.

    ``make test`` runs the suite on pytest-xdist workers that take one test at a time, and a minute-long
    multi-process test started last keeps one worker busy while the others have nothing left to do. So the
    slow ones go first, then the kinds from the longest tests to the shortest (end to end, peers, hostile
    input, pure logic): the seconds-long unit tests fill the workers' last gaps.
    """
    for item in items:
        kind = item.path.parent.name
        if kind not in KINDS:
            raise pytest.UsageError(f"{item.nodeid}: tests live in one of the folders {', '.join(KINDS)}")
        item.add_marker(getattr(pytest.mark, kind))
    longest_first = ("e2e", "net", "adversarial", "unit")
    # stable: within a key, in file order
    items.sort(key=lambda item: (item.get_closest_marker("slow") is None, longest_first.index(item.path.parent.name)))


def port_range(low: int = 20000, high: int = 32768) -> tuple[int, int]:
    """This pytest-xdist worker's share of ``low .. high`` (the whole range without xdist), for tests that
    pick fixed ports (`dreamp2p.devtools.regionjob.free_port_block`): workers never pick the same block."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if not worker.startswith("gw") or count <= 1:
        return low, high
    share = (high - low) // count
    index = int(worker[2:])
    return low + index * share, low + (index + 1) * share


def ring_configs(n: int, **fields: Any) -> list[PeerConfig]:
    """``n`` peer configs named p0, p1, ... sharing ``fields`` (PeerConfig keyword arguments)."""
    return [PeerConfig(node_id=f"p{i}", **fields) for i in range(n)]


async def start_ring(configs: Sequence[PeerConfig], timeout: float | None = None) -> list[Peer]:
    """Start one peer per config on an ephemeral loopback port and connect them all into one ring."""
    peers = [Peer(c) for c in configs]
    started: list[Peer] = []
    try:
        for p in peers:
            await p.start()
            started.append(p)
        ring = [PeerInfo(p.config.node_id, p.address) for p in peers]
        await asyncio.gather(*(p.connect(ring, timeout=timeout) for p in peers))
    except BaseException:
        await asyncio.gather(*(p.close(grace=0.1) for p in started))
        raise
    return peers


@contextlib.asynccontextmanager
async def running_ring(
    configs: Sequence[PeerConfig], timeout: float | None = None, grace: float = 0.1
) -> AsyncIterator[list[Peer]]:
    """:func:`start_ring`, closed again on the way out."""
    peers = await start_ring(configs, timeout)
    try:
        yield peers
    finally:
        await asyncio.gather(*(p.close(grace=grace) for p in peers))


def make_certs(out: Path, names: str = "localhost,127.0.0.1") -> dict[str, str]:
    """A CA and one certificate for ``names``, made by the shipped deploy/tls/make-certs.sh (openssl)."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    subprocess.run(
        ["bash", str(MAKE_CERTS), "--out", str(out), "--days", "2", names], check=True, capture_output=True, timeout=60
    )
    return {
        "cert_file": str(out / "localhost.pem"),
        "key_file": str(out / "localhost.key"),
        "ca_file": str(out / "ca.pem"),
    }


def make_node_certs(out: Path, node_ids: Sequence[str]) -> dict[str, dict[str, str]]:
    """A CA and one certificate per node id (its common name; SANs: the id, localhost, 127.0.0.1)."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    specs = [f"{n}={n},localhost,127.0.0.1" for n in node_ids]
    subprocess.run(
        ["bash", str(MAKE_CERTS), "--out", str(out), "--days", "2", *specs], check=True, capture_output=True, timeout=60
    )
    return {
        n: {"cert_file": str(out / f"{n}.pem"), "key_file": str(out / f"{n}.key"), "ca_file": str(out / "ca.pem")}
        for n in node_ids
    }


def make_dated_cert(
    ca_dir: Path,
    name: str,
    not_before: datetime.datetime,
    not_after: datetime.datetime,
    hosts: Sequence[str] = ("localhost", "127.0.0.1"),
) -> dict[str, str]:
    """A certificate valid from ``not_before`` to ``not_after`` (UTC) for ``hosts`` (SANs; CN the first),
    signed by the CA :func:`make_certs` wrote to ``ca_dir``, and its own key, as ``name``.pem / .key there.

    ``openssl ca`` sets the dates (``x509 -days`` cannot reach into the past), so expired and not-yet-valid
    certificates are real ones, as an operator would meet them.
    """
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    work = ca_dir / f"{name}.ca"
    work.mkdir()
    (work / "index.txt").write_text("")
    (work / "serial").write_text(f"01{secrets.token_hex(8)}\n")  # random, as make-certs.sh makes them
    san = ",".join(f"IP:{h}" if h[0].isdigit() or ":" in h else f"DNS:{h}" for h in hosts)
    (work / "ca.cnf").write_text(
        "[ca]\ndefault_ca = here\n"
        f"[here]\ndatabase = {work}/index.txt\nnew_certs_dir = {work}\nserial = {work}/serial\n"
        "default_md = sha256\npolicy = any\nunique_subject = no\n"
        "[any]\ncommonName = supplied\n"
        "[ext]\nbasicConstraints = critical,CA:FALSE\nkeyUsage = critical,digitalSignature,keyEncipherment\n"
        f"extendedKeyUsage = serverAuth,clientAuth\nsubjectAltName = {san}\n"
    )
    key, csr, pem = ca_dir / f"{name}.key", work / "node.csr", ca_dir / f"{name}.pem"
    stamp = "%Y%m%d%H%M%SZ"
    steps = [
        ["openssl", "genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256", "-out", str(key)],
        ["openssl", "req", "-new", "-key", str(key), "-subj", f"/CN={hosts[0]}", "-out", str(csr)],
        [
            *("openssl", "ca", "-batch", "-notext", "-config", str(work / "ca.cnf"), "-extensions", "ext"),
            *("-cert", str(ca_dir / "ca.pem"), "-keyfile", str(ca_dir / "ca.key"), "-in", str(csr), "-out", str(pem)),
            *("-startdate", not_before.strftime(stamp), "-enddate", not_after.strftime(stamp)),
        ],
    ]
    for step in steps:
        subprocess.run(step, check=True, capture_output=True, timeout=60)
    return {"cert_file": str(pem), "key_file": str(key), "ca_file": str(ca_dir / "ca.pem")}


def server_credentials_of(certs: dict[str, str], mutual: bool = False) -> grpc.ServerCredentials:
    """gRPC server credentials from ``certs``' files as they are, whatever their dates or signer (a Peer
    refuses to serve a bad certificate, so tests that need a server presenting one build it by hand)."""
    key, cert = Path(certs["key_file"]).read_bytes(), Path(certs["cert_file"]).read_bytes()
    ca = Path(certs["ca_file"]).read_bytes() if mutual else None
    return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=mutual)


@pytest.fixture
async def ring3() -> AsyncIterator[list[Peer]]:
    """Three default peers on loopback, connected into one ring."""
    async with running_ring(ring_configs(3), grace=2.0) as peers:
        yield peers


async def poll_until(check: Callable[[], bool], interval: float = 0.01) -> None:
    """Wait until ``check()`` holds, looking every ``interval`` s. No time limit of its own: a loaded host
    is slow, not wrong, so the test's pytest timeout is the hang guard (no wall-clock bound in tests)."""
    while True:
        if check():
            return
        await asyncio.sleep(interval)


@contextlib.contextmanager
def small_tmpfs(directory: Path, size_bytes: int) -> Iterator[Path]:
    """A tmpfs of ``size_bytes`` mounted on ``directory`` (made if missing) for the block, to fill a disk for
    real. Skips the test when not root or when the mount is refused (a container without CAP_SYS_ADMIN)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    directory.mkdir(parents=True, exist_ok=True)
    out = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size_bytes}", "tmpfs", str(directory)],
        capture_output=True,
        text=True,
        check=False,
    )
    if out.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs on {directory}: {out.stderr.strip()}")
    try:
        yield directory
    finally:
        subprocess.run(["umount", str(directory)], check=True)


def resize_tmpfs(directory: Path, size_bytes: int) -> None:
    """Grow (or shrink) the tmpfs that :func:`small_tmpfs` mounted: the operator freeing space."""
    subprocess.run(["mount", "-o", f"remount,size={size_bytes}", str(directory)], check=True)
