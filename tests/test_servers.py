"""Prefill, decode and proxy servers, end to end, as separate processes.

One 1P2D cluster (a random Llama the test saves) is started once for the module and
shared; extra proxies in front of its workers give the 1P1D and the prefill-less
(degraded) deployments without more model processes. The strongest checks are
comparisons: proxy output == colocated output == transformers' greedy output.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import pathlib
import re
import signal
import sys
from collections.abc import AsyncIterator, Sequence

import grpc
import pytest
import pytest_asyncio
from conftest import is_idle, local_cluster, wait_for_stats, wait_until_idle
from hf_models import VOCAB_SIZE, hf_greedy, random_prompts

from kvservice.client.client import KVServiceClient
from kvservice.client.cluster import WORKER_ENV, LocalCluster
from kvservice.v1 import kvservice_pb2 as pb

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

# Past the model's 256 positions (RoPE extends), so a cancelled generation is long enough
# to be cancelled mid-way even on a fast machine (~1 ms a token).
MAX_MODEL_LEN = 512
# Lengths below, at and past one block (16), and non-multiples of it.
PROMPT_LENGTHS = (1, 7, 16, 17, 33, 47)
MAX_NEW_TOKENS = 8
# Staged KV nobody pulls is freed after the lease; the tests give a prompt release
# RELEASE_DEADLINE, shorter than the lease, so they cannot pass by waiting for it.
LEASE_SECONDS = 20.0
RELEASE_DEADLINE = 10.0
# Tiny models on 2 shared cores: one intra-op thread each, a small cache (the 50-request
# test needs more blocks than a worker has, so admission control queues some).
WORKER_ARGS = (
    "--num-threads",
    "1",
    "--max-model-len",
    str(MAX_MODEL_LEN),
    "--num-blocks",
    "64",
    "--kv-lease-seconds",
    str(LEASE_SECONDS),
)
RPC_TIMEOUT = 120.0
# A proxy given SIGTERM with nothing in flight, or a short stream, exits well within this.
PROXY_EXIT_DEADLINE = 10.0


# ---------------------------------------------------------------- helpers


async def settle(addresses: Sequence[str]) -> dict[str, pb.StatsResponse]:
    """A test's precondition: idle, even if an earlier test left staged KV to its lease."""
    return await wait_until_idle(addresses, LEASE_SECONDS + RELEASE_DEADLINE)


async def greedy_outputs(
    address: str, prompts: Sequence[Sequence[int]], max_tokens: int = MAX_NEW_TOKENS
) -> list[list[int]]:
    """All prompts at once (one batch), greedy, EOS ignored, streamed: the token ids of each."""

    async def one(prompt: Sequence[int]) -> list[int]:
        token_ids: list[int] = []
        finish_reason = None
        async for chunk in client.generate(
            prompt, timeout=RPC_TIMEOUT, max_tokens=max_tokens, temperature=0, ignore_eos=True
        ):
            token_ids += chunk.token_ids
            finish_reason = chunk.finish_reason or finish_reason
        assert finish_reason == "length"
        return token_ids

    async with KVServiceClient(address) as client:
        return list(await asyncio.gather(*(one(p) for p in prompts)))


def kvservice_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "kvservice", *args]


@contextlib.asynccontextmanager
async def proxy(prefill: Sequence[str], decode: Sequence[str]) -> AsyncIterator[tuple[str, asyncio.subprocess.Process]]:
    """A `kvservice proxy` in front of existing workers; yields (address, process) once SERVING.

    Stops it on the way out (SIGTERM, then SIGKILL past a deadline); whether it exits
    cleanly is `test_proxy_sigterm_drains_and_exits_0`'s business.
    """
    cmd = kvservice_cmd("proxy", "--port", "0", "--health-interval", "0.2", "--grace-period", "3", "--decode", *decode)
    if prefill:
        cmd += ["--prefill", *prefill]
    process = await asyncio.create_subprocess_exec(
        *cmd, stdout=asyncio.subprocess.PIPE, env={**os.environ, **WORKER_ENV}, start_new_session=True
    )
    assert process.stdout is not None
    try:
        line = (await asyncio.wait_for(process.stdout.readline(), 60)).decode()
        match = re.search(r"listening on (\S+:\d+)", line)
        assert match is not None, f"proxy did not start: {line!r}"
        address = match.group(1)
        async with KVServiceClient(address) as client:
            await client.wait_until_serving(60)
        yield address, process
    finally:
        if process.returncode is None:
            process.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(process.communicate(), PROXY_EXIT_DEADLINE)
        except TimeoutError:
            os.killpg(process.pid, signal.SIGKILL)
            await process.wait()


# ---------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return random_prompts(PROMPT_LENGTHS, seed=3)


@pytest.fixture(scope="module")
def expected(llama_dir: pathlib.Path, prompts: list[list[int]]) -> list[list[int]]:
    """transformers' greedy continuations: the reference every deployment must match."""
    return hf_greedy(llama_dir, prompts, MAX_NEW_TOKENS)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def cluster(llama_dir: pathlib.Path) -> AsyncIterator[LocalCluster]:
    """1 prefill + 2 decode workers and a proxy, shared by the module's tests."""
    async with local_cluster(str(llama_dir), num_prefill=1, num_decode=2, worker_args=WORKER_ARGS) as c:
        yield c


@pytest.fixture(scope="module")
def worker_addresses(cluster: LocalCluster) -> list[str]:
    return cluster.prefill_addresses + cluster.decode_addresses


def num_transfers(stats: dict[str, pb.StatsResponse], addresses: Sequence[str]) -> int:
    return sum(stats[a].kv_receiving.num_transfers for a in addresses)


# ---------------------------------------------------------------- tests


async def test_health_serving(cluster: LocalCluster, worker_addresses: list[str]) -> None:
    for address in [cluster.address, *worker_addresses]:
        async with KVServiceClient(address) as client:
            assert await client.health() == "SERVING", address


async def test_1p2d_matches_colocated_and_transformers(
    cluster: LocalCluster,
    worker_addresses: list[str],
    llama_dir: pathlib.Path,
    prompts: list[list[int]],
    expected: list[list[int]],
) -> None:
    before = await settle(worker_addresses)
    disaggregated = await greedy_outputs(cluster.address, prompts)
    async with local_cluster(str(llama_dir), colocated=True, worker_args=WORKER_ARGS) as colocated_cluster:
        colocated = await greedy_outputs(colocated_cluster.address, prompts)

    assert colocated == expected
    assert disaggregated == expected
    # The KV really travelled (no recompute): one transfer per request, and both decode
    # workers took part.
    after = await wait_until_idle(worker_addresses, RELEASE_DEADLINE)
    for address in cluster.decode_addresses:
        received, was = after[address].kv_receiving, before[address].kv_receiving
        assert received.num_transfers > was.num_transfers, address
        assert received.num_bytes > was.num_bytes, address
        assert received.num_failed_transfers == was.num_failed_transfers, address
    assert num_transfers(after, cluster.decode_addresses) - num_transfers(before, cluster.decode_addresses) == len(
        prompts
    )


async def test_1p1d_matches_transformers(
    cluster: LocalCluster, worker_addresses: list[str], prompts: list[list[int]], expected: list[list[int]]
) -> None:
    decode = cluster.decode_addresses[0]
    before = (await settle(worker_addresses))[decode].kv_receiving
    async with proxy(cluster.prefill_addresses, [decode]) as (address, _):
        assert await greedy_outputs(address, prompts) == expected
    after = (await wait_until_idle(worker_addresses, RELEASE_DEADLINE))[decode].kv_receiving
    assert after.num_transfers - before.num_transfers == len(prompts)
    assert after.num_bytes > before.num_bytes
    assert after.num_failed_transfers == before.num_failed_transfers


async def test_degraded_without_prefill_matches_transformers(
    cluster: LocalCluster, worker_addresses: list[str], prompts: list[list[int]], expected: list[list[int]]
) -> None:
    """A proxy with decode workers only: they prefill themselves; same greedy output."""
    before = await settle(worker_addresses)
    async with proxy([], cluster.decode_addresses) as (address, _):
        assert await greedy_outputs(address, prompts) == expected
    after = await wait_until_idle(worker_addresses, RELEASE_DEADLINE)
    # Nothing was transferred: the decode workers computed the prompts themselves.
    assert num_transfers(after, cluster.decode_addresses) == num_transfers(before, cluster.decode_addresses)


async def test_50_concurrent_streams_complete_and_free_everything(
    cluster: LocalCluster, worker_addresses: list[str]
) -> None:
    await settle(worker_addresses)
    num_requests = 50
    # Up to 4 blocks of prompt each: more than the decode workers hold at once, so requests
    # also queue there. A third end at the prefill's first token (max_tokens=1).
    lengths = [1 + (7 * i) % 63 for i in range(num_requests)]
    max_tokens = [1 if i % 3 == 0 else 2 + i % 20 for i in range(num_requests)]
    requests = list(zip(random_prompts(lengths, seed=5), max_tokens))

    async def one(client: KVServiceClient, prompt: list[int], n: int) -> tuple[int, str | None]:
        count, finish_reason = 0, None
        async for chunk in client.generate(
            prompt, timeout=RPC_TIMEOUT, max_tokens=n, temperature=0.8, seed=len(prompt), ignore_eos=True
        ):
            count += len(chunk.token_ids)
            finish_reason = chunk.finish_reason or finish_reason
        return count, finish_reason

    async with KVServiceClient(cluster.address) as client:
        results = await asyncio.gather(*(one(client, p, n) for p, n in requests))
    assert results == [(n, "length") for _, n in requests]

    stats = await wait_until_idle(worker_addresses, RELEASE_DEADLINE)
    for address, s in stats.items():
        assert s.num_blocks_total > 0, address
        assert s.num_blocks_free == s.num_blocks_total, address
        assert s.kv_sending.staging_bytes_in_use == 0, address


async def test_cancelled_request_frees_blocks_everywhere(cluster: LocalCluster, worker_addresses: list[str]) -> None:
    prompt = random_prompts([40], seed=7)[0]
    before = await settle(worker_addresses)

    async with KVServiceClient(cluster.address) as client:
        stream = client.generate(
            prompt, timeout=RPC_TIMEOUT, max_tokens=MAX_MODEL_LEN - len(prompt), temperature=0, ignore_eos=True
        )
        num_tokens = 0
        async for chunk in stream:
            assert chunk.finish_reason is None
            num_tokens += len(chunk.token_ids)
            if num_tokens >= 2:
                break
        await stream.aclose()  # cancels the RPC

    def aborted_on_decode(stats: dict[str, pb.StatsResponse]) -> bool:
        return sum(stats[a].num_aborted_requests for a in cluster.decode_addresses) > sum(
            before[a].num_aborted_requests for a in cluster.decode_addresses
        )

    await wait_for_stats(
        worker_addresses,
        lambda s: aborted_on_decode(s) and all(map(is_idle, s.values())),
        "aborted on decode and idle",
        RELEASE_DEADLINE,
    )


BAD_REQUESTS = [
    pytest.param([1, 2, 3], dict(temperature=-0.5), "temperature", id="negative-temperature"),
    pytest.param([1, 2, 3], dict(top_p=0.0), "top_p", id="top-p-zero"),
    pytest.param([1, 2, 3], dict(max_tokens=0), "max_tokens", id="max-tokens-zero"),
    pytest.param([], {}, "prompt", id="empty-token-ids"),
    pytest.param("", {}, "prompt", id="empty-text"),
    pytest.param([1, VOCAB_SIZE, 3], {}, "token", id="token-outside-vocabulary"),
    pytest.param(list(range(1, MAX_MODEL_LEN + 2)), {}, "prompt", id="prompt-longer-than-max-model-len"),
]


@pytest.mark.parametrize("method", ["generate", "complete"])
@pytest.mark.parametrize(("prompt", "params", "field"), BAD_REQUESTS)
async def test_bad_input_is_invalid_argument(
    cluster: LocalCluster, prompt: list[int] | str, params: dict[str, object], field: str, method: str
) -> None:
    async with KVServiceClient(cluster.address) as client:
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            if method == "generate":
                async for _ in client.generate(prompt, timeout=RPC_TIMEOUT, **{"max_tokens": 4, **params}):
                    pass
            else:
                await client.complete(prompt, timeout=RPC_TIMEOUT, **{"max_tokens": 4, **params})
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT, raised.value.details()
    assert field in raised.value.details()


async def test_bad_input_leaks_nothing(cluster: LocalCluster, worker_addresses: list[str]) -> None:
    """A rejected request leaves every worker idle again."""
    await settle(worker_addresses)
    async with KVServiceClient(cluster.address) as client:
        with pytest.raises(grpc.aio.AioRpcError):
            await client.complete(list(range(1, MAX_MODEL_LEN + 2)), timeout=RPC_TIMEOUT, max_tokens=4)
    await wait_until_idle(worker_addresses, RELEASE_DEADLINE)


async def test_stats_command_on_a_worker(cluster: LocalCluster) -> None:
    """`kvservice stats --target` documents "a proxy or a worker": a decode worker answers too."""
    process = await asyncio.create_subprocess_exec(
        *kvservice_cmd("stats", "--target", cluster.decode_addresses[0], "--json"),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    stdout, stderr = await asyncio.wait_for(process.communicate(), 60)
    assert process.returncode == 0, stderr.decode()
    data = json.loads(stdout.decode().strip().splitlines()[-1])
    assert data["role"] == "decode"
    assert data["num_blocks_total"] == 64


async def test_sigterm_drains_in_flight_request(llama_dir: pathlib.Path) -> None:
    """SIGTERM to the decode worker mid-stream: the stream still ends with every token; exit 0."""
    max_tokens = 256
    async with local_cluster(str(llama_dir), num_prefill=1, num_decode=1, worker_args=WORKER_ARGS) as c:
        decode = c.child("decode-0").process
        async with KVServiceClient(c.address) as client:
            num_before = num_after = 0
            finish_reason = None
            async for chunk in client.generate(
                random_prompts([8], seed=9)[0],
                timeout=RPC_TIMEOUT,
                max_tokens=max_tokens,
                temperature=0,
                ignore_eos=True,
            ):
                # The first chunk is the prefill worker's token, which may reach the client before
                # the decode worker has the request; the second comes from the decode worker.
                if decode.returncode is None and num_before == 0 and num_after:
                    num_before = num_after + len(chunk.token_ids)
                    num_after = 0
                    decode.send_signal(signal.SIGTERM)
                else:
                    num_after += len(chunk.token_ids)
                finish_reason = chunk.finish_reason or finish_reason
        assert num_before + num_after == max_tokens
        assert finish_reason == "length"
        assert num_after > 0  # tokens kept coming after the signal: the request was in flight
        assert await asyncio.wait_for(decode.wait(), 60) == 0


async def test_proxy_sigterm_drains_and_exits_0(cluster: LocalCluster, worker_addresses: list[str]) -> None:
    """SIGTERM to the proxy mid-stream: the stream still ends with every token; the proxy exits 0."""
    await settle(worker_addresses)
    max_tokens = 256
    async with proxy(cluster.prefill_addresses, cluster.decode_addresses) as (address, process):
        async with KVServiceClient(address) as client:
            num_tokens = 0
            finish_reason = None
            async for chunk in client.generate(
                random_prompts([8], seed=11)[0],
                timeout=RPC_TIMEOUT,
                max_tokens=max_tokens,
                temperature=0,
                ignore_eos=True,
            ):
                if num_tokens == 0:
                    process.send_signal(signal.SIGTERM)
                num_tokens += len(chunk.token_ids)
                finish_reason = chunk.finish_reason or finish_reason
        assert (num_tokens, finish_reason) == (max_tokens, "length")
        assert await asyncio.wait_for(process.wait(), PROXY_EXIT_DEADLINE) == 0
    await wait_until_idle(worker_addresses, RELEASE_DEADLINE)


async def test_unknown_model_path_exits_2(tmp_path: pathlib.Path) -> None:
    missing = tmp_path / "no-such-model"
    process = await asyncio.create_subprocess_exec(
        *kvservice_cmd("serve", "--role", "both", "--model", str(missing), "--port", "0"),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    stdout, stderr = await asyncio.wait_for(process.communicate(), 120)
    assert process.returncode == 2, stderr.decode()
    lines = stderr.decode().strip().splitlines()
    assert len(lines) == 1, stderr.decode()
    assert str(missing) in lines[0]
    assert stdout == b""
