"""Streaming a request through an `AsyncLLMEngine` as protobuf responses; shared by the services."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any

from kvservice.async_engine import AsyncLLMEngine
from kvservice.sampling_params import SamplingParams
from kvservice.v1 import kvservice_pb2 as pb
from kvservice.server.convert import response_from_output
from kvservice.server.errors import RequestFailed


def new_request_id() -> str:
    return uuid.uuid4().hex


async def stream_responses(
    engine: AsyncLLMEngine,
    prompt: str | list[int],
    params: SamplingParams,
    request_id: str,
    kv_transfer_params: dict[str, Any] | None = None,
) -> AsyncIterator[pb.GenerateResponse]:
    """One response per engine output; an engine-side error raises RequestFailed."""
    async for out in engine.generate(prompt, params, request_id, kv_transfer_params):
        if out.error is not None:
            raise RequestFailed(out.error)
        yield response_from_output(out, out.new_token_ids, out.new_text)
