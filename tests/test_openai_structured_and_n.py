"""Structured output and `n` through the OpenAI front of a 1P1D cluster on SmolLM2 (a real
instruct model, so its answers are worth constraining):

- 50 chat requests with `response_format: json_schema` (nested objects, arrays, enums,
  numbers) all return JSON that parses and validates, and end by themselves ("stop");
- vLLM's `structured_outputs` (regex, choice) on completions match;
- a schema keyword the engine cannot enforce is a 400 naming it;
- `n=4` with a seed returns four choices, each equal to the request sent alone with seed + i,
  and the prompt's KV crosses from the prefill to the decode worker once.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator
from typing import Any

import jsonschema
import openai
import pytest
import pytest_asyncio
from conftest import local_cluster, wait_until_idle, worker_stats

from kvservice.client.cluster import LocalCluster

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(600)]

MODEL = "smollm2"
WORKER_ARGS = ("--num-threads", "1", "--max-model-len", "1024", "--kv-cache-mib", "64")
CONCURRENCY = 8

SCHEMAS: list[dict[str, Any]] = [
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 30},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
        },
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 30},
            "country": {"enum": ["France", "Spain", "Italy", "Other"]},
        },
        "required": ["city", "country"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "colors": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 1, "maxItems": 3}
        },
        "required": ["colors"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "person": {
                "type": "object",
                "properties": {
                    "first": {"type": "string", "maxLength": 20},
                    "last": {"type": "string", "maxLength": 20},
                },
                "required": ["first", "last"],
                "additionalProperties": False,
            },
            "score": {"type": "number"},
        },
        "required": ["person", "score"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {"answer": {"type": "boolean"}, "confidence": {"enum": ["low", "medium", "high"]}},
        "required": ["answer", "confidence"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "items": {
                "type": "array",
                "maxItems": 4,
                "items": {
                    "type": "object",
                    "properties": {
                        "name": {"type": "string", "maxLength": 15},
                        "qty": {"type": "integer", "minimum": 1, "maximum": 9},
                    },
                    "required": ["name", "qty"],
                    "additionalProperties": False,
                },
            }
        },
        "required": ["items"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "title": {"type": "string", "maxLength": 40},
            "year": {"type": "integer", "minimum": 1900, "maximum": 2100},
            "genres": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
        },
        "required": ["title", "year", "genres"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {"x": {"type": "number"}, "y": {"type": "number"}, "label": {"enum": ["A", "B"]}},
        "required": ["x", "y", "label"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "steps": {"type": "array", "items": {"type": "string", "maxLength": 40}, "minItems": 2, "maxItems": 3}
        },
        "required": ["steps"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "status": {"enum": ["ok", "error"]},
            "details": {
                "type": "object",
                "properties": {"code": {"type": "integer"}, "message": {"type": "string", "maxLength": 30}},
                "required": ["code", "message"],
                "additionalProperties": False,
            },
        },
        "required": ["status", "details"],
        "additionalProperties": False,
    },
]
QUESTIONS = [
    "Describe a person as JSON.",
    "Give me a city as JSON.",
    "Answer in JSON: what colors are in the French flag?",
    "Reply with JSON about your favourite thing.",
    "Return JSON for this: is the sky blue?",
]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def cluster() -> AsyncIterator[LocalCluster]:
    proxy_args = ("--http-port", "0", "--model", MODEL, "--health-interval", "0.2")
    async with local_cluster(MODEL, worker_args=WORKER_ARGS, proxy_args=proxy_args, startup_timeout=300) as c:
        yield c


@pytest_asyncio.fixture(loop_scope="module")
async def client(cluster: LocalCluster) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(
        base_url=f"http://{cluster.child('proxy').http_address}/v1", api_key="unused", max_retries=0, timeout=300
    ) as c:
        yield c
    await wait_until_idle([*cluster.prefill_addresses, *cluster.decode_addresses])


async def test_fifty_json_schema_answers_all_validate(client: openai.AsyncOpenAI) -> None:
    limit = asyncio.Semaphore(CONCURRENCY)

    async def ask(schema: dict[str, Any], question: str) -> tuple[str, str | None]:
        async with limit:
            out = await client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": question}],
                max_tokens=200,
                temperature=0,
                response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}},
            )
        return out.choices[0].message.content or "", out.choices[0].finish_reason

    cases = [(schema, question) for schema in SCHEMAS for question in QUESTIONS]
    assert len(cases) == 50
    answers = await asyncio.gather(*(ask(schema, question) for schema, question in cases))
    for (schema, question), (text, finish_reason) in zip(cases, answers):
        jsonschema.validate(json.loads(text), schema)  # raises on anything invalid
        assert finish_reason == "stop", (question, text)


async def test_json_object_regex_and_choice(client: openai.AsyncOpenAI) -> None:
    chat = await client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": 'Reply with a JSON object that has one key, "greeting".'}],
        max_tokens=100,
        temperature=0,
        response_format={"type": "json_object"},
    )
    assert isinstance(json.loads(chat.choices[0].message.content or ""), dict)
    assert chat.choices[0].finish_reason == "stop"
    regex = r"\d{3}-\d{4}"
    phone = await client.completions.create(
        model=MODEL,
        prompt="My phone number is ",
        max_tokens=20,
        temperature=0,
        extra_body={"structured_outputs": {"regex": regex}},
    )
    assert re.fullmatch(regex, phone.choices[0].text), phone.choices[0].text
    choice = await client.completions.create(
        model=MODEL,
        prompt="The capital of France is",
        max_tokens=10,
        temperature=0,
        extra_body={"structured_outputs": {"choice": ["Paris", "London", "Rome"]}},
    )
    assert choice.choices[0].text in ("Paris", "London", "Rome")


async def test_unsupported_schema_features_are_refused_naming_them(client: openai.AsyncOpenAI) -> None:
    schema = {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}
    with pytest.raises(openai.BadRequestError, match="uniqueItems"):
        await client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "x"}],
            response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}},
        )
    with pytest.raises(openai.BadRequestError, match="ignore_eos"):
        await client.completions.create(
            model=MODEL,
            prompt="x",
            extra_body={"structured_outputs": {"regex": "a+"}, "ignore_eos": True},
        )


async def test_n_sequences_equal_single_requests_with_their_seeds_and_the_kv_travels_once(
    cluster: LocalCluster, client: openai.AsyncOpenAI
) -> None:
    [decode] = cluster.decode_addresses
    prompt = "Once upon a time, in a small village by the sea, there lived an old fisherman who"
    sampling = dict(model=MODEL, prompt=prompt, max_tokens=12, temperature=0.8, extra_body={"ignore_eos": True})
    before = await worker_stats(decode)
    out = await client.completions.create(n=4, seed=100, **sampling)  # type: ignore[arg-type]
    after = await worker_stats(decode)
    assert after.kv_receiving.num_transfers - before.kv_receiving.num_transfers == 1
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert out.usage is not None and out.usage.completion_tokens == 4 * 12
    alone = [await client.completions.create(seed=100 + i, **sampling) for i in range(4)]  # type: ignore[arg-type]
    assert [c.model_extra["token_ids"] for c in out.choices] == [a.choices[0].model_extra["token_ids"] for a in alone]
    assert len({c.text for c in out.choices}) > 1


async def test_n_streams_every_choice_to_its_end(client: openai.AsyncOpenAI) -> None:
    stream = await client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Name a fruit."}],
        max_tokens=16,
        temperature=1.0,
        seed=3,
        n=2,
        stream=True,
    )
    texts = {0: "", 1: ""}
    finished: dict[int, str | None] = {}
    async for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason is not None:
                finished[choice.index] = choice.finish_reason
    assert set(finished) == {0, 1} and all(texts.values())
