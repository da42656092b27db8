"""The proxy's view of its workers: membership, channels, health, load and cached blocks per worker.

Which worker takes a request is the router's choice (`kvservice.server.proxy.router`); a
worker's load is its `num_outstanding`: requests the proxy sent it that have not ended.

Membership: workers named on the command line are members from the start. Workers found by
DNS (`discovery.py`) are `joining` until their health says SERVING and, where routing reads
KV events, their subscription has applied its snapshot; then `serving`. A member that reports
NOT_SERVING (it drains) or fails its health check is `not_serving`: no new requests. One that
disappears from DNS is `leaving`: no new requests, its in-flight ones finish, then it is
dropped with its channel and its index. Health comes from a `Health.Watch` stream per worker,
so a draining worker is seen at once, and from the periodic checks (`check_all`), which also
notice a worker cut off without its connection closing.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvservice.runtime.grpc_options import GRPC_OPTIONS
from kvservice.runtime.tls import bearer_metadata
from kvservice.server.proxy.decode_stream import DecodeStreams
from kvservice.server.proxy.kv_index import KVBlockIndex
from kvservice.v1 import kvservice_pb2_grpc as pb_grpc

logger = logging.getLogger(__name__)

# gRPC's default reconnect backoff grows to 120 s: a worker that was listed (by DNS) before
# its port opened would join only on the channel's next try, tens of seconds after it is up.
# Capped at 2 s, a new worker joins within about a discovery interval of being ready.
CHANNEL_OPTIONS = [
    *GRPC_OPTIONS,
    ("grpc.initial_reconnect_backoff_ms", 500),
    ("grpc.min_reconnect_backoff_ms", 500),
    ("grpc.max_reconnect_backoff_ms", 2_000),
]
WORKER_STATES = ("joining", "serving", "not_serving", "leaving")
_WATCH_MAX_BACKOFF_S = 2.0
_SERVING = health_pb2.HealthCheckResponse.SERVING


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
    has_joined: bool = True  # static members join at once; discovered ones after SERVING (+ snapshot)
    is_leaving: bool = False  # gone from DNS: finishing what it has, then dropped
    decode_streams: DecodeStreams = field(init=False)  # decode calls to it, on one stream

    def __post_init__(self) -> None:
        self.decode_streams = DecodeStreams(self.stub, self.metadata, self.address)

    async def close(self) -> None:
        """Close its decode stream, then its channel."""
        await self.decode_streams.close()
        await self.channel.close()

    @property
    def is_routable(self) -> bool:
        """Whether new requests may go to this worker."""
        return self.is_healthy and self.has_joined and not self.is_leaving

    @property
    def state(self) -> str:
        """One of WORKER_STATES."""
        if self.is_leaving:
            return "leaving"
        if not self.has_joined:
            return "joining"
        return "serving" if self.is_healthy else "not_serving"


class WorkerPool:
    """Workers of one role: the static ones given at start, plus what discovery adds."""

    def __init__(
        self,
        addresses: list[str],
        credentials: grpc.ChannelCredentials | None = None,
        auth_token: str | None = None,
        role: str = "",
    ) -> None:
        self.role = role
        self._credentials = credentials
        self._metadata = bearer_metadata(auth_token)
        self.workers: list[WorkerHandle] = [self._handle(address) for address in addresses]
        self.needs_snapshot = False  # set by the proxy when routing reads KV events
        self.num_joins = 0
        self.num_leaves = 0
        # Per-worker tasks the pool owns (health watch, KV subscription), by worker.
        self._tasks: dict[WorkerHandle, list[asyncio.Task[None]]] = {}
        self._on_added: list[Callable[[WorkerHandle], asyncio.Task[None]]] = []
        self._is_watching = False

    def _handle(self, address: str, has_joined: bool = True) -> WorkerHandle:
        if self._credentials is not None:
            channel = grpc.aio.secure_channel(address, self._credentials, options=CHANNEL_OPTIONS)
        else:
            channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
        return WorkerHandle(
            address,
            channel,
            pb_grpc.WorkerStub(channel),
            health_pb2_grpc.HealthStub(channel),
            self._metadata,
            has_joined=has_joined,
        )

    # ------------------------------------------------------------ routing view

    @property
    def num_healthy(self) -> int:
        """Workers that take new requests."""
        return sum(w.is_routable for w in self.workers)

    @property
    def healthy(self) -> list[WorkerHandle]:
        """Workers that take new requests (healthy, joined, not leaving)."""
        return [w for w in self.workers if w.is_routable]

    def num_in_state(self) -> Counter[str]:
        return Counter(w.state for w in self.workers)

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

    # ------------------------------------------------------------ membership

    def on_added(self, start: Callable[[WorkerHandle], asyncio.Task[None]]) -> None:
        """`start(worker)` runs for every member, present and future; the pool owns the task it returns."""
        self._on_added.append(start)
        for worker in self.workers:
            self._own(worker, start(worker))

    def watch_health(self) -> None:
        """Follow every member's health on a `Health.Watch` stream (now and as members join)."""
        if not self._is_watching:
            self._is_watching = True
            self.on_added(lambda w: asyncio.create_task(self._watch(w), name=f"health {w.address}"))

    def add(self, address: str) -> WorkerHandle:
        """A discovered worker: `joining` until `update_membership` sees it SERVING (and synced)."""
        worker = self._handle(address, has_joined=False)
        self.workers.append(worker)
        logger.info("%s worker %s discovered: joining", self.role or "a", address)
        for start in self._on_added:
            self._own(worker, start(worker))
        return worker

    def retire(self, worker: WorkerHandle) -> None:
        """Gone from DNS: no new requests; dropped once its in-flight requests end."""
        if not worker.is_leaving:
            worker.is_leaving = True
            logger.info(
                "%s worker %s left DNS: leaving after %d in-flight requests",
                self.role or "a",
                worker.address,
                worker.num_outstanding,
            )

    def readmit(self, worker: WorkerHandle) -> None:
        """Back in DNS before it was dropped: it may take requests again."""
        worker.is_leaving = False

    async def update_membership(self) -> None:
        """Joins (SERVING, and synced where needed) and drops (leaving, nothing in flight)."""
        for worker in list(self.workers):
            if not worker.has_joined and worker.is_healthy and (not self.needs_snapshot or worker.kv_index.is_synced):
                worker.has_joined = True
                self.num_joins += 1
                logger.info("%s worker %s joined", self.role or "a", worker.address)
            if worker.is_leaving and worker.num_outstanding == 0:
                await self._drop(worker)

    async def _drop(self, worker: WorkerHandle) -> None:
        self.workers.remove(worker)
        if worker.has_joined:
            self.num_leaves += 1
        for task in self._tasks.pop(worker, []):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await worker.close()
        logger.info("%s worker %s dropped", self.role or "a", worker.address)

    def _own(self, worker: WorkerHandle, task: asyncio.Task[None]) -> None:
        self._tasks.setdefault(worker, []).append(task)

    # ------------------------------------------------------------ health

    async def check_all(self, timeout: float) -> None:
        await asyncio.gather(*(self._check(w, timeout) for w in self.workers))

    async def _check(self, worker: WorkerHandle, timeout: float) -> None:
        try:
            reply = await worker.health.Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout)
        except grpc.aio.AioRpcError as e:
            worker.is_healthy = False
            worker.last_error = f"{e.code().name}: {e.details()}"
            return
        _set_health(worker, reply.status)

    async def _watch(self, worker: WorkerHandle) -> None:
        """Health as the worker reports it, the moment it changes; reconnects with a backoff."""
        backoff = 0.1
        while True:
            call = worker.health.Watch(health_pb2.HealthCheckRequest(service=""))
            try:
                async for reply in call:
                    _set_health(worker, reply.status)
                    backoff = 0.1
                worker.is_healthy = False  # the stream ended: the server is stopping
                worker.last_error = "health watch ended"
            except grpc.aio.AioRpcError as e:
                worker.is_healthy = False
                worker.last_error = f"{e.code().name}: {e.details()}"
            finally:
                call.cancel()
            await asyncio.sleep(backoff)  # reconnect backoff, not synchronisation
            backoff = min(backoff * 2, _WATCH_MAX_BACKOFF_S)

    async def close(self) -> None:
        for tasks in self._tasks.values():
            for task in tasks:
                task.cancel()
        for tasks in self._tasks.values():
            for task in tasks:
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self._tasks.clear()
        for worker in self.workers:
            await worker.close()


def _set_health(worker: WorkerHandle, status: int) -> None:
    worker.is_healthy = status == _SERVING
    worker.last_error = "" if worker.is_healthy else health_pb2.HealthCheckResponse.ServingStatus.Name(status)
