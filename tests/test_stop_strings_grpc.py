"""Stop strings over gRPC: a colocated worker, and a 1P1D cluster behind the proxy.

In the 1P1D cluster the prefill worker sends the first token and the decode worker the
rest; a stop string may end in the first token, start in it and end later, or only
look like it starts there. The client must see the same text as from the colocated
worker: the text before the stop string, nothing of it, nothing after it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import grpc
import pytest
import pytest_asyncio
from conftest import local_cluster

from kvservice import LLM, SamplingParams
from kvservice.client.client import GenerateChunk, KVServiceClient
from kvservice.client.cluster import LocalCluster
from kvservice.server.proxy.pair_calls import without_first_token
from kvservice.v1 import kvservice_pb2 as pb

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

WORKER_ARGS = ["--num-threads", "1", "--num-blocks", "64"]
# tiny's greedy output for it starts with two printable characters ("'" and "\\", with a
# token of no text between them), then more bytes: enough for every case below.
PROMPT = "abc"
NUM_TOKENS = 16
IDLE_DEADLINE = 10.0


DEPLOYMENTS = {"colocated": {"colocated": True}, "disaggregated": {"num_prefill": 1, "num_decode": 1}}


@pytest_asyncio.fixture(scope="module", loop_scope="module", params=list(DEPLOYMENTS))
async def cluster(request: pytest.FixtureRequest) -> AsyncIterator[LocalCluster]:
    async with local_cluster("tiny", worker_args=WORKER_ARGS, **DEPLOYMENTS[request.param]) as cluster:
        yield cluster


def workers(cluster: LocalCluster) -> list[str]:
    return cluster.prefill_addresses + cluster.decode_addresses or [cluster.address]


async def stream(address: str, **params: object) -> list[GenerateChunk]:
    async with KVServiceClient(address) as client:
        return [
            chunk
            async for chunk in client.generate(
                PROMPT, timeout=60, max_tokens=NUM_TOKENS, temperature=0, ignore_eos=True, **params
            )
        ]


@pytest.fixture(scope="module")
def full() -> tuple[list[int], str]:
    """The greedy output without stop strings, in this process: the reference every case cuts."""
    [out] = LLM("tiny", num_blocks=64).generate(
        PROMPT, SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)
    )
    assert len(out.token_ids) == NUM_TOKENS and out.finish_reason == "length"
    assert out.text[:2].isascii() and out.text[:2].isprintable(), out.text  # the cases below rely on it
    return out.token_ids, out.text


def is_idle(stats: pb.StatsResponse) -> bool:
    return stats.num_blocks_free == stats.num_blocks_total and stats.kv_sending.staging_bytes_in_use == 0


async def wait_until_all_blocks_free(addresses: list[str]) -> None:
    """Every block free and no KV staged, on every worker. The stream ends a moment before
    the worker's step thread frees the blocks: a readiness wait with a deadline."""
    deadline = time.monotonic() + IDLE_DEADLINE
    for address in addresses:
        async with KVServiceClient(address) as client:
            while not is_idle(stats := await client.stats()):
                assert time.monotonic() < deadline, f"{address}: blocks or staging still in use: {stats}"
                await asyncio.sleep(0.05)  # polling period of a readiness wait


def cases(text: str) -> dict[str, tuple[str, str]]:
    """name -> (stop string, the text expected before it)."""
    later = next(
        text[i : i + 2] for i in range(2, len(text) - 2) if text[i : i + 2].isascii() and text[i : i + 2].isprintable()
    )
    return {
        "later": (later, text[: text.index(later)]),
        "in_first_token": (text[0], ""),
        "starts_in_first_token": (text[:2], ""),
        "only_looks_like_it": (text[0] + "\x00", text),  # held back at first, then released
    }


@pytest.mark.parametrize("case", ["later", "in_first_token", "starts_in_first_token", "only_looks_like_it"])
async def test_stop_string_text_and_finish_reason(
    cluster: LocalCluster, full: tuple[list[int], str], case: str
) -> None:
    full_ids, full_text = full
    stop, expected = cases(full_text)[case]
    chunks = await stream(cluster.address, stop=[stop])
    shown = ""
    for chunk in chunks:
        shown += chunk.text
        assert expected.startswith(shown), (shown, expected)  # no part of the stop string, ever
    token_ids = [t for c in chunks for t in c.token_ids]
    assert shown == expected
    if case == "only_looks_like_it":
        assert chunks[-1].finish_reason == "length" and token_ids == full_ids
    else:
        assert chunks[-1].finish_reason == "stop"
        assert 0 < len(token_ids) < NUM_TOKENS and token_ids == full_ids[: len(token_ids)]
    assert [c.finish_reason for c in chunks[:-1]] == [None] * (len(chunks) - 1)
    await wait_until_all_blocks_free(workers(cluster))


async def test_complete_with_stop_matches_the_stream(cluster: LocalCluster, full: tuple[list[int], str]) -> None:
    stop, expected = cases(full[1])["later"]
    async with KVServiceClient(cluster.address) as client:
        completion = await client.complete(PROMPT, max_tokens=NUM_TOKENS, temperature=0, ignore_eos=True, stop=stop)
    assert completion.text == expected and completion.finish_reason == "stop"


async def test_bad_stop_strings_are_invalid_argument(cluster: LocalCluster) -> None:
    async with KVServiceClient(cluster.address) as client:
        for stop in ([""], ["x" * 257], ["x"] * 17):
            with pytest.raises(grpc.aio.AioRpcError) as error:
                await client.complete(PROMPT, max_tokens=4, stop=stop)
            assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "sampling_params.stop" in (error.value.details() or "")
    await wait_until_all_blocks_free(workers(cluster))


async def test_proxy_keeps_text_the_decode_worker_released_with_its_first_token() -> None:
    # The decode worker's first output repeats the prefill's token; when it also ends the
    # request, it carries the text held back until then. The proxy drops only what was sent.
    response = pb.GenerateResponse(token_ids=[7], text="ab", finish_reason=pb.FINISH_REASON_LENGTH)
    assert without_first_token(response, "a").text == "b"
    assert without_first_token(response, "").text == "ab"
    assert without_first_token(response, "x").text == ""  # not a continuation: nothing is shown twice
    assert list(without_first_token(response, "a").token_ids) == []


async def test_proxy_drops_the_first_tokens_text_from_a_merged_first_chunk() -> None:
    # A decode stream that fell behind merges its first chunks: the prefill's token and the next
    # ones in one response. Only the first token and its text go; the next tokens' text stays.
    response = pb.GenerateResponse(token_ids=[7, 8, 9], text="'x'y")
    rest = without_first_token(response, "'")
    assert list(rest.token_ids) == [8, 9] and rest.text == "x'y"
    # The pulled first token has no logprobs on the decode worker: the ones there are the next tokens'.
    with_logprobs = pb.GenerateResponse(token_ids=[7, 8, 9], logprobs=[pb.Logprobs(), pb.Logprobs()])
    with_logprobs.logprobs[0].logprob, with_logprobs.logprobs[1].logprob = -1.0, -2.0
    rest = without_first_token(with_logprobs, "")
    assert [lp.logprob for lp in rest.logprobs] == [-1.0, -2.0]
    # Recomputed there, the first token has its own, and they go with it.
    with_logprobs.logprobs.add().logprob = -3.0
    assert [lp.logprob for lp in without_first_token(with_logprobs, "").logprobs] == [-2.0, -3.0]
