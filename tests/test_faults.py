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
import random
import signal
import time
from collections.abc import AsyncIterator, Callable, Sequence

import grpc
import pytest

from kvservice import LLM, SamplingParams
from kvservice.client.client import KVServiceClient
from kvservice.client.cluster import LocalCluster
from kvservice.connector.kv_transfer_service import FAULT_CORRUPT_CHUNK_EVERY
from kvservice.v1 import kvservice_pb2 as pb
from kvservice.v1 import kvservice_pb2_grpc as pb_grpc

pytestmark = [pytest.mark.slow]

BASE_WORKER_ARGS = ("--num-threads", "1", "--kv-cache-mib", "16")
FAST_PROXY_ARGS = ("--health-interval", "0.2", "--grace-period", "20")
RPC_TIMEOUT = 60.0  # the client deadline: a request that hangs fails the test
RELEASE_DEADLINE = 15.0


# ---------------------------------------------------------------- helpers


def random_prompts(num: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(length)] for _ in range(num)]


_reference_llm: LLM | None = None


def reference(prompts: Sequence[Sequence[int]], max_tokens: int) -> list[list[int]]:
    """Greedy output of the tiny model, in process: what a colocated worker returns."""
    global _reference_llm
    if _reference_llm is None:
        _reference_llm = LLM("tiny")
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    return [list(out.token_ids) for out in _reference_llm.generate([list(p) for p in prompts], params)]


async def generate(client: KVServiceClient, prompt: Sequence[int], max_tokens: int, on_token: Callable[[], None] | None = None) -> list[int]:
    token_ids: list[int] = []
    finish_reason = None
    async for chunk in client.generate(prompt, timeout=RPC_TIMEOUT, max_tokens=max_tokens, temperature=0, ignore_eos=True):
        token_ids += chunk.token_ids
        finish_reason = chunk.finish_reason or finish_reason
        if on_token is not None and chunk.token_ids:
            on_token()
    assert finish_reason == "length", (finish_reason, token_ids)
    return token_ids


async def worker_stats(address: str) -> pb.StatsResponse:
    async with grpc.aio.insecure_channel(address) as channel:
        return await pb_grpc.WorkerStub(channel).Stats(pb.StatsRequest(), timeout=10)


async def wait_for(condition: Callable[[], object], what: str, timeout: float = RELEASE_DEADLINE) -> object:
    """Re-evaluate the async `condition` until it returns something truthy: a wait with a deadline."""
    deadline = time.monotonic() + timeout
    while True:
        result = await condition()  # type: ignore[misc]
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"not {what} within {timeout:.0f} s")
        await asyncio.sleep(0.05)  # polling period of a readiness wait


def is_idle(s: pb.StatsResponse) -> bool:
    return (
        s.num_blocks_free == s.num_blocks_total
        and s.num_running_requests == 0
        and s.num_waiting_requests == 0
        and s.num_waiting_for_remote_kv == 0
        and s.kv_sending.staging_bytes_in_use == 0
    )


async def wait_until_idle(addresses: Sequence[str], timeout: float = RELEASE_DEADLINE) -> list[pb.StatsResponse]:
    """Every block free, nothing queued, no staged KV, on every worker in `addresses`."""
    last: list[pb.StatsResponse] = []

    async def idle() -> bool:
        nonlocal last
        last = list(await asyncio.gather(*(worker_stats(a) for a in addresses)))
        return all(is_idle(s) for s in last)

    try:
        await wait_for(idle, "idle", timeout)
    except AssertionError as e:
        raise AssertionError(f"{e}: {last}") from None
    return last


async def proxy_worker_entry(client: KVServiceClient, address: str) -> pb.WorkerStats:
    stats = await client.stats()
    return next(w for w in stats.workers if w.address == address)


@contextlib.asynccontextmanager
async def cluster(**kwargs: object) -> AsyncIterator[LocalCluster]:
    """A LocalCluster of the tiny model; SIGKILLs whatever is left when the test ends."""
    kwargs.setdefault("worker_args", BASE_WORKER_ARGS)
    kwargs.setdefault("proxy_args", FAST_PROXY_ARGS)
    c = LocalCluster("tiny", startup_timeout=60, grace_period=5, **kwargs)  # type: ignore[arg-type]
    processes: list[asyncio.subprocess.Process] = []
    try:
        await c.start()
        processes = [child.process for child in c.children]
        yield c
    finally:
        processes = processes or [child.process for child in c.children]
        try:
            await asyncio.wait_for(c.stop(), 30)
        finally:
            for process in processes:
                if process.returncode is None:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(process.pid, signal.SIGKILL)
                    await process.wait()


def kill(c: LocalCluster, name: str) -> None:
    process = c.child(name).process
    os.killpg(process.pid, signal.SIGKILL)


# ---------------------------------------------------------------- 1. prefill worker killed


async def test_prefill_killed_with_transfers_in_flight_recomputes_and_reroutes() -> None:
    prompts = random_prompts(12, 200, seed=1)
    later = random_prompts(6, 100, seed=2)
    max_tokens = 8
    expected = reference(prompts, max_tokens)
    expected_later = reference(later, max_tokens)
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


DECODE_KILL_PROMPTS = random_prompts(8, 40, seed=3)
DECODE_KILL_MAX_TOKENS = 400


async def _kill_decode_under_load(c: LocalCluster) -> list[object]:
    """Stream the prompts, SIGKILL decode-0 once it generates; each request's tokens or error."""
    victim = c.decode_addresses[0]
    async with KVServiceClient(c.address) as client:
        streaming = asyncio.Event()
        tasks = [asyncio.create_task(generate(client, p, DECODE_KILL_MAX_TOKENS, streaming.set)) for p in DECODE_KILL_PROMPTS]
        try:
            async def victim_running() -> bool:
                return streaming.is_set() and (await worker_stats(victim)).num_running_requests > 0

            await wait_for(victim_running, "decode-0 generating", 30)
            kill(c, "decode-0")
            return await asyncio.gather(*tasks, return_exceptions=True)
        finally:
            for t in tasks:
                t.cancel()


async def test_decode_killed_mid_generation_fails_affected_requests_and_frees_everything() -> None:
    expected = reference(DECODE_KILL_PROMPTS, DECODE_KILL_MAX_TOKENS)
    async with cluster(num_prefill=1, num_decode=2, worker_args=(*BASE_WORKER_ARGS, "--kv-lease-seconds", "3")) as c:
        results = await _kill_decode_under_load(c)
        failed = [r for r in results if isinstance(r, BaseException)]
        assert failed, "no request was on the killed decode worker"
        for error in failed:
            assert isinstance(error, grpc.aio.AioRpcError) and error.code() == grpc.StatusCode.UNAVAILABLE, error
        for result, want in zip(results, expected):
            if not isinstance(result, BaseException):
                assert result == want
        await wait_until_idle([c.prefill_addresses[0], c.decode_addresses[1]])


async def test_decode_killed_with_retry_decode_restarts_requests_without_repeating_tokens() -> None:
    """With --retry-decode the proxy restarts greedy requests of a lost decode worker on
    the other one: every client still gets exactly the reference output, nothing twice."""
    expected = reference(DECODE_KILL_PROMPTS, DECODE_KILL_MAX_TOKENS)
    async with cluster(num_prefill=1, num_decode=2, proxy_args=(*FAST_PROXY_ARGS, "--retry-decode"),
                       worker_args=(*BASE_WORKER_ARGS, "--kv-lease-seconds", "3")) as c:
        results = await _kill_decode_under_load(c)
        assert results == expected  # no request lost, no token repeated or skipped
        survivor = c.decode_addresses[1]
        # decode-0 is dead: the survivor finished every request, its own and the restarted ones.
        assert (await worker_stats(survivor)).num_finished_requests == len(DECODE_KILL_PROMPTS)
        await wait_until_idle([c.prefill_addresses[0], survivor])


# ---------------------------------------------------------------- 3. corrupted chunk


async def test_corrupted_chunk_is_rejected_and_recomputed(monkeypatch: pytest.MonkeyPatch) -> None:
    # The hook only acts in the prefill worker's KVTransfer service; the others ignore it.
    monkeypatch.setenv(FAULT_CORRUPT_CHUNK_EVERY, "3")
    prompts = random_prompts(6, 60, seed=4)
    max_tokens = 8
    expected = reference(prompts, max_tokens)
    async with cluster(num_prefill=1, num_decode=1) as c:
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
    prompts = random_prompts(10, 200, seed=5)
    max_tokens = 24
    expected = reference(prompts, max_tokens)
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
        assert capacity == 1 << 20 and peak > 0, (peak, [type(r).__name__ if isinstance(r, BaseException) else len(r) for r in results])
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
    prompts = random_prompts(OVERLOAD_REQUESTS, 6, seed=6)
    max_tokens = 4
    expected = reference(prompts[:32], max_tokens)
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
        print(f"overload: {OVERLOAD_REQUESTS} requests at concurrency {OVERLOAD_CONCURRENCY}: {outcomes} in {elapsed:.1f} s")
        assert outcomes["ok"] + outcomes["RESOURCE_EXHAUSTED"] == OVERLOAD_REQUESTS
        assert outcomes["ok"] > 0
        await wait_until_idle(c.prefill_addresses + c.decode_addresses)


# ---------------------------------------------------------------- 7. graceful shutdown


async def test_sigterm_under_load_loses_nothing_and_exits_0() -> None:
    prompts = random_prompts(20, 30, seed=7)
    max_tokens = 96
    expected = reference(prompts, max_tokens)
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


# ---------------------------------------------------------------- 6. network cut and throttle

# Runs inside the decode namespace (the test process stays in the root one): sends the
# prompts through the proxy at once, prints "first" at the first token, then one JSON line.
_NETNS_CLIENT = r"""
import asyncio, json, sys
import grpc
from kvservice.client.client import KVServiceClient
job = json.loads(sys.stdin.readline())
async def main():
    async with KVServiceClient(job["address"]) as client:
        await client.wait_until_serving(60)
        print("serving", flush=True)
        sys.stdin.readline()  # go
        announced = False
        async def one(prompt):
            nonlocal announced
            tokens = []
            try:
                async for chunk in client.generate(prompt, timeout=job["timeout"], max_tokens=job["max_tokens"], temperature=0, ignore_eos=True):
                    tokens += chunk.token_ids
                    if tokens and not announced:
                        announced = True
                        print("first", flush=True)
            except grpc.aio.AioRpcError as e:
                return e.code().name
            return tokens
        print(json.dumps(await asyncio.gather(*(one(p) for p in job["prompts"]))), flush=True)
asyncio.run(main())
"""


@contextlib.asynccontextmanager
async def netns_deployment() -> AsyncIterator[tuple[object, Callable[..., object]]]:
    """A prefill worker in one namespace, decode worker + proxy in the other; yields (pair, run_client)."""
    import json
    import re
    import sys

    from netns import NetnsPair, unavailable_reason

    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    from kvservice.process_env import WORKER_ENV

    pair = NetnsPair.create()
    processes: list[asyncio.subprocess.Process] = []
    env = {**os.environ, **WORKER_ENV}

    async def spawn(ns: str, *args: str, stdin: int | None = None) -> asyncio.subprocess.Process:
        process = await asyncio.create_subprocess_exec(
            *pair.prefix(ns), sys.executable, *args, stdin=stdin, stdout=asyncio.subprocess.PIPE, env=env, start_new_session=True
        )
        processes.append(process)
        return process

    async def ready(process: asyncio.subprocess.Process) -> str:
        assert process.stdout is not None
        line = (await asyncio.wait_for(process.stdout.readline(), 60)).decode()
        match = re.search(r"listening on (\S+:\d+)", line)
        assert match is not None, f"did not start: {line!r}"
        return match.group(1)

    try:
        worker = ["-m", "kvservice", "serve", "--model", "tiny", *BASE_WORKER_ARGS, "--port", "0"]
        prefill, decode = await asyncio.gather(
            ready(await spawn(pair.prefill_ns, *worker, "--role", "prefill", "--host", pair.prefill_ip)),
            ready(await spawn(pair.decode_ns, *worker, "--role", "decode", "--host", pair.decode_ip, "--kv-transfer-timeout", "10")),
        )
        proxy = await ready(await spawn(
            pair.decode_ns, "-m", "kvservice", "proxy", "--port", "0", *FAST_PROXY_ARGS, "--prefill", prefill, "--decode", decode
        ))

        async def run_client(prompts: list[list[int]], max_tokens: int, on_first: Callable[[], None] | None = None) -> list[object]:
            client = await spawn(pair.decode_ns, "-c", _NETNS_CLIENT, stdin=asyncio.subprocess.PIPE)
            assert client.stdin is not None and client.stdout is not None
            job = {"address": proxy, "prompts": prompts, "max_tokens": max_tokens, "timeout": RPC_TIMEOUT}
            client.stdin.write((json.dumps(job) + "\n").encode())
            await client.stdin.drain()
            assert (await asyncio.wait_for(client.stdout.readline(), 60)).strip() == b"serving"
            client.stdin.write(b"go\n")
            await client.stdin.drain()
            line = await asyncio.wait_for(client.stdout.readline(), RPC_TIMEOUT + 10)
            if line.strip() == b"first":
                if on_first is not None:
                    on_first()
                line = await asyncio.wait_for(client.stdout.readline(), RPC_TIMEOUT + 10)
            assert await asyncio.wait_for(client.wait(), 10) == 0
            return json.loads(line)

        async def stats_in(role: str) -> dict[str, object]:
            """A worker's Stats, read from inside its own namespace (`kvservice stats --json`)."""
            ns, address = (pair.prefill_ns, prefill) if role == "prefill" else (pair.decode_ns, decode)
            reader = await spawn(ns, "-m", "kvservice", "stats", "--target", address, "--json")
            assert reader.stdout is not None
            out = await asyncio.wait_for(reader.stdout.read(), 60)
            assert await reader.wait() == 0
            return json.loads(out.decode().strip().splitlines()[-1])

        yield pair, run_client, stats_in
    finally:
        for process in processes:
            if process.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                await process.wait()
        pair.close()


async def test_network_throttled_then_cut_mid_transfer_loses_no_output() -> None:
    prompts = random_prompts(6, 300, seed=8)  # 300 tokens: ~600 KiB of KV each on the wire
    max_tokens = 8
    expected = reference(prompts, max_tokens)
    async with netns_deployment() as (pair, run_client, stats_in):
        pair.throttle("10mbit")  # type: ignore[attr-defined]
        start = time.monotonic()
        assert await run_client(prompts, max_tokens) == expected  # type: ignore[operator]
        throttled = time.monotonic() - start
        print(f"netns: 6 x 300-token prompts through a 10 mbit link in {throttled:.1f} s")
        # Cut the link at the first token: the other transfers are still on the (slow) wire.
        results = await run_client(prompts, max_tokens, lambda: pair.set_link(False))  # type: ignore[operator, attr-defined]
        for result, want in zip(results, expected):
            assert result == want or result in ("UNAVAILABLE", "DEADLINE_EXCEEDED"), result
        assert sum(r == w for r, w in zip(results, expected)) > 0
        # Link back: every block and staging byte on both sides comes back (broken pulls end
        # by keepalive or the transfer timeout; never-pulled staging by its lease).
        pair.set_link(True)  # type: ignore[attr-defined]
        deadline = time.monotonic() + 60
        while True:
            prefill_stats, decode_stats = await stats_in("prefill"), await stats_in("decode")  # type: ignore[operator]
            staged = int(prefill_stats["kv_sending"].get("staging_bytes_in_use", 0))  # type: ignore[union-attr]
            idle = all(int(s["num_blocks_free"]) == int(s["num_blocks_total"]) for s in (prefill_stats, decode_stats))
            if idle and staged == 0:
                break
            assert time.monotonic() < deadline, (prefill_stats, decode_stats)
            await asyncio.sleep(1.0)  # the lease and the keepalive run on their own clocks
