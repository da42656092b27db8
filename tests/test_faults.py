"""Faults with real processes: workers killed, corrupted chunks, backpressure, overload, shutdown.

Every deployment runs the built-in `tiny` model; the reference for every output is the
same model's greedy output computed in this process (`LLM("tiny")`), which is what a
colocated worker returns. Tests wait on health checks, Stats polled with deadlines and
process exits, never on fixed sleeps; every process a test starts is stopped (SIGKILL
past a deadline) in `finally`.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import Callable, Sequence
from typing import Any

import grpc
import pytest
from conftest import local_cluster, tiny_greedy, wait_for, wait_until_idle, worker_stats
from corrupting_prefill import CorruptingPrefillCluster
from hf_models import random_prompts

from kvservice.client.client import KVServiceClient
from kvservice.client.cluster import LocalCluster
from kvservice.v1 import kvservice_pb2 as pb

pytestmark = [pytest.mark.slow]

BASE_WORKER_ARGS = ("--num-threads", "1", "--kv-cache-mib", "16")
FAST_PROXY_ARGS = ("--health-interval", "0.2")
# Every child drains for the cluster's grace period (LocalCluster passes it): long enough for
# the SIGTERM test's 20 streams of 96 tokens on a loaded 2-core machine.
GRACE_S = 20.0
RPC_TIMEOUT = 60.0  # the client deadline: a request that hangs fails the test


# ---------------------------------------------------------------- helpers


async def generate(
    client: KVServiceClient, prompt: Sequence[int], max_tokens: int, on_token: Callable[[], None] | None = None
) -> list[int]:
    token_ids: list[int] = []
    finish_reason = None
    async for chunk in client.generate(
        prompt, timeout=RPC_TIMEOUT, max_tokens=max_tokens, temperature=0, ignore_eos=True
    ):
        token_ids += chunk.token_ids
        finish_reason = chunk.finish_reason or finish_reason
        if on_token is not None and chunk.token_ids:
            on_token()
    assert finish_reason == "length", (finish_reason, token_ids)
    return token_ids


async def proxy_worker_entry(client: KVServiceClient, address: str) -> pb.WorkerStats:
    stats = await client.stats()
    return next(w for w in stats.workers if w.address == address)


def cluster(**kwargs: Any) -> contextlib.AbstractAsyncContextManager[LocalCluster]:
    """A LocalCluster of the tiny model with this module's worker and proxy flags."""
    return local_cluster("tiny", **_cluster_kwargs(kwargs))


def corrupting_cluster(corrupt_chunk_every: int, **kwargs: Any) -> contextlib.AbstractAsyncContextManager[LocalCluster]:
    """`cluster`, but its prefill workers corrupt every `corrupt_chunk_every`th KV chunk they send."""
    kwargs = {"corrupt_chunk_every": corrupt_chunk_every, **_cluster_kwargs(kwargs)}
    return local_cluster("tiny", cluster_type=CorruptingPrefillCluster, **kwargs)


def _cluster_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    return {
        "worker_args": BASE_WORKER_ARGS,
        "proxy_args": FAST_PROXY_ARGS,
        "startup_timeout": 60,
        "grace_period": GRACE_S,
        **kwargs,
    }


def kill(c: LocalCluster, name: str) -> None:
    process = c.child(name).process
    os.killpg(process.pid, signal.SIGKILL)


# ---------------------------------------------------------------- 1. prefill worker killed


async def test_prefill_killed_with_transfers_in_flight_recomputes_and_reroutes() -> None:
    prompts = random_prompts([200] * 12, seed=1, vocab_size=256)
    later = random_prompts([100] * 6, seed=2, vocab_size=256)
    max_tokens = 8
    expected = tiny_greedy(prompts, max_tokens)
    expected_later = tiny_greedy(later, max_tokens)
    # The decode cache holds one request (13 of 16 blocks) at a time: later transfers stay
    # staged on the prefill workers until their turn, so there is staged KV when the kill comes.
    async with cluster(num_prefill=2, num_decode=1, worker_args=(*BASE_WORKER_ARGS, "--num-blocks", "16")) as c:
        victim, survivor = c.prefill_addresses
        decode = c.decode_addresses[0]
        async with KVServiceClient(c.address) as client:
            tasks = [asyncio.create_task(generate(client, p, max_tokens)) for p in prompts]
            try:
                # Kill prefill-0 as soon as it holds staged KV (a transfer in flight).
                await wait_for(lambda: _has_staged(victim), "prefill-0 staging KV", 30)
                kill(c, "prefill-0")
                outputs = await asyncio.gather(*tasks)
            finally:
                for t in tasks:
                    t.cancel()
            assert outputs == expected
            received = (await worker_stats(decode)).kv_receiving
            assert received.num_failed_transfers > 0, "no pull from the killed prefill worker failed"

            # The proxy stops routing to the dead worker; new requests go to the survivor.
            async def victim_down() -> bool:
                return not (await proxy_worker_entry(client, victim)).is_healthy

            await wait_for(victim_down, "prefill-0 marked unhealthy")
            before = (await worker_stats(decode)).kv_receiving
            outputs = await asyncio.gather(*(generate(client, p, max_tokens) for p in later))
            assert outputs == expected_later
            after = (await worker_stats(decode)).kv_receiving
            assert after.num_failed_transfers == before.num_failed_transfers, "a request was routed to the dead worker"
            assert after.num_transfers - before.num_transfers == len(later)
        await wait_until_idle([survivor, decode])


async def _has_staged(address: str) -> bool:
    with contextlib.suppress(grpc.aio.AioRpcError):
        return (await worker_stats(address)).kv_sending.staging_bytes_in_use > 0
    return False


# ---------------------------------------------------------------- 2. decode worker killed


DECODE_KILL_PROMPTS = random_prompts([40] * 16, seed=3, vocab_size=256)  # 16 streams decode when one worker dies
DECODE_KILL_MAX_TOKENS = 400


async def _kill_decode_under_load(c: LocalCluster) -> list[object]:
    """Stream the prompts, SIGKILL decode-0 once it generates; each request's tokens or error."""
    victim = c.decode_addresses[0]
    async with KVServiceClient(c.address) as client:
        streaming = asyncio.Event()
        tasks = [
            asyncio.create_task(generate(client, p, DECODE_KILL_MAX_TOKENS, streaming.set)) for p in DECODE_KILL_PROMPTS
        ]
        try:

            async def victim_running() -> bool:
                return streaming.is_set() and (await worker_stats(victim)).num_running_requests > 0

            await wait_for(victim_running, "decode-0 generating", 30)
            kill(c, "decode-0")
            return await asyncio.gather(*tasks, return_exceptions=True)
        finally:
            for t in tasks:
                t.cancel()


async def test_decode_killed_without_migration_fails_affected_requests_and_frees_everything() -> None:
    """--migration-limit 0: each stream of the killed worker fails with UNAVAILABLE naming the cause; none hangs."""
    expected = tiny_greedy(DECODE_KILL_PROMPTS, DECODE_KILL_MAX_TOKENS)
    async with cluster(
        num_prefill=1,
        num_decode=2,
        proxy_args=(*FAST_PROXY_ARGS, "--migration-limit", "0"),
        worker_args=(*BASE_WORKER_ARGS, "--kv-lease-seconds", "3"),
    ) as c:
        results = await _kill_decode_under_load(c)
        failed = [r for r in results if isinstance(r, BaseException)]
        assert failed, "no request was on the killed decode worker"
        for error in failed:
            assert isinstance(error, grpc.aio.AioRpcError) and error.code() == grpc.StatusCode.UNAVAILABLE, error
            assert c.decode_addresses[0] in error.details() and "--migration-limit 0" in error.details(), (
                error.details()
            )
        for result, want in zip(results, expected):
            if not isinstance(result, BaseException):
                assert result == want
        await wait_until_idle([c.prefill_addresses[0], c.decode_addresses[1]])


@pytest.mark.parametrize(
    "speculation",
    [
        (),
        # A draft model on every worker: the draft's prompt KV travels, and a migrated stream's
        # new decode worker computes it (with the target's) over the prompt and the resumed tokens.
        ("--draft-model", "tiny", "--num-speculative-tokens", "3"),
        ("--speculative-method", "ngram", "--num-speculative-tokens", "3"),
    ],
    ids=["plain", "draft", "ngram"],
)
async def test_decode_killed_streams_migrate_and_complete_exactly(speculation: tuple[str, ...]) -> None:
    """Default --migration-limit 1: the proxy resends each lost stream's prompt plus the tokens
    already streamed to the other decode worker; every client gets exactly the undisturbed
    greedy output, no token twice or missing, no error; drafted streams too."""
    expected = tiny_greedy(DECODE_KILL_PROMPTS, DECODE_KILL_MAX_TOKENS)
    worker_args = (*BASE_WORKER_ARGS, "--kv-lease-seconds", "3", *speculation)
    async with cluster(num_prefill=1, num_decode=2, worker_args=worker_args) as c:
        results = await _kill_decode_under_load(c)
        assert results == expected  # no request lost, no token repeated or skipped
        survivor = c.decode_addresses[1]
        # decode-0 is dead: the survivor finished every request, its own and the migrated ones.
        stats = await worker_stats(survivor)
        assert stats.num_finished_requests == len(DECODE_KILL_PROMPTS)
        assert (stats.spec_decode.num_verify_steps > 0) == bool(speculation)  # it speculated when told to
        await wait_until_idle([c.prefill_addresses[0], survivor])


# ---------------------------------------------------------------- 3. corrupted chunk


async def test_corrupted_chunk_is_rejected_and_recomputed() -> None:
    prompts = random_prompts([60] * 6, seed=4, vocab_size=256)
    max_tokens = 8
    expected = tiny_greedy(prompts, max_tokens)
    async with corrupting_cluster(3, num_prefill=1, num_decode=1) as c:
        async with KVServiceClient(c.address) as client:
            outputs = await asyncio.gather(*(generate(client, p, max_tokens) for p in prompts))
        assert outputs == expected
        received = (await worker_stats(c.decode_addresses[0])).kv_receiving
        assert received.num_failed_transfers > 0
        assert received.num_failed_transfers <= received.num_transfers
        await wait_until_idle(c.prefill_addresses + c.decode_addresses)


# ---------------------------------------------------------------- 4. slow consumer, bounded staging


async def test_staging_pool_stays_within_bound_under_a_slow_decode_consumer() -> None:
    # tiny: 32 KiB of KV per 16-token block; a 200-token prompt stages 416 KiB, so 2 fit in 1 MiB.
    prompts = random_prompts([200] * 10, seed=5, vocab_size=256)
    max_tokens = 24
    expected = tiny_greedy(prompts, max_tokens)
    # 16 blocks hold one 200-token request (13 blocks + output): the decode worker can take
    # one transfer at a time, so the others stay staged on the prefill worker, up to its bound.
    worker_args = (*BASE_WORKER_ARGS, "--kv-staging-mib", "1", "--max-num-seqs", "1", "--num-blocks", "16")
    async with cluster(num_prefill=1, num_decode=1, worker_args=worker_args) as c:
        prefill = c.prefill_addresses[0]
        peak = 0
        capacity = 0
        async with KVServiceClient(c.address) as client:
            tasks = [asyncio.create_task(generate(client, p, max_tokens)) for p in prompts]
            try:
                while not all(t.done() for t in tasks):
                    sending = (await worker_stats(prefill)).kv_sending
                    capacity = sending.staging_bytes_capacity
                    peak = max(peak, sending.staging_bytes_in_use)
                    assert sending.staging_bytes_in_use <= capacity
                    await asyncio.wait(tasks, timeout=0.05)  # poll Stats while the requests run
                results = await asyncio.gather(*tasks, return_exceptions=True)
            finally:
                for t in tasks:
                    t.cancel()
        assert capacity == 1 << 20 and peak > 0, (
            peak,
            [type(r).__name__ if isinstance(r, BaseException) else len(r) for r in results],
        )
        for result, want in zip(results, expected):
            if isinstance(result, grpc.aio.AioRpcError):
                assert result.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, result
            else:
                assert result == want
        assert any(not isinstance(r, BaseException) for r in results)
        await wait_until_idle([prefill, *c.decode_addresses])


# ---------------------------------------------------------------- 5. overload


OVERLOAD_REQUESTS = int(os.environ.get("KVSERVICE_TEST_OVERLOAD_REQUESTS", "1000"))
OVERLOAD_CONCURRENCY = 256


async def test_overload_completes_or_refuses_every_request_and_frees_every_block() -> None:
    prompts = random_prompts([6] * OVERLOAD_REQUESTS, seed=6, vocab_size=256)
    max_tokens = 4
    expected = tiny_greedy(prompts[:32], max_tokens)
    worker_args = (*BASE_WORKER_ARGS[:2], "--num-blocks", "24")  # a few dozen requests' worth
    async with cluster(num_prefill=1, num_decode=1, worker_args=worker_args) as c:
        slots = asyncio.Semaphore(OVERLOAD_CONCURRENCY)
        outcomes: dict[str, int] = {"ok": 0, "RESOURCE_EXHAUSTED": 0}

        async def one(i: int, client: KVServiceClient) -> None:
            async with slots:
                try:
                    tokens = await generate(client, prompts[i], max_tokens)
                except grpc.aio.AioRpcError as e:
                    assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e
                    outcomes["RESOURCE_EXHAUSTED"] += 1
                    return
                if i < len(expected):
                    assert tokens == expected[i]
                outcomes["ok"] += 1

        start = time.monotonic()
        async with KVServiceClient(c.address) as client:
            await asyncio.wait_for(asyncio.gather(*(one(i, client) for i in range(OVERLOAD_REQUESTS))), 150)
        elapsed = time.monotonic() - start
        print(
            f"overload: {OVERLOAD_REQUESTS} requests at concurrency {OVERLOAD_CONCURRENCY}: "
            f"{outcomes} in {elapsed:.1f} s"
        )
        assert outcomes["ok"] + outcomes["RESOURCE_EXHAUSTED"] == OVERLOAD_REQUESTS
        assert outcomes["ok"] > 0
        await wait_until_idle(c.prefill_addresses + c.decode_addresses)


# ---------------------------------------------------------------- 7. graceful shutdown


async def test_sigterm_under_load_loses_nothing_and_exits_0() -> None:
    prompts = random_prompts([30] * 20, seed=7, vocab_size=256)
    max_tokens = 96
    expected = tiny_greedy(prompts, max_tokens)
    async with cluster(num_prefill=1, num_decode=1) as c:
        processes = {child.name: child.process for child in c.children}
        async with KVServiceClient(c.address) as client:
            started = [asyncio.Event() for _ in prompts]
            tasks = [asyncio.create_task(generate(client, p, max_tokens, e.set)) for p, e in zip(prompts, started)]
            try:
                await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), RPC_TIMEOUT)
                assert not all(t.done() for t in tasks), "the requests finished before the signal"
                for process in processes.values():  # all at once: proxy and workers
                    process.send_signal(signal.SIGTERM)
                outputs = await asyncio.gather(*tasks)
            finally:
                for t in tasks:
                    t.cancel()
        assert outputs == expected
        codes = {name: await asyncio.wait_for(p.wait(), 30) for name, p in processes.items()}
        assert codes == {name: 0 for name in processes}
