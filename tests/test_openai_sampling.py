"""Logprobs, cached tokens, seeds and `n` through the OpenAI front (and gRPC `Complete`),
disaggregated (1P1D behind the proxy) and colocated, prefix caching on: what the official
`openai` client receives equals the engine's own output in this process
(tests/test_logprobs.py holds the engine's logprobs to transformers)."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from typing import Any

import openai
import pytest
import pytest_asyncio
from conftest import local_cluster, wait_until_idle

from kvservice import LLM, SamplingParams
from kvservice.client.client import KVServiceClient, build_request
from kvservice.client.cluster import LocalCluster
from kvservice.core.logprobs import TokenLogprobs
from kvservice.loading.tokenizer import ByteTokenizer
from kvservice.v1 import kvservice_pb2_grpc as pb_grpc

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

MODEL = "tiny"
BLOCK_SIZE = 16
WORKER_ARGS = ("--num-threads", "1", "--num-blocks", "64", "--max-model-len", "128", "--block-size", str(BLOCK_SIZE))
PROMPT = [(7 * i + 3) % 250 + 3 for i in range(40)]  # two full blocks and a partial one
MAX_TOKENS = 6
NUM_TOP = 3
ATOL = 1e-4
DEPLOYMENTS = ("1p1d", "colocated")


@pytest.fixture(scope="module")
def reference() -> Any:
    """The engine in this process: the prompt's and the greedy tokens' logprobs."""
    llm = LLM(MODEL, block_size=BLOCK_SIZE, max_model_len=128)
    params = SamplingParams(
        temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=NUM_TOP, prompt_logprobs=NUM_TOP
    )
    return llm.generate(PROMPT, params)[0]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def clusters() -> AsyncIterator[dict[str, LocalCluster]]:
    proxy_args = ("--http-port", "0", "--model", MODEL, "--health-interval", "0.2")
    async with (
        local_cluster(MODEL, worker_args=WORKER_ARGS, proxy_args=proxy_args) as pair,
        local_cluster(MODEL, worker_args=(*WORKER_ARGS, "--http-port", "0"), colocated=True) as colocated,
    ):
        yield {"1p1d": pair, "colocated": colocated}


def http_address(cluster: LocalCluster) -> str:
    return cluster.child("proxy" if not cluster.colocated else "both").http_address


@pytest_asyncio.fixture(loop_scope="module", params=DEPLOYMENTS)
async def served(
    request: pytest.FixtureRequest, clusters: dict[str, LocalCluster]
) -> AsyncIterator[tuple[LocalCluster, openai.AsyncOpenAI]]:
    cluster = clusters[request.param]
    base_url = f"http://{http_address(cluster)}/v1"
    async with openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=60) as client:
        yield cluster, client
    # Every block returns to the free pool on every server (prompt-logprobs requests included).
    await wait_until_idle([c.address for c in cluster.children if c.name != "proxy"])


def assert_matches(
    values: list[float | None], tops: list[dict[str, float] | None], expected: list[TokenLogprobs]
) -> None:
    """Each position's logprob, and its top tokens keyed by text as the legacy completions
    shape has them (tokens that decode alike keep the most likely; the position's own is there)."""
    tokenizer = ByteTokenizer()  # the tiny model's
    assert len(values) == len(expected)
    for value, top, want in zip(values, tops, expected):
        assert value == pytest.approx(want.logprob, abs=ATOL)
        expected_top: dict[str, float] = {}
        for token_id, logprob in (*want.top, (want.token_id, want.logprob)):
            expected_top.setdefault(tokenizer.decode([token_id], skip_special_tokens=False), logprob)
        assert top is not None and top.keys() == expected_top.keys()
        assert list(top.values()) == pytest.approx(list(expected_top.values()), abs=ATOL)


async def test_completion_echo_logprobs_equal_the_engines(
    served: tuple[LocalCluster, openai.AsyncOpenAI], reference: Any
) -> None:
    _, client = served
    # Twice: the second time the prompt is in the prefix cache, and its logprobs are still computed.
    for _ in range(2):
        out = await client.completions.create(
            model=MODEL,
            prompt=PROMPT,
            max_tokens=MAX_TOKENS,
            temperature=0,
            logprobs=NUM_TOP,
            echo=True,
            extra_body={"ignore_eos": True},
        )
        choice = out.choices[0]
        lp = choice.logprobs
        assert lp is not None and len(lp.tokens) == len(PROMPT) + MAX_TOKENS
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # nothing predicts the first token
        assert_matches(lp.token_logprobs[1 : len(PROMPT)], lp.top_logprobs[1 : len(PROMPT)], reference.prompt_logprobs)
        assert_matches(lp.token_logprobs[len(PROMPT) :], lp.top_logprobs[len(PROMPT) :], reference.logprobs)
        assert choice.text.endswith(reference.text) and len(choice.text) > len(reference.text)  # the prompt, echoed
        assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
        assert choice.model_extra["token_ids"] == reference.token_ids


async def test_streamed_logprobs_equal_the_whole_answers(
    served: tuple[LocalCluster, openai.AsyncOpenAI], reference: Any
) -> None:
    _, client = served
    values: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    stream = await client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=MAX_TOKENS,
        temperature=0,
        logprobs=NUM_TOP,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].logprobs is not None:
            assert len(chunk.choices[0].logprobs.token_logprobs) == len(chunk.choices[0].model_extra["token_ids"])
            values += chunk.choices[0].logprobs.token_logprobs
            tops += chunk.choices[0].logprobs.top_logprobs
    assert_matches(values, tops, reference.logprobs)


async def test_chat_logprobs(served: tuple[LocalCluster, openai.AsyncOpenAI]) -> None:
    _, client = served
    messages = [{"role": "user", "content": "Hello there"}]
    out = await client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=MAX_TOKENS,
        temperature=0,
        logprobs=True,
        top_logprobs=2,  # type: ignore[arg-type]
        extra_body={"ignore_eos": True},
    )
    expected = LLM(MODEL, block_size=BLOCK_SIZE, max_model_len=128).chat(
        messages, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)
    )[0]
    content = out.choices[0].logprobs.content  # type: ignore[union-attr]
    assert [entry.logprob for entry in content] == pytest.approx(
        [lp.logprob for lp in expected.logprobs or []], abs=ATOL
    )
    assert all(len(entry.top_logprobs) == 2 for entry in content)
    assert all(entry.top_logprobs[0].logprob >= entry.logprob - ATOL for entry in content)  # greedy: the best


async def test_cached_tokens_in_usage(served: tuple[LocalCluster, openai.AsyncOpenAI]) -> None:
    _, client = served
    prompt = [t + 1 for t in PROMPT]  # a prompt no other test sent
    first = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    again = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0  # type: ignore[union-attr]
    # The two full blocks of the prompt were cached by the first request (its last token is always computed).
    assert again.usage.prompt_tokens_details.cached_tokens == 2 * BLOCK_SIZE  # type: ignore[union-attr]
    assert again.choices[0].text == first.choices[0].text


async def test_bad_logprobs_fields_get_400_naming_them(served: tuple[LocalCluster, openai.AsyncOpenAI]) -> None:
    _, client = served
    with pytest.raises(openai.BadRequestError, match="logprobs"):
        await client.completions.create(model=MODEL, prompt=PROMPT, logprobs=21)
    with pytest.raises(openai.BadRequestError, match="top_logprobs"):
        await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], top_logprobs=2)
    with pytest.raises(openai.BadRequestError, match="suffix"):
        await client.completions.create(model=MODEL, prompt="x", suffix="y")


async def test_seeded_sampling_is_the_same_wherever_the_prompt_ran(
    served: tuple[LocalCluster, openai.AsyncOpenAI],
) -> None:
    """Disaggregated, the first token is drawn on the prefill worker and the rest on the
    decode worker; each draw depends only on (seed, position), so the tokens equal the colocated ones."""
    _, client = served
    params = SamplingParams(temperature=1.0, seed=21, max_tokens=MAX_TOKENS, ignore_eos=True)
    expected = LLM(MODEL, block_size=BLOCK_SIZE, max_model_len=128).generate(PROMPT, dataclasses.replace(params, n=3))
    out = await client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=MAX_TOKENS,
        temperature=1.0,
        seed=21,
        n=3,
        extra_body={"ignore_eos": True},
    )
    assert [c.model_extra["token_ids"] for c in out.choices] == [e.token_ids for e in expected]
    alone = await client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=MAX_TOKENS,
        temperature=1.0,
        seed=22,
        extra_body={"ignore_eos": True},
    )
    assert alone.choices[0].model_extra["token_ids"] == expected[1].token_ids  # sequence 1 of n: seed + 1


async def test_grpc_complete_returns_every_sequence(served: tuple[LocalCluster, openai.AsyncOpenAI]) -> None:
    cluster, _ = served
    async with KVServiceClient(cluster.address) as grpc_client:
        request = build_request(
            PROMPT, max_tokens=MAX_TOKENS, temperature=0.5, seed=5, ignore_eos=True, logprobs=1, n=2
        )
        result = await pb_grpc.GenerationStub(grpc_client.channel).Complete(request, timeout=60)
    assert [s.index for s in result.sequences] == [0, 1]
    assert list(result.token_ids) == list(result.sequences[0].token_ids)
    assert all(len(s.token_ids) == MAX_TOKENS for s in result.sequences)
    assert all([len(lp.top) for lp in s.logprobs] == [1] * MAX_TOKENS for s in result.sequences)
