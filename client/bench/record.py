"""Send one request and record when each of its tokens arrived: the one loop that the demo
and every benchmark share, so they count success and time tokens the same way."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

import aiohttp
import grpc

from kvservice.client.bench.metrics import RequestRecord
from kvservice.client.client import KVServiceClient

# A stream that ends with one of these delivered what was asked for.
SUCCESS_FINISH_REASONS = ("length", "stop")


@dataclass(frozen=True, slots=True)
class StreamedChunk:
    """What one streamed event carried, whatever the backend (gRPC, OpenAI HTTP)."""

    num_tokens: int
    text: str = ""
    finish_reason: str | None = None
    num_prompt_tokens: int = 0  # the server's count, where it reports one
    token_ids: tuple[int, ...] = ()  # where the backend streams ids (gRPC; HTTP streams text)


async def record_stream(record: RequestRecord, chunks: AsyncIterator[StreamedChunk]) -> RequestRecord:
    """Consume `chunks` into `record`: every token of a chunk gets that chunk's arrival time.

    Success means the stream ended with a finish reason of "length" or "stop"; a stream
    that ends any other way, or raises, is a failure with its reason in `record.error`.
    """
    finish_reason = None
    try:
        async for chunk in chunks:
            now = time.perf_counter()
            record.token_times.extend([now] * chunk.num_tokens)
            record.output_len += chunk.num_tokens
            record.text += chunk.text
            record.output_token_ids.extend(chunk.token_ids)
            finish_reason = chunk.finish_reason or finish_reason
            if chunk.num_prompt_tokens:
                record.prompt_len = chunk.num_prompt_tokens  # the server's count is the truth
        record.success = finish_reason in SUCCESS_FINISH_REASONS
        if not record.success:
            record.error = f"stream ended with finish_reason={finish_reason}"
    except grpc.aio.AioRpcError as e:
        record.error = f"{e.code().name}: {e.details()}"
    except (OSError, ValueError, aiohttp.ClientError) as e:  # HTTP backends: connection errors, bad responses
        record.error = f"{type(e).__name__}: {e}"
    finally:
        record.end = time.perf_counter()
    return record


async def grpc_chunks(
    client: KVServiceClient, prompt: str | Sequence[int], request_id: str, timeout: float | None, **params: object
) -> AsyncIterator[StreamedChunk]:
    """`client.generate` as backend-neutral chunks."""
    async for chunk in client.generate(prompt, timeout=timeout, request_id=request_id, **params):
        yield StreamedChunk(
            len(chunk.token_ids), chunk.text, chunk.finish_reason, chunk.num_prompt_tokens, tuple(chunk.token_ids)
        )


async def record_grpc_request(
    client: KVServiceClient,
    prompt: str | Sequence[int],
    request_id: str,
    *,
    max_tokens: int,
    prompt_len: int = 0,
    timeout: float | None = None,
) -> RequestRecord:
    """One streamed gRPC request at temperature 0 with `ignore_eos` (exactly `max_tokens` tokens)."""
    record = RequestRecord(request_id, prompt_len=prompt_len, start=time.perf_counter())
    chunks = grpc_chunks(client, prompt, request_id, timeout, max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return await record_stream(record, chunks)
