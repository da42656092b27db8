"""The proxy's subscriptions to its workers' KV events: one task per worker keeps its index current.

Each task subscribes from 0 (a snapshot, then live batches) and applies what comes. On a
gap in the numbers it resubscribes at once; when the stream fails or ends (the worker
restarted, dropped a slow subscriber, or is gone) it resubscribes after a backoff that
doubles up to `max_backoff_s` and resets once a snapshot arrives. Either way the next
snapshot replaces the index, so nothing lost in between lingers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterable

import grpc

from kvservice.server.proxy.worker_pool import WorkerHandle
from kvservice.v1 import kvservice_pb2 as pb

logger = logging.getLogger(__name__)

INITIAL_BACKOFF_S = 0.1
MAX_BACKOFF_S = 5.0


class KVEventSubscriptions:
    """Owns the subscription tasks: `start` them, `close` cancels and awaits them."""

    def __init__(self, workers: Iterable[WorkerHandle], max_backoff_s: float = MAX_BACKOFF_S) -> None:
        self.workers = list(workers)
        self.max_backoff_s = max_backoff_s
        self._tasks: list[asyncio.Task[None]] = []
        # Subscriptions opened per worker address: each one past the first is a recovery.
        self.num_subscribes: dict[str, int] = {w.address: 0 for w in self.workers}

    def start(self) -> None:
        self._tasks = [self.follow(w) for w in self.workers]

    def follow(self, worker: WorkerHandle) -> asyncio.Task[None]:
        """A task that keeps `worker`'s index current; the caller owns it (the pool, for discovered workers)."""
        self.num_subscribes.setdefault(worker.address, 0)
        return asyncio.create_task(self._follow(worker), name=f"kv-events {worker.address}")

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []

    async def _follow(self, worker: WorkerHandle) -> None:
        backoff = INITIAL_BACKOFF_S
        while True:
            self.num_subscribes[worker.address] += 1
            num_applied, is_gap = await self._subscribe_once(worker)
            if num_applied:
                backoff = INITIAL_BACKOFF_S
            if is_gap:
                continue  # the worker is fine: resubscribe at once
            await asyncio.sleep(backoff)  # reconnect backoff, not synchronisation
            backoff = min(backoff * 2, self.max_backoff_s)

    async def _subscribe_once(self, worker: WorkerHandle) -> tuple[int, bool]:
        """One subscription until it breaks: (batches applied, whether a gap broke it)."""
        call = worker.stub.SubscribeKVEvents(pb.KVEventsRequest(after_seq=0), metadata=worker.metadata)
        num_applied = 0
        try:
            async for batch in call:
                if not worker.kv_index.apply(batch):
                    logger.info(
                        "KV events of %s: batch %d after %d, resubscribing for a snapshot",
                        worker.address,
                        batch.seq,
                        worker.kv_index.last_seq,
                    )
                    return num_applied, True
                num_applied += 1
            logger.info("KV events of %s: the stream ended; resubscribing", worker.address)
        except grpc.aio.AioRpcError as e:
            level = logging.DEBUG if e.code() == grpc.StatusCode.UNAVAILABLE else logging.WARNING
            logger.log(level, "KV events of %s: %s: %s", worker.address, e.code().name, e.details())
        finally:
            call.cancel()
        worker.kv_index.is_synced = False
        return num_applied, False
