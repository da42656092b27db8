"""Prometheus metrics: scrape every server's /metrics after real traffic through a 1P1D cluster."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import pytest
import pytest_asyncio
from conftest import Samples, local_cluster, metric_value, scrape

from kvservice.client.client import KVServiceClient
from kvservice.client.cluster import LocalCluster

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

NUM_REQUESTS = 4
MAX_TOKENS = 5
WORKER_ARGS = ("--num-threads", "1", "--metrics-port", "0", "--num-blocks", "64", "--max-model-len", "128")


async def scrape_all(cluster: LocalCluster) -> dict[str, Samples]:
    names = [c.name for c in cluster.children]
    found = await asyncio.gather(*(asyncio.to_thread(scrape, cluster.child(n).metrics_address) for n in names))
    return dict(zip(names, found))


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def cluster() -> AsyncIterator[LocalCluster]:
    async with local_cluster(
        "tiny", worker_args=WORKER_ARGS, proxy_args=("--metrics-port", "0", "--health-interval", "0.2")
    ) as c:
        yield c


async def test_metrics_move_with_traffic(cluster: LocalCluster) -> None:
    before = await scrape_all(cluster)
    assert metric_value(before["proxy"], "kvservice_requests_total", outcome="ok") == 0
    assert metric_value(before["proxy"], "kvservice_workers_healthy", role="decode") == 1
    assert ("kvservice_spec_acceptance_rate", ()) in before["decode-0"]
    assert ("kvservice_spec_draft_tokens_total", ()) in before["decode-0"]

    async with KVServiceClient(cluster.address) as client:

        async def one(i: int) -> int:
            return len(
                (
                    await client.complete(
                        [1 + i, 2, 3, 4, 5, 6, 7], max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, timeout=60
                    )
                ).token_ids
            )

        assert await asyncio.gather(*(one(i) for i in range(NUM_REQUESTS))) == [MAX_TOKENS] * NUM_REQUESTS
        with pytest.raises(grpc.aio.AioRpcError) as bad:
            await client.complete([1, 2], max_tokens=0, timeout=60)
        assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT

    after = await scrape_all(cluster)
    proxy, prefill, decode = after["proxy"], after["prefill-0"], after["decode-0"]
    # Client requests on the proxy: one observation per successful request in every histogram.
    assert metric_value(proxy, "kvservice_requests_total", outcome="ok") == NUM_REQUESTS
    assert metric_value(proxy, "kvservice_requests_total", outcome="invalid_argument") == 1
    for histogram in ("time_to_first_token", "time_to_second_token", "time_per_output_token", "e2e_request_latency"):
        assert metric_value(proxy, f"kvservice_{histogram}_seconds_count") == NUM_REQUESTS, histogram
        assert metric_value(proxy, f"kvservice_{histogram}_seconds_sum") > 0, histogram
    assert metric_value(proxy, "kvservice_num_requests_running") == 0
    # Every prompt was prefilled on the prefill worker (none on the decode worker itself).
    assert metric_value(proxy, "kvservice_requests_prefilled_total", where="prefill_worker") == NUM_REQUESTS
    assert metric_value(proxy, "kvservice_requests_prefilled_total", where="decode_worker") == 0
    # The decode worker generated every token; the prefill worker only the first.
    assert metric_value(decode, "kvservice_requests_total", outcome="ok") == NUM_REQUESTS
    assert metric_value(decode, "kvservice_time_per_output_token_seconds_count") == NUM_REQUESTS
    assert metric_value(prefill, "kvservice_requests_total", outcome="ok") == NUM_REQUESTS
    assert metric_value(prefill, "kvservice_time_to_first_token_seconds_count") == NUM_REQUESTS
    assert metric_value(prefill, "kvservice_time_to_second_token_seconds_count") == 0
    # The KV went from the prefill to the decode worker: same bytes on both sides.
    sent = metric_value(prefill, "kvservice_kv_transfer_bytes_total", direction="send")
    assert sent > 0 and sent == metric_value(decode, "kvservice_kv_transfer_bytes_total", direction="recv")
    assert metric_value(decode, "kvservice_kv_transfers_total", direction="recv") == NUM_REQUESTS
    assert metric_value(decode, "kvservice_kv_transfer_seconds_total", direction="recv") > 0
    assert metric_value(decode, "kvservice_kv_transfer_failures_total", direction="recv") == 0
    assert metric_value(prefill, "kvservice_kv_staging_capacity_bytes") > 0
    for worker in (prefill, decode):
        assert metric_value(worker, "kvservice_kv_blocks_free") + metric_value(worker, "kvservice_kv_blocks_used") == 64
        # Every 7-token prompt was looked up in the prefix cache; none fills a block to match.
        assert metric_value(worker, "kvservice_prefix_cache_queries_total") == 7 * NUM_REQUESTS
        assert metric_value(worker, "kvservice_prefix_cache_hits_total") == 0
