"""Routing policies on fake worker handles: kv-aware costs, round-robin, least-loaded,
conditional disaggregation, unhealthy workers never picked."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

from kvservice.core.block_hash import block_hashes
from kvservice.runtime.routing_args import DEFAULT_PEER_PULL_MIN_TOKENS
from kvservice.server.errors import NoWorkerAvailable
from kvservice.server.proxy.kv_index import KVBlockIndex
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


def hold(worker: WorkerHandle, token_ids: list[int], offloaded: list[int] | None = None) -> None:
    """Give `worker`'s index a snapshot in which it caches the full blocks of `token_ids`, and
    keeps those of `offloaded` in its offload tier."""
    batch = pb.KVEventBatch(seq=1, is_snapshot=True, block_size=BLOCK_SIZE, hash_seed=SEED)
    for tier, tokens in ((pb.KV_TIER_CACHE, token_ids), (pb.KV_TIER_OFFLOAD, offloaded or [])):
        hashes = block_hashes(tokens, BLOCK_SIZE, SEED)
        if hashes:
            event = batch.events.add(tier=tier)
            event.stored.block_hashes.extend(hashes)
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


async def test_a_prefix_in_a_workers_offload_tier_prices_between_its_cache_and_nowhere(
    pools: tuple[WorkerPool, WorkerPool],
) -> None:
    prefill, decode = pools
    d0, d1 = decode.workers
    hold(d1, [], offloaded=PREFIX)
    router = Router(prefill, decode, "kv-aware")
    for _ in range(2):
        assert router.route(PREFIX + [7]).decode is d1  # a load from its store beats a whole pull
    hold(d0, PREFIX)
    for _ in range(2):
        assert router.route(PREFIX + [7]).decode is d0  # the same blocks in a cache beat a load
    # Conditional disaggregation: what the tier holds is the decode worker's own too.
    local = Router(prefill, decode, "kv-aware", max_local_prefill_tokens=8)
    hold(d0, [])
    route = local.route(PREFIX + [7])
    assert route.decode is d1 and route.prefill is None and route.num_uncached_tokens == 1


async def test_a_prefill_worker_whose_tier_holds_the_prefix_is_picked() -> None:
    prefill = WorkerPool(["127.0.0.1:1", "127.0.0.1:4"])
    decode = WorkerPool(["127.0.0.1:2"])
    try:
        for worker in prefill.workers + decode.workers:
            worker.is_healthy = True
            hold(worker, [])
        hold(prefill.workers[1], PREFIX[:64], offloaded=PREFIX)
        router = Router(prefill, decode, "kv-aware")
        for _ in range(2):
            assert router.route(PREFIX + [7]).prefill is prefill.workers[1]
    finally:
        await prefill.close()
        await decode.close()


async def test_the_index_finds_a_cache_run_then_a_tier_run_as_the_worker_looks_up() -> None:
    index = KVBlockIndex()
    hashes = block_hashes(PREFIX, BLOCK_SIZE, SEED)  # 10 blocks
    batch = pb.KVEventBatch(seq=1, is_snapshot=True, block_size=BLOCK_SIZE, hash_seed=SEED)
    batch.events.add().stored.block_hashes.extend(hashes[:3] + hashes[6:])
    batch.events.add(tier=pb.KV_TIER_OFFLOAD).stored.block_hashes.extend(hashes[2:5] + hashes[7:])
    assert index.apply(batch)
    # Cache: 0-2 (6 on is past a miss); then the tier from block 3: 3, 4 (5 is nowhere).
    assert index.locate_blocks(hashes) == (3, 2)
    later = pb.KVEventBatch(seq=2, block_size=BLOCK_SIZE, hash_seed=SEED)
    later.events.add(tier=pb.KV_TIER_OFFLOAD).removed.block_hashes.append(hashes[4])
    later.events.add(tier=pb.KV_TIER_CACHE).removed.block_hashes.append(hashes[0])
    assert index.apply(later)
    assert index.locate_blocks(hashes) == (0, 0)  # block 0 is in neither now
    assert index.apply(pb.KVEventBatch(seq=7, is_snapshot=True, block_size=BLOCK_SIZE, hash_seed=SEED))
    assert index.block_hashes == set() and index.offload_hashes == set()  # a snapshot replaces both


ANSWER = list(range(200, 296))  # the previous turn's answer: 6 blocks


async def test_the_decode_worker_that_served_the_last_turn_is_the_prefill_workers_prefix_source(
    pools: tuple[WorkerPool, WorkerPool],
) -> None:
    prefill, decode = pools
    [p] = prefill.workers
    d0, d1 = decode.workers
    hold(p, PREFIX)  # the last turn's prompt
    hold(d1, PREFIX + ANSWER)  # and its answer
    route = Router(prefill, decode, "kv-aware").route(PREFIX + ANSWER + [7] * 8)
    assert route.prefill is p and route.decode is d1
    assert route.prefix_source is not None
    assert route.prefix_source.worker is d1 and route.prefix_source.role == "decode"
    assert route.prefix_source.num_cached_tokens == len(PREFIX + ANSWER)


async def test_a_peer_holding_little_more_than_the_prefill_worker_is_no_source(
    pools: tuple[WorkerPool, WorkerPool],
) -> None:
    prefill, decode = pools
    [p] = prefill.workers
    hold(p, PREFIX)
    short_answer = ANSWER[: DEFAULT_PEER_PULL_MIN_TOKENS - BLOCK_SIZE]
    hold(decode.workers[1], PREFIX + short_answer)
    route = Router(prefill, decode, "kv-aware").route(PREFIX + short_answer + [7] * 8)
    assert route.prefix_source is None


async def test_a_decode_worker_that_prefills_itself_pulls_from_the_worker_that_holds_most(
    pools: tuple[WorkerPool, WorkerPool],
) -> None:
    """A migrated stream (no prefill worker): its new decode worker pulls the prompt from whichever
    worker caches most of it, a prefill worker or another decode worker."""
    prefill, decode = pools
    [p] = prefill.workers
    d0, d1 = decode.workers
    hold(p, PREFIX)
    router = Router(prefill, decode, "kv-aware")
    route = router.route(PREFIX + [7], exclude_decode={d1.address}, use_prefill=False)
    assert route.decode is d0 and route.prefill is None
    assert route.prefix_source is not None and route.prefix_source.worker is p
    assert route.prefix_source.role == "prefill"
    hold(d1, PREFIX + ANSWER)
    route = router.route(PREFIX + ANSWER + [7], exclude_decode={d1.address}, use_prefill=False)
    assert route.decode is d0 and route.prefix_source is not None
    assert route.prefix_source.worker is d1 and route.prefix_source.role == "decode"


async def test_round_robin_or_a_zero_minimum_names_no_prefix_source(pools: tuple[WorkerPool, WorkerPool]) -> None:
    prefill, decode = pools
    hold(decode.workers[1], PREFIX + ANSWER)
    assert Router(prefill, decode, "round-robin").route(PREFIX + ANSWER + [7]).prefix_source is None
    no_pulls = Router(prefill, decode, "kv-aware", peer_pull_min_tokens=0)
    assert no_pulls.route(PREFIX + ANSWER + [7]).prefix_source is None
