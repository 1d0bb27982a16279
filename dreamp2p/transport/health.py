"""Standard gRPC health checking (``grpc.health.v1``) on a plaintext listener of its own.

Probes (kubelet's gRPC probe, grpcurl, load balancers) can send neither the cluster token nor a client
certificate, so the health service does not share the Peer service's port: it listens on an address of
its own (``[node] health_listen``, loopback or pod-local) and tells only whether the node is serving.
It also serves gRPC server reflection, listing the Peer service and the health service by name, so
grpcurl can find them without the proto file. The peer decides the status; this module only serves it.
"""

from __future__ import annotations

import logging

from grpc import aio
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

from dreamp2p.v1 import peer_pb2  # its descriptors in the default pool: reflection describes the Peer service

log = logging.getLogger(__name__)

# the status applies to the whole node ("") and to the Peer service
PEER_SERVICE = peer_pb2.DESCRIPTOR.services_by_name["Peer"].full_name
HEALTH_SERVICE = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
# what reflection lists: names only (the Peer service itself is not served here)
REFLECTED_SERVICES = (PEER_SERVICE, HEALTH_SERVICE, reflection.SERVICE_NAME)
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class HealthListener:
    """A small aio server answering ``grpc.health.v1.Health`` Check and Watch, without authentication."""

    def __init__(self, listen: str) -> None:
        self._listen = listen
        self._servicer = health_aio.HealthServicer()
        self._server: aio.Server | None = None
        self._serving: bool | None = None
        self.port = 0

    async def start(self, serving: bool) -> int:
        """Bind and start with an initial status; returns the bound port."""
        server = aio.server(maximum_concurrent_rpcs=64)
        health_pb2_grpc.add_HealthServicer_to_server(self._servicer, server)
        reflection.enable_server_reflection(REFLECTED_SERVICES, server)
        self.port = server.add_insecure_port(self._listen)
        if self.port == 0:
            raise OSError(f"could not bind the health listener {self._listen}")
        await self.set(serving, "starting")
        await server.start()
        self._server = server
        return self.port

    async def set(self, serving: bool, reason: str) -> None:
        """Publish the node's status (a change is logged with its reason)."""
        if serving == self._serving:
            return
        if self._serving is not None:
            log.info("health: %s (%s)", "SERVING" if serving else "NOT_SERVING", reason)
        self._serving = serving
        for service in ("", PEER_SERVICE):
            await self._servicer.set(service, SERVING if serving else NOT_SERVING)

    async def stop(self, grace: float | None) -> None:
        """NOT_SERVING for good, then stop the listener (``grace`` seconds for calls in flight)."""
        await self._servicer.enter_graceful_shutdown()
        if self._server is not None:
            await self._server.stop(grace)
            self._server = None


async def check_health(address: str, service: str = "", timeout: float = 5.0) -> str:
    """Ask a health listener for ``service``'s status: "SERVING", "NOT_SERVING", ... (OSError if unreachable)."""
    async with aio.insecure_channel(address) as channel:
        try:
            reply = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout
            )
        except aio.AioRpcError as exc:
            raise OSError(f"health check of {address} failed: {exc.code().name}: {exc.details()}") from None
    return str(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))
