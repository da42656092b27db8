"""The OpenAI stream parser on crafted server-sent event streams: kvservice's (token_ids per
choice), vLLM's (none: one token per text delta, usage fixes the total), chat deltas, errors."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator

import pytest

from kvservice.client.bench.metrics import RequestRecord
from kvservice.client.bench.openai_stream import openai_chunks, request_body, sse_events
from kvservice.client.bench.record import StreamedChunk, record_stream


async def _lines(text: str) -> AsyncIterator[bytes]:
    """`text` line by line, as aiohttp's `response.content` yields it."""
    for line in text.encode().splitlines(keepends=True):
        yield line


def _sse(*events: object) -> str:
    return "".join(f"data: {e if isinstance(e, str) else json.dumps(e)}\n\n" for e in events)


def _completion(text: str, finish_reason: str | None = None, token_ids: list[int] | None = None) -> dict[str, object]:
    choice: dict[str, object] = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
    if token_ids is not None:
        choice["token_ids"] = token_ids
    return {"id": "cmpl-1", "object": "text_completion", "model": "m", "choices": [choice]}


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, object]:
    return {
        "id": "cmpl-1",
        "choices": [],
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        },
    }


async def _chunks(text: str) -> list[StreamedChunk]:
    return [chunk async for chunk in openai_chunks(sse_events(_lines(text)))]


async def _record(text: str) -> RequestRecord:
    return await record_stream(
        RequestRecord("r", prompt_len=3, start=time.perf_counter()), openai_chunks(sse_events(_lines(text)))
    )


async def test_sse_framing_comments_crlf_multiline_data_and_an_unterminated_last_event() -> None:
    text = ': keep-alive\r\n\r\ndata: a\r\ndata:b\r\nevent: message\r\nid: 7\r\n\r\n\ndata: {"x": 1}\n\ndata: tail'
    assert [e async for e in sse_events(_lines(text))] == ["a\nb", '{"x": 1}', "tail"]


async def test_kvservice_stream_counts_the_token_ids_of_each_choice() -> None:
    text = _sse(
        _completion("He", token_ids=[72, 101]),
        _completion("", token_ids=[0xE2]),
        _completion("\u2026!", "length", [0x80, 0xA6, 33]),
        _usage(5, 6),
        "[DONE]",
    )
    chunks = await _chunks(text)
    assert [c.num_tokens for c in chunks] == [2, 1, 3, 0]  # a token without text of its own still counts
    assert chunks[2].finish_reason == "length" and chunks[-1].num_prompt_tokens == 5
    record = await _record(text)
    assert (record.success, record.output_len, len(record.token_times), record.prompt_len) == (True, 6, 6, 5)
    assert record.text == "He\u2026!"


async def test_vllm_stream_counts_one_token_per_text_delta_and_usage_fixes_the_total() -> None:
    # vLLM sends no token ids; one delta here carries two tokens, and one event is empty.
    text = _sse(
        _completion(" a"), _completion(" b c"), _completion(""), _completion(" d", "length"), _usage(4, 5), "[DONE]"
    )
    chunks = await _chunks(text)
    assert [c.num_tokens for c in chunks] == [1, 1, 0, 1, 2]
    record = await _record(text)
    assert (record.success, record.output_len, len(record.token_times), record.prompt_len) == (True, 5, 5, 4)


async def test_vllm_stream_without_usage_keeps_the_per_event_count() -> None:
    record = await _record(_sse(_completion("x"), _completion("y", "stop"), "[DONE]"))
    assert (record.success, record.output_len, record.prompt_len) == (True, 2, 3)


async def test_chat_stream_counts_content_deltas_not_the_role_delta() -> None:
    def delta(content: str | None, finish_reason: str | None = None, role: str | None = None) -> dict[str, object]:
        body = {k: v for k, v in (("role", role), ("content", content)) if v is not None}
        return {
            "object": "chat.completion.chunk",
            "choices": [{"index": 0, "delta": body, "finish_reason": finish_reason}],
        }

    text = _sse(
        delta("", role="assistant"), delta("Hi"), delta(" there"), delta(None, "length"), _usage(9, 2), "[DONE]"
    )
    assert [c.num_tokens for c in await _chunks(text)] == [0, 1, 1, 0, 0]
    record = await _record(text)
    assert (record.success, record.output_len, record.prompt_len, record.text) == (True, 2, 9, "Hi there")


async def test_an_error_event_fails_the_request_with_its_message() -> None:
    error = {"error": {"message": "decode worker lost", "type": "ServiceUnavailable", "param": None, "code": 503}}
    record = await _record(_sse(_completion("a", token_ids=[97]), error, "[DONE]"))
    assert not record.success
    assert record.error == "ValueError: error event: decode worker lost"
    assert record.output_len == 1  # what arrived before the error is kept


async def test_done_ends_the_stream_and_a_stream_without_finish_reason_fails() -> None:
    assert [c.num_tokens for c in await _chunks(_sse(_completion("a"), "[DONE]", _completion("b")))] == [1]
    record = await _record(_sse(_completion("a"), "[DONE]"))
    assert not record.success and "finish_reason=None" in record.error


async def test_a_non_json_event_fails_the_request() -> None:
    record = await _record(_sse("not json"))
    assert not record.success and "event is not JSON" in record.error


def test_request_bodies_ask_for_exactly_max_tokens_greedily_with_usage() -> None:
    completion = request_body("openai", "m", [1, 2, 3], 7)
    assert completion["prompt"] == [1, 2, 3] and completion["max_tokens"] == 7
    chat = request_body("openai-chat", "m", "hello", 7)
    assert chat["messages"] == [{"role": "user", "content": "hello"}] and chat["max_completion_tokens"] == 7
    for body in (completion, chat):
        assert (body["model"], body["temperature"], body["ignore_eos"], body["stream"]) == ("m", 0.0, True, True)
        assert body["stream_options"] == {"include_usage": True}
    with pytest.raises(ValueError, match="must be text"):
        request_body("openai-chat", "m", [1, 2], 7)
