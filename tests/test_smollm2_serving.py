"""The real model served: a launched 1P1D cluster on SmolLM2, asked through the proxy's
OpenAI-compatible `/v1/chat/completions` with the official `openai` client. Streamed and
whole answers equal offline greedy output (`LLM.chat`, loaded once per session), a stop
string ends the text before it, and the usage counts are the real ones."""

from __future__ import annotations

from collections.abc import AsyncIterator

import openai
import pytest
import pytest_asyncio
from conftest import local_cluster

from kvservice import LLM, SamplingParams
from kvservice.loading.chat_template import apply_chat_template

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

MAX_TOKENS = 24
WORKER_ARGS = ("--num-threads", "1", "--dtype", "float32", "--max-model-len", "1024", "--kv-cache-mib", "64")
CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You answer in one short sentence."},
        {"role": "user", "content": "Why is the sky blue?"},
    ],
    [
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello! How can I help you today?"},
        {"role": "user", "content": "Name three fruits."},
    ],
]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def client(smollm2_llm: LLM) -> AsyncIterator[openai.AsyncOpenAI]:
    proxy_args = ("--http-port", "0", "--model", "smollm2", "--health-interval", "0.2")
    async with local_cluster("smollm2", worker_args=WORKER_ARGS, proxy_args=proxy_args, startup_timeout=300) as cluster:
        base_url = f"http://{cluster.child('proxy').http_address}/v1"
        async with openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=300) as c:
            yield c


def offline(llm: LLM, messages: list[dict[str, str]], **params: object) -> tuple[str, str | None, int]:
    (out,) = llm.chat(messages, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, **params))  # type: ignore[arg-type]
    return out.text, out.finish_reason, len(out.token_ids)


@pytest.mark.parametrize("index", range(len(CONVERSATIONS)))
async def test_chat_through_the_cluster_equals_offline_greedy(
    client: openai.AsyncOpenAI, smollm2_llm: LLM, index: int
) -> None:
    messages = CONVERSATIONS[index]
    text, finish_reason, num_tokens = offline(smollm2_llm, messages)
    model = (await client.models.list()).data[0].id
    whole = await client.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=MAX_TOKENS)  # type: ignore[arg-type]
    assert whole.choices[0].message.content == text and text.strip()
    assert whole.choices[0].finish_reason == finish_reason
    assert whole.usage is not None
    prompt_ids = apply_chat_template(smollm2_llm.tokenizer, messages)
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (len(prompt_ids), num_tokens)
    stream = await client.chat.completions.create(
        model=model, messages=messages, temperature=0, max_tokens=MAX_TOKENS, stream=True
    )  # type: ignore[arg-type]
    chunks = [c async for c in stream]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == finish_reason


async def test_a_stop_string_ends_the_answer_before_it(client: openai.AsyncOpenAI, smollm2_llm: LLM) -> None:
    messages = CONVERSATIONS[0]
    text, _, _ = offline(smollm2_llm, messages)
    assert "Paris" in text  # "The capital of France is Paris."
    model = (await client.models.list()).data[0].id
    answer = await client.chat.completions.create(
        model=model, messages=messages, temperature=0, max_tokens=MAX_TOKENS, stop=["Paris"]
    )  # type: ignore[arg-type]
    assert answer.choices[0].message.content == text[: text.index("Paris")]
    assert answer.choices[0].finish_reason == "stop"
