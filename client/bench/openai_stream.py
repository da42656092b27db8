"""Streamed OpenAI-compatible requests (`/v1/completions`, `/v1/chat/completions`) as `StreamedChunk`s.

The server-sent events are parsed here (`sse_events`), each event becomes one chunk
(`openai_chunks`), and `record_stream` times them like any other backend's.

How tokens are counted, per event:
- a choice that carries `token_ids` (kvservice's front) counts exactly those;
- otherwise (vLLM, SGLang) an event whose text delta is not empty counts one token, the
  usual one token per event of a streaming server;
- the final `usage` event (requested with `stream_options.include_usage`) fixes the total:
  tokens it reports beyond those counted (several tokens in one delta, or tokens with no
  text of their own) arrive at the usage event's time. Its `prompt_tokens` is the prompt's
  length. Without a usage event the per-event count stands.
An `error` event, or an HTTP status other than 200, ends the stream with ValueError.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp

from kvservice.client.bench.metrics import RequestRecord
from kvservice.client.bench.record import StreamedChunk, record_stream

COMPLETIONS, CHAT = "openai", "openai-chat"
ENDPOINTS = {COMPLETIONS: "/v1/completions", CHAT: "/v1/chat/completions"}
DONE = "[DONE]"


def request_body(backend: str, model: str, prompt: str | list[int], max_tokens: int) -> dict[str, Any]:
    """The JSON body of one greedy streamed request that generates exactly `max_tokens` tokens.

    `ignore_eos` is vLLM's extension (kvservice and SGLang take it too).
    """
    body: dict[str, Any] = {
        "model": model,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if backend == COMPLETIONS:
        return {**body, "prompt": prompt, "max_tokens": max_tokens}
    if not isinstance(prompt, str):
        raise ValueError("openai-chat: the prompt must be text (decode token ids with a tokenizer first)")
    return {**body, "messages": [{"role": "user", "content": prompt}], "max_completion_tokens": max_tokens}


async def sse_events(lines: AsyncIterator[bytes]) -> AsyncIterator[str]:
    """The `data` of each server-sent event in `lines` (the event-stream format: an event
    ends at a blank line, its `data:` lines join with newlines, `:` lines are comments)."""
    data: list[str] = []
    async for raw in lines:
        line = raw.decode("utf-8").rstrip("\r\n")
        if not line:
            if data:
                yield "\n".join(data)
                data = []
            continue
        field, _, value = line.partition(":")
        if field == "data":
            data.append(value.removeprefix(" "))
    if data:  # a stream cut before its blank line still delivered this event
        yield "\n".join(data)


def _error_message(payload: Any) -> str:
    error = payload.get("error") if isinstance(payload, dict) else None
    if isinstance(error, dict):
        return str(error.get("message") or error)
    return str(error if error is not None else payload)


async def openai_chunks(events: AsyncIterator[str]) -> AsyncIterator[StreamedChunk]:
    """The events of one streamed completion or chat completion as chunks (see the module's counting rule)."""
    num_counted = 0
    async for data in events:
        if data.strip() == DONE:
            return
        try:
            event = json.loads(data)
        except json.JSONDecodeError as e:
            raise ValueError(f"event is not JSON ({e}): {data[:200]!r}") from None
        if not isinstance(event, dict):
            raise ValueError(f"event is not a JSON object: {data[:200]!r}")
        if "error" in event:
            raise ValueError(f"error event: {_error_message(event)}")
        choices = event.get("choices") or []
        if choices:
            choice = choices[0]
            delta = choice.get("delta") or {}  # chat; a completion's choice has `text`
            text = choice.get("text", delta.get("content")) or ""
            token_ids = choice.get("token_ids", delta.get("token_ids"))
            num_tokens = len(token_ids) if token_ids is not None else int(bool(text))
            num_counted += num_tokens
            yield StreamedChunk(num_tokens, text, choice.get("finish_reason"))
        usage = event.get("usage")
        if usage:
            num_completion = int(usage.get("completion_tokens") or 0)
            yield StreamedChunk(
                max(0, num_completion - num_counted), num_prompt_tokens=int(usage.get("prompt_tokens") or 0)
            )
            num_counted = max(num_counted, num_completion)


async def _response_chunks(
    session: aiohttp.ClientSession, url: str, body: dict[str, Any], headers: dict[str, str], timeout: float | None
) -> AsyncIterator[StreamedChunk]:
    async with session.post(url, json=body, headers=headers, timeout=aiohttp.ClientTimeout(total=timeout)) as response:
        if response.status != 200:
            text = await response.text()
            try:
                message = _error_message(json.loads(text))
            except json.JSONDecodeError:
                message = text[:200]
            raise ValueError(f"HTTP {response.status}: {message}")
        async for chunk in openai_chunks(sse_events(response.content)):
            yield chunk


async def record_openai_request(
    session: aiohttp.ClientSession,
    url: str,
    body: dict[str, Any],
    request_id: str,
    *,
    prompt_len: int = 0,
    api_key: str | None = None,
    timeout: float | None = None,
) -> RequestRecord:
    """POST `body` (streamed) to `url` and record its tokens; the request id travels in `X-Request-Id`."""
    headers = {"X-Request-Id": request_id}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    record = RequestRecord(request_id, prompt_len=prompt_len, start=time.perf_counter())
    return await record_stream(record, _response_chunks(session, url, body, headers, timeout))
