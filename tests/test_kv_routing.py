"""KV-aware routing and conditional disaggregation on launched clusters (tiny model).

The proxy learns what each worker caches from its KV events: requests that share a long
prefix go to the decode worker that holds it (it pulls only the tail), and with
`--max-local-prefill-tokens 128` short prompts and a conversation's next turn never reach
the prefill worker, while long prompts do. Outputs equal the tiny model's greedy output.
"""

from __future__ import annotations

import asyncio
import random

import grpc
import pytest
from conftest import (
    all_worker_stats,
    local_cluster,
    metric_value,
    scrape,
    tiny_greedy,
    wait_for,
    wait_for_stats,
    worker_stats,
)

from kvservice.client.client import KVServiceClient
from kvservice.client.cluster import LocalCluster
from kvservice.core.block_hash import block_hashes
from kvservice.v1 import kvservice_pb2 as pb
from kvservice.v1 import kvservice_pb2_grpc as pb_grpc

pytestmark = [pytest.mark.slow, pytest.mark.asyncio, pytest.mark.timeout(240)]

WORKER_ARGS = ("--num-blocks", "128", "--num-threads", "1")
BLOCK_SIZE = 16  # the workers' default
MAX_TOKENS = 8


def random_tokens(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 256) for _ in range(length)]


async def complete(address: str, prompt: list[int]) -> list[int]:
    async with KVServiceClient(address) as client:
        completion = await client.complete(prompt, timeout=60, max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    return list(completion.token_ids)


async def wait_until_indexed(cluster: LocalCluster, address: str, num_blocks: int) -> None:
    """The proxy's index of `address` holds at least `num_blocks` blocks (its events arrived)."""

    async def indexed() -> bool:
        stats = await worker_stats(cluster.address)
        return any(w.address == address and w.num_indexed_blocks >= num_blocks for w in stats.workers)

    await wait_for(indexed, f"{num_blocks} blocks of {address} in the proxy's index")


async def wait_for_finished(
    addresses: list[str], before: dict[str, pb.StatsResponse], increments: dict[str, int]
) -> dict[str, pb.StatsResponse]:
    """Each worker's Stats once its finished requests grew by `increments` (the end of a stream
    reaches the client a moment before the worker counts it)."""
    return await wait_for_stats(
        addresses,
        lambda stats: all(
            stats[a].num_finished_requests - before[a].num_finished_requests >= increments.get(a, 0) for a in addresses
        ),
        "the requests counted",
    )


async def test_requests_sharing_a_prefix_go_to_the_decode_worker_that_holds_it() -> None:
    prefix = random_tokens(10 * BLOCK_SIZE, seed=1)
    prompts = [prefix + random_tokens(8, seed=10 + i) for i in range(3)]
    expected = tiny_greedy(prompts, MAX_TOKENS)
    async with local_cluster("tiny", num_prefill=1, num_decode=2, worker_args=WORKER_ARGS) as cluster:
        decoders = cluster.decode_addresses
        before = await all_worker_stats(decoders)
        assert await complete(cluster.address, prompts[0]) == expected[0]
        after_first = await wait_for_stats(
            decoders,
            lambda s: sum(s[a].num_finished_requests - before[a].num_finished_requests for a in decoders) == 1,
            "one finished",
        )
        [holder] = [a for a in decoders if after_first[a].num_finished_requests > before[a].num_finished_requests]
        [other] = [a for a in decoders if a != holder]
        bytes_per_block = after_first[holder].kv_receiving.num_bytes // 11  # 168 tokens: 11 blocks pulled
        await wait_until_indexed(cluster, holder, 10)
        for prompt, want in zip(prompts[1:], expected[1:]):
            assert await complete(cluster.address, prompt) == want
        after = await wait_for_finished(decoders, after_first, {holder: 2})
        assert after[other].num_finished_requests == before[other].num_finished_requests
        assert after[other].kv_receiving.num_bytes == before[other].kv_receiving.num_bytes
        # The holder pulled only each prompt's uncached last block, and found the prefix in its cache.
        assert after[holder].kv_receiving.num_bytes - after_first[holder].kv_receiving.num_bytes == 2 * bytes_per_block
        assert after[holder].prefix_cache.hits - after_first[holder].prefix_cache.hits >= 2 * len(prefix)


async def test_round_robin_alternates_even_when_one_decode_worker_holds_the_prompt() -> None:
    prompt = random_tokens(6 * BLOCK_SIZE, seed=7)
    expected = tiny_greedy([prompt], MAX_TOKENS)[0]
    proxy_args = ("--routing", "round-robin")
    async with local_cluster(
        "tiny", num_prefill=1, num_decode=2, worker_args=WORKER_ARGS, proxy_args=proxy_args
    ) as cluster:
        decoders = cluster.decode_addresses
        before = await all_worker_stats(decoders)
        finished: list[str] = []
        for i in range(4):
            assert await complete(cluster.address, prompt) == expected
            stats = await wait_for_stats(
                decoders,
                lambda s, n=i + 1: (
                    sum(s[a].num_finished_requests - before[a].num_finished_requests for a in decoders) == n
                ),
                "the request counted",
            )
            [latest] = [
                a
                for a in decoders
                if stats[a].num_finished_requests - before[a].num_finished_requests > finished.count(a)
            ]
            finished.append(latest)
        assert finished[0] != finished[1] and finished[::2] == [finished[0]] * 2 and finished[1::2] == [finished[1]] * 2


async def test_least_loaded_sends_requests_to_the_idle_decode_worker() -> None:
    short = random_tokens(24, seed=8)
    expected = tiny_greedy([short], MAX_TOKENS)[0]
    worker_args = ("--num-blocks", "256", "--num-threads", "1")
    async with local_cluster(
        "tiny", num_prefill=1, num_decode=2, worker_args=worker_args, proxy_args=("--routing", "least-loaded")
    ) as cluster:
        decoders = cluster.decode_addresses
        async with KVServiceClient(cluster.address) as client:
            # A long request keeps one decode worker busy (it is cancelled at the end, not awaited).
            long = client.generate(
                random_tokens(20, seed=9), timeout=120, max_tokens=2000, temperature=0, ignore_eos=True
            )
            try:
                await anext(long)
                busy_stats = await wait_for_stats(
                    decoders,
                    lambda s: sum(s[a].num_running_requests for a in decoders) == 1,
                    "the long request running",
                )
                [busy] = [a for a in decoders if busy_stats[a].num_running_requests == 1]
                [idle] = [a for a in decoders if a != busy]
                for _ in range(3):
                    assert await complete(cluster.address, short) == expected
                after = await wait_for_finished(decoders, busy_stats, {idle: 3})
                assert after[busy].num_finished_requests == busy_stats[busy].num_finished_requests
                assert after[busy].num_running_requests == 1, "the long request ended early: the test proves nothing"
            finally:
                await long.aclose()


async def test_short_prompts_and_next_turns_never_reach_the_prefill_worker() -> None:
    short = random_tokens(40, seed=2)
    first_turn = random_tokens(200, seed=3)
    long_prompt = random_tokens(300, seed=4)
    proxy_args = ("--max-local-prefill-tokens", "128", "--metrics-port", "0")
    async with local_cluster(
        "tiny", num_prefill=1, num_decode=1, worker_args=WORKER_ARGS, proxy_args=proxy_args
    ) as cluster:
        [prefill], [decode] = cluster.prefill_addresses, cluster.decode_addresses
        start = await worker_stats(prefill)

        assert await complete(cluster.address, short) == tiny_greedy([short], MAX_TOKENS)[0]
        answer = await complete(cluster.address, first_turn)  # 200 tokens: disaggregated
        assert answer == tiny_greedy([first_turn], MAX_TOKENS)[0]
        after_first_turn = await wait_for_stats(
            [prefill], lambda s: s[prefill].num_finished_requests == start.num_finished_requests + 1, "one prefill"
        )
        # The decode worker caches the first turn and its answer: 207 tokens computed, 12 full blocks.
        await wait_until_indexed(cluster, decode, (len(first_turn) + MAX_TOKENS - 1) // BLOCK_SIZE)
        second_turn = first_turn + answer + random_tokens(5, seed=5)
        assert await complete(cluster.address, second_turn) == tiny_greedy([second_turn], MAX_TOKENS)[0]
        unchanged = await worker_stats(prefill)
        assert unchanged.num_finished_requests == after_first_turn[prefill].num_finished_requests
        assert unchanged.prefix_cache.queries == after_first_turn[prefill].prefix_cache.queries

        assert await complete(cluster.address, long_prompt) == tiny_greedy([long_prompt], MAX_TOKENS)[0]
        await wait_for_stats(
            [prefill],
            lambda s: s[prefill].num_finished_requests == unchanged.num_finished_requests + 1,
            "the long prompt prefilled",
        )
        stats = await worker_stats(decode)
        assert stats.kv_receiving.num_failed_transfers == 0
        # The proxy counts where each prompt was prefilled: the short one and the next turn locally.
        metrics = await asyncio.to_thread(scrape, cluster.child("proxy").metrics_address)
        assert metric_value(metrics, "kvservice_requests_prefilled_total", where="decode_worker") == 2
        assert metric_value(metrics, "kvservice_requests_prefilled_total", where="prefill_worker") == 2


async def test_a_colocated_worker_publishes_what_it_caches() -> None:
    prompt = random_tokens(3 * BLOCK_SIZE + 5, seed=6)  # 3 full blocks
    async with local_cluster("tiny", colocated=True, worker_args=WORKER_ARGS) as cluster:
        async with grpc.aio.insecure_channel(cluster.address) as channel:
            stream = pb_grpc.WorkerStub(channel).SubscribeKVEvents(pb.KVEventsRequest(after_seq=0), timeout=60)
            snapshot = await stream.read()
            assert snapshot.is_snapshot and snapshot.seq == 0 and not snapshot.events
            assert await complete(cluster.address, prompt) == tiny_greedy([prompt], MAX_TOKENS)[0]
            stored: list[int] = []
            seqs: list[int] = []
            while len(stored) < 3:  # the prompt's full blocks (53 + 7 tokens computed: no fourth)
                batch = await stream.read()
                seqs.append(batch.seq)
                stored += [h for e in batch.events if e.HasField("stored") for h in e.stored.block_hashes]
            stream.cancel()
        assert seqs == list(range(1, len(seqs) + 1))
        assert (batch.block_size, batch.hash_seed) == (BLOCK_SIZE, snapshot.hash_seed)
        assert stored == block_hashes(prompt, BLOCK_SIZE, snapshot.hash_seed)
