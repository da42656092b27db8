"""A worker's prefix cache events for `Worker.SubscribeKVEvents`: numbered batches, snapshots, fan-out.

The engine's step thread hands each step's events to `publish`, which numbers the batch
(1, 2, 3... per process) and passes it to the event loop; the loop keeps the last
`ring_size` batches and queues each one for every subscriber. A subscriber that starts
from 0, or from a batch the ring no longer holds, first gets a snapshot of everything
cached, taken on the step thread (`snapshot`) and numbered with the last batch published
before it, so the live batches follow it without a gap; one the snapshot already reflects
may repeat, which is harmless (see `BlockPool.snapshot`). A subscriber more than
`max_pending` batches behind is dropped: its stream ends with RESOURCE_EXHAUSTED and it
resubscribes from a snapshot, rather than the worker buffering without bound.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

from kvservice.core.block_pool import KVCacheEvent
from kvservice.server.convert import kv_event_to_proto
from kvservice.v1 import kvservice_pb2 as pb

DEFAULT_RING_SIZE = 1024
DEFAULT_MAX_PENDING = 4096

# Takes a snapshot batch on the step thread (`publisher.snapshot(engine.kv_cache_snapshot())`).
SnapshotSource = Callable[[], Awaitable[pb.KVEventBatch]]


class SubscriberTooSlow(Exception):
    """The subscriber fell too far behind; it must resubscribe (and gets a snapshot)."""


class PublisherClosed(Exception):
    """The worker is shutting down: no more events."""


@dataclass(eq=False, slots=True)
class _Subscriber:
    pending: deque[pb.KVEventBatch] = field(default_factory=deque)
    wakeup: asyncio.Event = field(default_factory=asyncio.Event)
    is_dropped: bool = False


class KVEventPublisher:
    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        block_size: int,
        hash_seed: int,
        ring_size: int = DEFAULT_RING_SIZE,
        max_pending: int = DEFAULT_MAX_PENDING,
    ) -> None:
        if ring_size < 1 or max_pending < 1:
            raise ValueError(f"ring_size and max_pending must be >= 1, got {ring_size}, {max_pending}")
        self._loop = loop
        self.block_size = block_size
        self.hash_seed = hash_seed
        self.max_pending = max_pending
        self._last_seq = 0  # the step thread's: numbered there, so a snapshot taken there agrees with it
        self._ring: deque[pb.KVEventBatch] = deque(maxlen=ring_size)
        self._subscribers: set[_Subscriber] = set()
        self._is_closed = False

    # ------------------------------------------------------------ the step thread

    def publish(self, events: list[KVCacheEvent]) -> None:
        """Number one step's events and hand them to the loop (an `AsyncLLMEngine` sink)."""
        if not events:
            return
        self._last_seq += 1
        batch = self._batch(self._last_seq, events, is_snapshot=False)
        self._loop.call_soon_threadsafe(self._fan_out, batch)

    def snapshot(self, cached: list[KVCacheEvent]) -> pb.KVEventBatch:
        """`cached` (`LLMEngine.kv_cache_snapshot()`, on the step thread) as a snapshot batch
        numbered with the last batch published: live batches resume after it."""
        return self._batch(self._last_seq, cached, is_snapshot=True)

    def _batch(self, seq: int, events: list[KVCacheEvent], is_snapshot: bool) -> pb.KVEventBatch:
        return pb.KVEventBatch(
            seq=seq,
            is_snapshot=is_snapshot,
            events=[kv_event_to_proto(e) for e in events],
            block_size=self.block_size,
            hash_seed=self.hash_seed,
        )

    # ------------------------------------------------------------ the event loop

    @property
    def num_subscribers(self) -> int:
        return len(self._subscribers)

    def _fan_out(self, batch: pb.KVEventBatch) -> None:
        self._ring.append(batch)
        for subscriber in self._subscribers:
            if subscriber.is_dropped:
                continue
            if len(subscriber.pending) >= self.max_pending:
                subscriber.is_dropped = True
                subscriber.pending.clear()
            else:
                subscriber.pending.append(batch)
            subscriber.wakeup.set()

    def _backlog_after(self, after_seq: int) -> list[pb.KVEventBatch] | None:
        """The ring's batches after `after_seq`, or None when some of them are gone (or never were)."""
        newest = self._ring[-1].seq if self._ring else 0
        if after_seq == newest:
            return []
        if not self._ring or after_seq > newest or self._ring[0].seq > after_seq + 1:
            return None
        return [batch for batch in self._ring if batch.seq > after_seq]

    async def subscribe(self, after_seq: int, take_snapshot: SnapshotSource) -> AsyncIterator[pb.KVEventBatch]:
        """The batches after `after_seq`, then live ones, forever; a snapshot first when
        `after_seq` is 0 or no longer in the ring. Raises SubscriberTooSlow when dropped,
        PublisherClosed when the worker stops."""
        if self._is_closed:
            raise PublisherClosed("the worker is shutting down")
        backlog = self._backlog_after(after_seq) if after_seq else None
        if backlog is None:
            snapshot = await take_snapshot()
            # Batches are handed to the loop in order, before the snapshot's result is: every
            # batch up to the snapshot's number is in the ring by now.
            newer = self._backlog_after(snapshot.seq)
            if newer is None:  # fell out of a tiny ring while we waited: start over
                raise SubscriberTooSlow("events moved on while the snapshot was taken; resubscribe")
            backlog = [snapshot, *newer]
        subscriber = _Subscriber(deque(backlog))
        self._subscribers.add(subscriber)  # no await since the backlog was read: nothing is missed
        try:
            while True:
                if subscriber.is_dropped:
                    raise SubscriberTooSlow(f"more than {self.max_pending} event batches behind; resubscribe")
                if subscriber.pending:
                    yield subscriber.pending.popleft()
                    continue
                if self._is_closed:
                    raise PublisherClosed("the worker is shutting down")
                subscriber.wakeup.clear()
                await subscriber.wakeup.wait()
        finally:
            self._subscribers.discard(subscriber)

    def close(self) -> None:
        """End every subscription (after what it has queued) and refuse new ones: a stream
        that never ends would hold a graceful shutdown for its whole grace period."""
        self._is_closed = True
        for subscriber in self._subscribers:
            subscriber.wakeup.set()
