"""Routing policies on fake worker handles: kv-aware costs, round-robin, least-loaded,
conditional disaggregation, unhealthy workers never picked."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

from kvservice.core.block_hash import block_hashes
from kvservice.server.errors import NoWorkerAvailable
from kvservice.server.proxy.router import DECODE_LOAD_TOKENS, Router
from kvservice.server.proxy.worker_pool import WorkerHandle, WorkerPool
from kvservice.v1 import kvservice_pb2 as pb

pytestmark = pytest.mark.asyncio

BLOCK_SIZE, SEED = 16, 99
PREFIX = list(range(1, 161))  # 10 blocks


@pytest_asyncio.fixture
async def pools() -> AsyncIterator[tuple[WorkerPool, WorkerPool]]:
    prefill = WorkerPool(["127.0.0.1:1"])
    decode = WorkerPool(["127.0.0.1:2", "127.0.0.1:3"])
    for worker in prefill.workers + decode.workers:
        worker.is_healthy = True
        hold(worker, [])
    try:
        yield prefill, decode
    finally:
        await prefill.close()
        await decode.close()


def hold(worker: WorkerHandle, token_ids: list[int]) -> None:
    """Give `worker`'s index a snapshot in which it caches the full blocks of `token_ids`."""
    hashes = block_hashes(token_ids, BLOCK_SIZE, SEED)
    batch = pb.KVEventBatch(seq=1, is_snapshot=True, block_size=BLOCK_SIZE, hash_seed=SEED)
    if hashes:
        batch.events.add().stored.block_hashes.extend(hashes)
    assert worker.kv_index.apply(batch)


async def test_kv_aware_picks_the_decode_worker_that_holds_the_prefix(pools: tuple[WorkerPool, WorkerPool]) -> None:
    prefill, decode = pools
    d0, d1 = decode.workers
    hold(d1, PREFIX)
    router = Router(prefill, decode, "kv-aware")
    for _ in range(4):  # ties never move it: the cost does
        route = router.route(PREFIX + [7, 8, 9])
        assert route.decode is d1 and route.prefill is prefill.workers[0]
        assert route.num_uncached_tokens == 3
    # Load moves it once the holder is far busier than a whole-prefix pull costs.
    d1.num_outstanding = 160 // DECODE_LOAD_TOKENS + 2
    assert router.route(PREFIX + [7]).decode is d0


async def test_without_token_ids_kv_aware_balances_by_load(pools: tuple[WorkerPool, WorkerPool]) -> None:
    prefill, decode = pools
    d0, d1 = decode.workers
    hold(d0, PREFIX)
    d0.num_outstanding = 1
    assert Router(prefill, decode, "kv-aware").route(None).decode is d1


async def test_round_robin_alternates_and_least_loaded_picks_the_idle_one(pools: tuple[WorkerPool, WorkerPool]) -> None:
    prefill, decode = pools
    d0, d1 = decode.workers
    hold(d0, PREFIX)
    round_robin = Router(prefill, decode, "round-robin")
    picked = [round_robin.route(PREFIX).decode for _ in range(4)]
    assert picked in ([d0, d1, d0, d1], [d1, d0, d1, d0])
    least_loaded = Router(prefill, decode, "least-loaded")
    d0.num_outstanding = 2
    assert all(least_loaded.route(PREFIX).decode is d1 for _ in range(3))
    d1.num_outstanding = 3
    assert least_loaded.route(PREFIX).decode is d0


async def test_unhealthy_and_excluded_workers_are_never_picked(pools: tuple[WorkerPool, WorkerPool]) -> None:
    prefill, decode = pools
    d0, d1 = decode.workers
    hold(d1, PREFIX)
    d1.is_healthy = False
    for policy in ("kv-aware", "least-loaded", "round-robin"):
        router = Router(prefill, decode, policy)
        assert {router.route(PREFIX).decode for _ in range(3)} == {d0}
        with pytest.raises(NoWorkerAvailable):
            router.route(PREFIX, exclude_decode={d0.address})
    prefill.workers[0].is_healthy = False
    assert Router(prefill, decode).route(PREFIX).prefill is None  # degraded: the decode worker prefills


async def test_the_decode_worker_prefills_what_it_lacks_up_to_the_limit(pools: tuple[WorkerPool, WorkerPool]) -> None:
    prefill, decode = pools
    d0, _ = decode.workers
    hold(d0, PREFIX)
    router = Router(prefill, decode, "kv-aware", max_local_prefill_tokens=32)
    assert router.route(PREFIX + list(range(32))).prefill is None  # 32 uncached: local
    assert router.route(PREFIX + list(range(33))).prefill is prefill.workers[0]  # 33: disaggregated
    assert router.route(list(range(500, 530))).prefill is None  # a short prompt, cached nowhere
    assert router.route(PREFIX).prefill is None  # a full hit
    assert router.route(PREFIX, use_prefill=False).prefill is None
    # 0 disables it: even a full hit is disaggregated.
    assert Router(prefill, decode, "kv-aware", max_local_prefill_tokens=0).route(PREFIX).prefill is prefill.workers[0]
