"""The worker's KV event publisher: numbering, snapshots for late or gapped subscribers, bounds."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from kvservice.core.block_pool import KVCacheEvent
from kvservice.server.kv_events import KVEventPublisher, PublisherClosed, SubscriberTooSlow
from kvservice.v1 import kvservice_pb2 as pb

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(30)]

BLOCK_SIZE, SEED = 16, 12345


class FakeWorker:
    """A publisher fed as the engine thread feeds it; `cached` stands for the block pool."""

    def __init__(self, ring_size: int = 8, max_pending: int = 100) -> None:
        self.loop = asyncio.get_running_loop()
        self.publisher = KVEventPublisher(self.loop, BLOCK_SIZE, SEED, ring_size=ring_size, max_pending=max_pending)
        self.cached: dict[int, int] = {}  # block hash -> parent

    def store(self, *hashes: int, parent: int = SEED) -> None:
        for h in hashes:
            self.cached[h] = parent
            parent = h
        self.publisher.publish([KVCacheEvent("stored", hashes, self.cached[hashes[0]])])

    def remove(self, *hashes: int) -> None:
        for h in hashes:
            del self.cached[h]
        self.publisher.publish([KVCacheEvent("removed", hashes)])

    async def take_snapshot(self) -> pb.KVEventBatch:
        # As `AsyncLLMEngine.call` does: computed on the step thread, settled through the loop.
        future: asyncio.Future[pb.KVEventBatch] = self.loop.create_future()
        snapshot = self.publisher.snapshot([KVCacheEvent("stored", (h,), p) for h, p in self.cached.items()])
        self.loop.call_soon_threadsafe(future.set_result, snapshot)
        return await future

    def subscribe(self, after_seq: int = 0) -> AsyncIterator[pb.KVEventBatch]:
        return self.publisher.subscribe(after_seq, self.take_snapshot)


def hashes_of(batch: pb.KVEventBatch) -> list[tuple[str, list[int]]]:
    return [(e.WhichOneof("kind"), list(getattr(e, e.WhichOneof("kind")).block_hashes)) for e in batch.events]


async def test_a_subscriber_from_zero_gets_a_snapshot_then_numbered_live_batches() -> None:
    worker = FakeWorker()
    stream = worker.subscribe()
    snapshot = await anext(stream)
    assert (snapshot.seq, snapshot.is_snapshot, snapshot.events) == (0, True, [])
    assert (snapshot.block_size, snapshot.hash_seed) == (BLOCK_SIZE, SEED)
    worker.store(11, 12)
    worker.store(13, parent=12)
    worker.remove(11)
    batches = [await anext(stream) for _ in range(3)]
    assert [b.seq for b in batches] == [1, 2, 3]
    assert not any(b.is_snapshot for b in batches)
    assert all((b.block_size, b.hash_seed) == (BLOCK_SIZE, SEED) for b in batches)
    assert [hashes_of(b) for b in batches] == [[("stored", [11, 12])], [("stored", [13])], [("removed", [11])]]
    assert batches[1].events[0].stored.parent_hash == 12
    await stream.aclose()
    assert worker.publisher.num_subscribers == 0


async def test_a_late_subscriber_gets_what_is_cached_numbered_with_the_last_batch() -> None:
    worker = FakeWorker()
    worker.store(1, 2, 3)
    worker.remove(2, 3)
    worker.store(4, parent=1)
    stream = worker.subscribe()
    snapshot = await anext(stream)
    assert snapshot.is_snapshot and snapshot.seq == 3
    assert sorted(h for _, hs in hashes_of(snapshot) for h in hs) == [1, 4]
    worker.store(5, parent=4)
    live = await anext(stream)
    assert (live.seq, live.is_snapshot, hashes_of(live)) == (4, False, [("stored", [5])])
    await stream.aclose()


async def test_resuming_within_the_ring_replays_only_the_missed_batches() -> None:
    worker = FakeWorker(ring_size=8)
    for h in range(1, 6):
        worker.store(h * 10)
    first = worker.subscribe()
    assert (await anext(first)).seq == 5  # the loop has seen all five once the snapshot is back
    await first.aclose()
    stream = worker.subscribe(after_seq=3)
    assert [(await anext(stream)).seq for _ in range(2)] == [4, 5]
    worker.store(60)
    assert (await anext(stream)).seq == 6
    await stream.aclose()


async def test_a_gap_past_the_ring_or_an_unknown_seq_gets_a_snapshot_and_the_ring_is_bounded() -> None:
    worker = FakeWorker(ring_size=4)
    for h in range(1, 11):
        worker.store(h * 10)
    warm = worker.subscribe()
    await anext(warm)
    await warm.aclose()
    ring = worker.publisher._ring
    assert len(ring) == 4 and [b.seq for b in ring] == [7, 8, 9, 10]
    for after_seq in (2, 5, 99):  # 6 is the oldest that can resume (7 is in the ring); 99 never was
        stream = worker.subscribe(after_seq=after_seq)
        snapshot = await anext(stream)
        assert snapshot.is_snapshot and snapshot.seq == 10, after_seq
        assert len(snapshot.events) == 10
        await stream.aclose()
    stream = worker.subscribe(after_seq=6)
    assert [(await anext(stream)).seq for _ in range(4)] == [7, 8, 9, 10]
    await stream.aclose()


async def test_a_subscriber_that_falls_behind_is_dropped_and_others_are_not() -> None:
    worker = FakeWorker(max_pending=3)
    slow, fast = worker.subscribe(), worker.subscribe()
    await anext(slow)
    await anext(fast)
    for h in range(1, 5):  # 4 batches: one more than the slow one may have pending
        worker.store(h)
        assert (await anext(fast)).seq == h
    with pytest.raises(SubscriberTooSlow):
        await anext(slow)
    assert worker.publisher.num_subscribers == 1
    again = worker.subscribe()  # it resubscribes: a snapshot of all four
    snapshot = await anext(again)
    assert snapshot.is_snapshot and snapshot.seq == 4 and len(snapshot.events) == 4
    await again.aclose()
    await fast.aclose()


async def test_close_ends_every_stream_and_refuses_new_ones() -> None:
    worker = FakeWorker()
    stream = worker.subscribe()
    await anext(stream)
    worker.store(1)
    assert (await anext(stream)).seq == 1
    worker.publisher.close()
    with pytest.raises(PublisherClosed):
        await anext(stream)
    with pytest.raises(PublisherClosed):
        await anext(worker.subscribe())
