"""Admission control across a process boundary: past the queue bound, RESOURCE_EXHAUSTED at once."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from conftest import local_cluster, wait_until_idle

from kvservice.client.client import KVServiceClient

pytestmark = pytest.mark.timeout(120)

MAX_QUEUED = 4
# A small cache and batch: two requests run, the rest queue behind them.
WORKER_ARGS = [
    "--max-queued-requests",
    str(MAX_QUEUED),
    "--num-blocks",
    "8",
    "--block-size",
    "16",
    "--max-num-seqs",
    "2",
    "--num-threads",
    "1",
    "--grace-period",
    "2",
]


async def test_burst_past_the_queue_bound_gets_resource_exhausted_and_frees_everything() -> None:
    async with local_cluster("tiny", colocated=True, worker_args=WORKER_ARGS, grace_period=2) as cluster:
        async with KVServiceClient(cluster.address) as client:

            async def one(i: int) -> grpc.StatusCode | list[int]:
                try:
                    completion = await client.complete(
                        [1 + i % 50] * 20, timeout=60, max_tokens=16, temperature=0, ignore_eos=True
                    )
                except grpc.aio.AioRpcError as e:
                    if e.code() is grpc.StatusCode.RESOURCE_EXHAUSTED:
                        assert "queued" in (e.details() or "")
                    return e.code()
                return completion.token_ids

            results = await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(40))), 60)
            successes = [r for r in results if isinstance(r, list)]
            refused = [r for r in results if not isinstance(r, list)]
            assert set(refused) == {grpc.StatusCode.RESOURCE_EXHAUSTED}
            assert successes and all(len(ids) == 16 for ids in successes)
            stats = (await wait_until_idle([cluster.address], 10.0))[cluster.address]
            assert stats.num_blocks_total == 8
            # Admission recovers: a request after the burst is served.
            completion = await client.complete([7] * 5, timeout=60, max_tokens=2, temperature=0, ignore_eos=True)
            assert len(completion.token_ids) == 2
