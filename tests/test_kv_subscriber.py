"""The proxy's cache index follows a real engine's KV events over gRPC, and recovers
through a snapshot when the stream is killed mid-way or loses a batch."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
import pytest
import pytest_asyncio
from conftest import serving_worker, wait_for

from kvservice.config import EngineConfig
from kvservice.core.sampling_params import SamplingParams
from kvservice.engine.async_engine import AsyncLLMEngine
from kvservice.engine.engine_builder import build_engine
from kvservice.server.kv_events import KVEventPublisher
from kvservice.server.proxy.kv_subscriber import KVEventSubscriptions
from kvservice.server.proxy.worker_pool import WorkerHandle, WorkerPool
from kvservice.server.worker_service import EngineWorkerService
from kvservice.v1 import kvservice_pb2 as pb

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(120)]

# 24 blocks of 8 tokens: a few 40-token requests evict what earlier ones cached.
CONFIG = EngineConfig(block_size=8, num_blocks=24, max_model_len=128)
PARAMS = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)


class FaultyWorker(EngineWorkerService):
    """SubscribeKVEvents with faults: `is_blackout` swallows live batches (events lost in
    transit), `kill_on_next` ends the stream with UNAVAILABLE at the next batch, `drop_next`
    loses one live batch (a gap in the numbers)."""

    def __init__(self, engine: AsyncLLMEngine, kv_events: KVEventPublisher) -> None:
        super().__init__(engine, "decode", kv_events)
        self.is_blackout = False
        self.kill_on_next = False
        self.drop_next = False

    async def SubscribeKVEvents(
        self, request: pb.KVEventsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.KVEventBatch]:
        async for batch in super().SubscribeKVEvents(request, context):
            if self.kill_on_next:
                self.kill_on_next = self.is_blackout = False
                await context.abort(grpc.StatusCode.UNAVAILABLE, "event stream killed by the test")
            if batch.is_snapshot or not (self.is_blackout or self.drop_next):
                yield batch
            self.drop_next = False


@dataclass
class Setup:
    engine: AsyncLLMEngine
    worker: FaultyWorker
    handle: WorkerHandle
    subscriptions: KVEventSubscriptions

    async def run(self, prompt: list[int]) -> None:
        async for _ in self.engine.generate(prompt, PARAMS):
            pass

    async def cached(self) -> set[int]:
        """What the engine's prefix cache holds now."""
        events = await self.engine.call(lambda engine: engine.kv_cache_snapshot())
        return {event.block_hashes[0] for event in events}

    async def wait_until_index_matches(self) -> set[int]:
        async def matches() -> set[int] | None:
            cached = await self.cached()
            index = self.handle.kv_index
            return cached if index.is_synced and index.block_hashes == cached else None

        return await wait_for(matches, "the index equal to the worker's cache")


@pytest_asyncio.fixture
async def setup() -> AsyncIterator[Setup]:
    engine = build_engine("tiny", CONFIG)
    publisher = KVEventPublisher(asyncio.get_running_loop(), CONFIG.block_size, engine.core.kv_hash_seed)
    async_engine = AsyncLLMEngine(engine, kv_events_sink=publisher.publish)
    async_engine.start()
    worker = FaultyWorker(async_engine, publisher)
    async with serving_worker(worker) as address:
        pool = WorkerPool([address])
        subscriptions = KVEventSubscriptions(pool.workers)
        subscriptions.start()
        try:
            yield Setup(async_engine, worker, pool.workers[0], subscriptions)
        finally:
            await subscriptions.close()
            await pool.close()
            publisher.close()
        await async_engine.stop()


def prompts(num: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 256) for _ in range(length)] for _ in range(num)]


async def test_the_index_recovers_through_a_snapshot_after_the_stream_is_killed(setup: Setup) -> None:
    prefix = prompts(1, 24, seed=1)[0]
    for suffix in prompts(3, 9, seed=2):
        await setup.run(prefix + suffix)
    first = await setup.wait_until_index_matches()
    assert len(first) >= 3 + 3  # the shared prefix's 3 blocks and more
    assert setup.subscriptions.num_subscribes[setup.handle.address] == 1
    assert setup.handle.kv_index.block_size == CONFIG.block_size

    # Events lost in transit: the index goes stale (evictions included) ...
    setup.worker.is_blackout = True
    for prompt in prompts(5, 40, seed=3):
        await setup.run(prompt)
    cached = await setup.cached()
    assert first - cached, "nothing was evicted: the test would not show removals recovering"
    assert setup.handle.kv_index.block_hashes != cached
    # ... until the stream dies and the proxy resubscribes: the snapshot replaces the index.
    setup.worker.kill_on_next = True
    await setup.run(prompts(1, 17, seed=4)[0])
    recovered = await setup.wait_until_index_matches()
    assert not (first - cached) & recovered
    assert setup.subscriptions.num_subscribes[setup.handle.address] == 2


async def test_a_gap_in_the_numbers_resubscribes_for_a_snapshot(setup: Setup) -> None:
    await setup.run(prompts(1, 33, seed=5)[0])
    await setup.wait_until_index_matches()
    setup.worker.drop_next = True
    for prompt in prompts(3, 33, seed=6):
        await setup.run(prompt)
    await setup.wait_until_index_matches()
    assert setup.subscriptions.num_subscribes[setup.handle.address] == 2
