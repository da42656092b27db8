"""The proxy's view of its workers: channels, health, outstanding requests and cached blocks per worker.

Which worker takes a request is the router's choice (`kvservice.server.router`); a
worker's load is its `num_outstanding`: requests the proxy sent it that have not ended.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvservice.connector.kv_transfer_service import GRPC_OPTIONS
from kvservice.runtime.tls import bearer_metadata
from kvservice.server.kv_index import KVBlockIndex
from kvservice.v1 import kvservice_pb2_grpc as pb_grpc

logger = logging.getLogger(__name__)

CHANNEL_OPTIONS = GRPC_OPTIONS


@dataclass(eq=False)
class WorkerHandle:
    address: str
    channel: grpc.aio.Channel
    stub: pb_grpc.WorkerStub
    health: health_pb2_grpc.HealthStub
    # What every call to the worker carries (its bearer token); health checks need none.
    metadata: tuple[tuple[str, str], ...] | None = None
    num_outstanding: int = 0
    is_healthy: bool = False
    last_error: str = field(default="not checked yet")
    kv_index: KVBlockIndex = field(default_factory=KVBlockIndex)  # fed by its KV event subscription


class WorkerPool:
    """Workers of one role."""

    def __init__(
        self, addresses: list[str], credentials: grpc.ChannelCredentials | None = None, auth_token: str | None = None
    ) -> None:
        metadata = bearer_metadata(auth_token)
        self.workers: list[WorkerHandle] = []
        for address in addresses:
            if credentials is not None:
                channel = grpc.aio.secure_channel(address, credentials, options=CHANNEL_OPTIONS)
            else:
                channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
            self.workers.append(
                WorkerHandle(address, channel, pb_grpc.WorkerStub(channel), health_pb2_grpc.HealthStub(channel), metadata)
            )

    @property
    def num_healthy(self) -> int:
        return sum(w.is_healthy for w in self.workers)

    @property
    def healthy(self) -> list[WorkerHandle]:
        return [w for w in self.workers if w.is_healthy]

    @contextlib.contextmanager
    def using(self, worker: WorkerHandle) -> Iterator[WorkerHandle]:
        """Count a request as outstanding on `worker` for the duration of the block."""
        worker.num_outstanding += 1
        try:
            yield worker
        finally:
            worker.num_outstanding -= 1

    def mark_unhealthy(self, worker: WorkerHandle, error: str) -> None:
        """A call failed as if the worker were gone: stop routing to it until a check passes."""
        if worker.is_healthy:
            logger.warning("worker %s marked unhealthy: %s", worker.address, error)
        worker.is_healthy = False
        worker.last_error = error

    async def check_all(self, timeout: float) -> None:
        await asyncio.gather(*(self._check(w, timeout) for w in self.workers))

    async def _check(self, worker: WorkerHandle, timeout: float) -> None:
        try:
            reply = await worker.health.Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout)
        except grpc.aio.AioRpcError as e:
            worker.is_healthy = False
            worker.last_error = f"{e.code().name}: {e.details()}"
            return
        worker.is_healthy = reply.status == health_pb2.HealthCheckResponse.SERVING
        worker.last_error = "" if worker.is_healthy else health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)

    async def close(self) -> None:
        for worker in self.workers:
            await worker.channel.close()
