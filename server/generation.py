"""The client API's two forms over one stream of responses; shared by the colocated
worker and the proxy, which differ only in where the responses come from."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import grpc

from kvservice.core.sampling_params import SamplingParams
from kvservice.loading.chat_template import Prompt
from kvservice.server.convert import response_from_output
from kvservice.server.errors import RequestFailed, abort_with
from kvservice.v1 import kvservice_pb2 as pb
from kvservice.v1 import kvservice_pb2_grpc as pb_grpc

if TYPE_CHECKING:  # the engine (torch) only where one runs, not in the proxy
    from kvservice.engine.async_engine import AsyncLLMEngine
    from kvservice.engine.engine import RequestOutput


def new_request_id() -> str:
    return uuid.uuid4().hex


class ResponseConverter:
    """One request's engine outputs as responses: one each, the first tokens of each sequence
    flagged; an engine-side error raises RequestFailed."""

    def __init__(self) -> None:
        self.started: set[int] = set()  # sequences whose first tokens went out

    def __call__(self, out: RequestOutput) -> pb.GenerateResponse:
        if out.error is not None:
            raise RequestFailed(out.error)
        response = response_from_output(out, out.index not in self.started and bool(out.new_token_ids))
        if out.new_token_ids:
            self.started.add(out.index)
        return response


async def stream_responses(
    engine: AsyncLLMEngine,
    prompt: Prompt,
    params: SamplingParams,
    request_id: str,
    kv_transfer_params: dict[str, Any] | None = None,
) -> AsyncIterator[pb.GenerateResponse]:
    """One response per engine output; an engine-side error raises RequestFailed."""
    convert = ResponseConverter()
    async for out in engine.generate(prompt, params, request_id, kv_transfer_params):
        yield convert(out)


class CompleteResponses:
    """A stream's chunks gathered per sequence into the non-streaming form."""

    def __init__(self) -> None:
        self.sequences: dict[int, pb.CompleteResponse] = {}

    def add(self, response: pb.GenerateResponse) -> None:
        """Merge one chunk into its sequence."""
        sequence = self.sequences.get(response.index)
        if sequence is None:
            sequence = self.sequences[response.index] = pb.CompleteResponse(index=response.index)
        merge_chunk(sequence, response)

    def result(self) -> pb.CompleteResponse:
        """Sequence 0's fields, plus every sequence in `sequences` when there are several."""
        result = pb.CompleteResponse()
        if 0 in self.sequences:
            result.CopyFrom(self.sequences[0])
        if len(self.sequences) > 1:
            result.sequences.extend(self.sequences[i] for i in sorted(self.sequences))
        return result


def merge_chunk(result: pb.CompleteResponse | pb.GenerateResponse, response: pb.GenerateResponse) -> None:
    """Append `response`, a later chunk of the same sequence, to `result`: its tokens, text and
    logprobs follow, its finish reason (if any) ends it. Gathers the non-streaming form, and
    coalesces the chunks a stream is behind on into one message (the worker's outbox, the proxy)."""
    result.request_id = response.request_id
    result.token_ids.extend(response.token_ids)
    result.text += response.text
    result.num_prompt_tokens = response.num_prompt_tokens
    result.logprobs.extend(response.logprobs)
    result.prompt_logprobs.extend(response.prompt_logprobs)
    result.prompt_token_ids.extend(response.prompt_token_ids)
    if response.HasField("num_cached_tokens"):
        result.num_cached_tokens = response.num_cached_tokens
    if response.finish_reason:
        result.finish_reason = response.finish_reason


class StreamingGenerationService(pb_grpc.GenerationServicer):
    """`Generate` streams `responses(request)`; `Complete` gathers them. Errors become
    status codes in one place. Subclasses implement `responses` and `Stats`."""

    def responses(self, request: pb.GenerateRequest) -> AsyncIterator[pb.GenerateResponse]:
        raise NotImplementedError

    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        try:
            async for response in self.responses(request):
                yield response
        except Exception as e:
            await abort_with(context, e)

    async def Complete(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> pb.CompleteResponse:
        gathered = CompleteResponses()
        try:
            async for response in self.responses(request):
                gathered.add(response)
        except Exception as e:
            await abort_with(context, e)
        return gathered.result()
