"""grpc.health.v1 on the health listener: no token needed, and the status follows the node's real state."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from conftest import make_node_certs, ring_configs, start_ring
from grpc import aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from dreamp2p.config import PeerConfig, TLSConfig
from dreamp2p.messages import TrainingInfo
from dreamp2p.peer import Peer
from dreamp2p.peer.health import health_of
from dreamp2p.transport.health import PEER_SERVICE, check_health
from dreamp2p.v1 import peer_pb2 as pb
from dreamp2p.v1 import peer_pb2_grpc as pb_grpc


def info(step: int) -> TrainingInfo:
    return TrainingInfo(strategy="dreamddp", step=step)


async def eventually(peer: Peer, want: str, passes: int = 20) -> None:
    """Probe until the status is ``want``, for at most ``passes`` publications of the peer's health loop."""
    address = f"127.0.0.1:{peer.health_port}"
    start = peer.health_publications
    while (got := await check_health(address)) != want:
        assert peer.health_publications - start < passes, f"still {got} after {passes} health publications"
        await asyncio.sleep(0.05)


async def test_probes_need_no_token_while_the_peer_service_still_does() -> None:
    (peer,) = await start_ring(ring_configs(1, token="secret", health_listen="127.0.0.1:0"))
    try:
        health = f"127.0.0.1:{peer.health_port}"
        assert await check_health(health) == "SERVING"
        assert await check_health(health, PEER_SERVICE) == "SERVING"
        # the Peer service itself still refuses a caller without the token
        async with aio.insecure_channel(peer.address) as channel:
            with pytest.raises(aio.AioRpcError) as err:
                await pb_grpc.PeerStub(channel).Status(pb.StatusRequest(), timeout=5)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        await peer.close(grace=0.1)


async def test_status_follows_joining_a_stalled_trainer_and_shutdown() -> None:
    (cfg,) = ring_configs(1, health_listen="127.0.0.1:0", health_stall_s=0.6)
    peer = Peer(cfg)
    peer.stand_aside()  # a joiner: no training state yet
    await peer.start()
    health = f"127.0.0.1:{peer.health_port}"
    try:
        assert await check_health(health) == "NOT_SERVING"
        peer.admit_from(1)  # state taken: it takes part from round 1 on
        await eventually(peer, "SERVING")
        peer.set_training_info(info(1))
        assert await check_health(health) == "SERVING"
        await eventually(peer, "NOT_SERVING")  # no step for longer than health_stall_s
        assert "trainer stalled" in peer.health()[1]
        peer.set_training_info(info(2))
        await eventually(peer, "SERVING")
        # a watcher sees the node turn NOT_SERVING as soon as it starts shutting down
        async with aio.insecure_channel(health) as channel:
            watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=""), timeout=30)
            updates = watch.__aiter__()
            assert (await updates.__anext__()).status == health_pb2.HealthCheckResponse.SERVING
            closing = asyncio.ensure_future(peer.close(grace=1.0))
            assert (await updates.__anext__()).status == health_pb2.HealthCheckResponse.NOT_SERVING
            watch.cancel()
            await closing
    finally:
        await peer.close(grace=0.1)
    with pytest.raises(OSError, match=r"health check of .* failed: UNAVAILABLE"):
        await check_health(health, timeout=1.0)


def test_a_bad_stall_threshold_is_refused() -> None:
    with pytest.raises(ValueError, match="health_stall_s must be > 0"):
        PeerConfig(node_id="p0", health_stall_s=0)


async def test_health_cli_exit_code_says_serving() -> None:
    (peer,) = await start_ring(ring_configs(1, health_listen="127.0.0.1:0"))
    args = [sys.executable, "-m", "dreamp2p", "health", f"127.0.0.1:{peer.health_port}"]
    try:
        proc = await asyncio.create_subprocess_exec(*args, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        out, err = await asyncio.wait_for(proc.communicate(), 60)
        assert (proc.returncode, out.decode().strip()) == (0, "SERVING"), err.decode()
        peer.stand_aside()
        await eventually(peer, "NOT_SERVING")
        proc = await asyncio.create_subprocess_exec(*args, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        out, _ = await asyncio.wait_for(proc.communicate(), 60)
        assert (proc.returncode, out.decode().strip()) == (1, "NOT_SERVING")
    finally:
        await peer.close(grace=0.1)


async def test_reflection_lists_the_peer_and_health_services_without_a_token() -> None:
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    (peer,) = await start_ring(ring_configs(1, token="secret", health_listen="127.0.0.1:0"))
    try:
        async with aio.insecure_channel(f"127.0.0.1:{peer.health_port}") as channel:
            stub = reflection_pb2_grpc.ServerReflectionStub(channel)
            ask = [
                reflection_pb2.ServerReflectionRequest(list_services=""),
                reflection_pb2.ServerReflectionRequest(file_containing_symbol=PEER_SERVICE),
            ]
            replies = [r async for r in stub.ServerReflectionInfo(iter(ask), timeout=10)]
        listed = {s.name for s in replies[0].list_services_response.service}
        assert {"dreamp2p.v1.Peer", "grpc.health.v1.Health"} <= listed
        # the Peer service's descriptor comes back too (grpcurl describe), not an error
        assert replies[1].WhichOneof("message_response") == "file_descriptor_response"
        assert replies[1].file_descriptor_response.file_descriptor_proto
    finally:
        await peer.close(grace=0.1)


@pytest.mark.parametrize(
    ("closing", "draining", "ready", "idle", "want"),
    [
        (False, False, True, None, (True, "serving")),
        (False, False, True, 5.0, (True, "serving")),
        (False, True, True, None, (False, "draining: stopping after the rounds in flight")),
        (True, True, True, None, (False, "shutting down")),
        (False, False, False, None, (False, "joining: no training state yet")),
        (False, False, True, 11.0, (False, "trainer stalled: no step published for 11 s")),
    ],
)
def test_health_of(closing: bool, draining: bool, ready: bool, idle: float | None, want: tuple[bool, str]) -> None:
    assert health_of(closing, ready, idle, 10.0, draining) == want


async def test_draining_turns_not_serving_while_rounds_still_run() -> None:
    (peer,) = await start_ring(ring_configs(1, health_listen="127.0.0.1:0"))
    try:
        assert await check_health(f"127.0.0.1:{peer.health_port}") == "SERVING"
        peer.begin_drain()
        await eventually(peer, "NOT_SERVING")
        assert peer.health()[1].startswith("draining")
    finally:
        await peer.close(grace=0.1)


async def test_a_plain_probe_reads_a_token_and_tls_node_serving_not_serving_while_joining_or_draining(
    tmp_path: Path,
) -> None:
    """The node's peer service wants mutual TLS and the token; its health listener answers a plain
    ``grpc.health.v1`` client with neither, and the answer follows joining, serving and draining."""
    certs = make_node_certs(tmp_path, ["p0"])
    tls = TLSConfig(**certs["p0"], mutual=True, server_name_override="localhost")
    peer = Peer(PeerConfig(node_id="p0", token="secret", tls=tls, health_listen="127.0.0.1:0"))
    peer.stand_aside()  # joining: no training state yet
    await peer.start()
    health = f"127.0.0.1:{peer.health_port}"
    try:
        assert await check_health(health) == "NOT_SERVING"
        # the peer port itself refuses a plaintext caller outright
        async with aio.insecure_channel(peer.address) as channel:
            with pytest.raises(aio.AioRpcError):
                await pb_grpc.PeerStub(channel).Status(pb.StatusRequest(), timeout=5)
        peer.admit_from(1)
        await eventually(peer, "SERVING")
        peer.begin_drain()
        await eventually(peer, "NOT_SERVING")
    finally:
        await peer.close(grace=0.1)
