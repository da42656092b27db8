"""The proxy's OpenAI-compatible HTTP front, driven by the official `openai` package, unchanged."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
from collections.abc import AsyncIterator

import openai
import pytest
import pytest_asyncio
from conftest import all_worker_stats, is_idle, local_cluster, wait_for_stats

from kvservice.client.client import KVServiceClient
from kvservice.client.cluster import LocalCluster

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

MODEL = "tiny"
PROMPT = [5, 17, 99, 3, 250, 8, 41]
WORKER_ARGS = ("--num-threads", "1", "--num-blocks", "64", "--max-model-len", "128")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def cluster() -> AsyncIterator[LocalCluster]:
    proxy_args = ("--http-port", "0", "--served-model-name", MODEL, "--health-interval", "0.2")
    async with local_cluster(MODEL, worker_args=WORKER_ARGS, proxy_args=proxy_args) as c:
        yield c


@pytest_asyncio.fixture(loop_scope="module")
async def client(cluster: LocalCluster) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(
        base_url=f"http://{cluster.child('proxy').http_address}/v1", api_key="unused", max_retries=0, timeout=60
    ) as c:
        yield c


async def grpc_greedy(cluster: LocalCluster, prompt: list[int] | str, max_tokens: int) -> list[int]:
    async with KVServiceClient(cluster.address) as grpc_client:
        return list(
            (
                await grpc_client.complete(prompt, max_tokens=max_tokens, temperature=0, ignore_eos=True, timeout=60)
            ).token_ids
        )


def http_get(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=30) as response:
            return response.status, json.load(response)
    except urllib.error.HTTPError as e:
        return e.code, json.load(e)


async def test_models_and_health(cluster: LocalCluster, client: openai.AsyncOpenAI) -> None:
    models = await client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    status, body = await asyncio.to_thread(http_get, f"http://{cluster.child('proxy').http_address}/health")
    assert (status, body["status"]) == (200, "ok")


async def test_completion_matches_grpc(cluster: LocalCluster, client: openai.AsyncOpenAI) -> None:
    expected = await grpc_greedy(cluster, PROMPT, 8)
    completion = await client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=8,
        temperature=0,
        extra_body={"ignore_eos": True},
        extra_headers={"X-Request-Id": "openai-rid-1"},
    )
    (choice,) = completion.choices
    assert completion.id == "cmpl-openai-rid-1"
    assert choice.token_ids == expected
    assert choice.finish_reason == "length"
    assert completion.usage is not None
    assert (completion.usage.prompt_tokens, completion.usage.completion_tokens) == (len(PROMPT), 8)


async def test_streaming_matches_non_streaming(cluster: LocalCluster, client: openai.AsyncOpenAI) -> None:
    full = await client.completions.create(
        model=MODEL, prompt="Hello, world", max_tokens=6, temperature=0, seed=1, extra_body={"ignore_eos": True}
    )
    stream = await client.completions.create(
        model=MODEL,
        prompt="Hello, world",
        max_tokens=6,
        temperature=0,
        seed=1,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    token_ids: list[int] = []
    text = ""
    finish_reasons = []
    usage = None
    num_chunks = 0
    async for chunk in stream:
        num_chunks += 1
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            token_ids += choice.token_ids
            text += choice.text
            finish_reasons.append(choice.finish_reason)
    assert num_chunks > 2  # really streamed, not one blob
    assert token_ids == full.choices[0].token_ids and len(token_ids) == 6
    assert text == full.choices[0].text
    assert finish_reasons[-1] == "length" and set(finish_reasons[:-1]) == {None}
    assert usage is not None and usage.completion_tokens == 6


async def test_client_hanging_up_mid_stream_cancels_the_request(
    cluster: LocalCluster, client: openai.AsyncOpenAI
) -> None:
    """A stream whose client goes away ends its request (every block free) and the front serves on."""
    workers = [*cluster.prefill_addresses, *cluster.decode_addresses]
    aborted_before = (await all_worker_stats(cluster.decode_addresses))[
        cluster.decode_addresses[0]
    ].num_aborted_requests
    stream = await client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=120,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    chunks = 0
    async for _chunk in stream:
        chunks += 1
        if chunks == 2:
            break
    await stream.close()  # hang up with ~118 tokens still to come
    stats = await wait_for_stats(
        workers, lambda stats: all(is_idle(s) for s in stats.values()), "idle after the hang-up"
    )
    assert (
        stats[cluster.decode_addresses[0]].num_aborted_requests == aborted_before + 1
    )  # cancelled, not run to the end
    assert (await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0)).choices[
        0
    ].text is not None


async def test_stop_token_ids(cluster: LocalCluster, client: openai.AsyncOpenAI) -> None:
    expected = await grpc_greedy(cluster, PROMPT, 8)
    stop = expected[3]
    completion = await client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, stop=[stop], extra_body={"ignore_eos": True}
    )
    assert completion.choices[0].finish_reason == "stop"
    assert completion.choices[0].token_ids == expected[: expected.index(stop) + 1]


@pytest.mark.parametrize("stream", [False, True])
async def test_stop_strings(cluster: LocalCluster, client: openai.AsyncOpenAI, stream: bool) -> None:
    # tiny's greedy text for "abc" has printable characters past its first.
    full = await client.completions.create(
        model=MODEL, prompt="abc", max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
    )
    text = full.choices[0].text
    index = next(
        i for i in range(1, len(text)) if text[i].isascii() and text[i].isprintable() and text.index(text[i]) == i
    )
    kwargs = {"model": MODEL, "prompt": "abc", "max_tokens": 8, "temperature": 0, "extra_body": {"ignore_eos": True}}
    if not stream:
        completion = await client.completions.create(**kwargs, stop=text[index])
        assert completion.choices[0].text == text[:index] and completion.choices[0].finish_reason == "stop"
        return
    chunks = [c async for c in await client.completions.create(**kwargs, stop=["never", text[index]], stream=True)]
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text[:index]
    assert chunks[-1].choices[0].finish_reason == "stop"


@pytest.mark.parametrize("stream", [False, True])
async def test_errors_are_openai_style(client: openai.AsyncOpenAI, stream: bool) -> None:
    with pytest.raises(openai.BadRequestError) as bad:
        await client.completions.create(model=MODEL, prompt="x", temperature=-1, stream=stream)
    assert "temperature" in bad.value.message
    assert bad.value.body["code"] == "invalid_argument"
    with pytest.raises(openai.BadRequestError, match="stop"):
        await client.completions.create(model=MODEL, prompt="x", stop=[""], stream=stream)
    with pytest.raises(openai.BadRequestError, match="stop"):
        await client.completions.create(model=MODEL, prompt="x", stop=["a", 1], stream=stream)  # type: ignore[list-item]
    with pytest.raises(openai.BadRequestError, match="prompt"):
        await client.completions.create(model=MODEL, prompt=[], stream=stream)
    with pytest.raises(openai.NotFoundError):
        await client.completions.create(model="gpt-4", prompt="x", stream=stream)
