"""The client API (`Generation`) served by a colocated worker (`--role both`): the baseline."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import grpc

from kvservice.async_engine import AsyncLLMEngine
from kvservice.server.convert import prompt_from_proto, sampling_params_from_proto
from kvservice.server.errors import abort_with
from kvservice.server.generation import new_request_id, stream_responses
from kvservice.server.metrics import ServerMetrics
from kvservice.server.stats import engine_stats
from kvservice.v1 import kvservice_pb2 as pb
from kvservice.v1 import kvservice_pb2_grpc as pb_grpc

logger = logging.getLogger(__name__)

class ColocatedGenerationService(pb_grpc.GenerationServicer):
    def __init__(self, engine: AsyncLLMEngine, role: str = "both", metrics: ServerMetrics | None = None) -> None:
        self.engine = engine
        self.role = role
        self.metrics = metrics if metrics is not None else ServerMetrics(role)

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateResponse]:
        try:
            request_id = request.request_id or new_request_id()
            with self.metrics.track(request_id, logger) as tracker:
                prompt = prompt_from_proto(request)
                params = sampling_params_from_proto(request.sampling_params)
                async for response in stream_responses(self.engine, prompt, params, request_id):
                    tracker.on_tokens(len(response.token_ids))
                    yield response
        except Exception as e:
            await abort_with(context, e)

    async def Complete(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> pb.CompleteResponse:
        result = pb.CompleteResponse()
        try:
            request_id = request.request_id or new_request_id()
            with self.metrics.track(request_id, logger) as tracker:
                prompt = prompt_from_proto(request)
                params = sampling_params_from_proto(request.sampling_params)
                async for response in stream_responses(self.engine, prompt, params, request_id):
                    tracker.on_tokens(len(response.token_ids))
                    merge_into_complete(result, response)
        except Exception as e:
            await abort_with(context, e)
        return result

    async def Stats(self, request: pb.StatsRequest, context: grpc.aio.ServicerContext) -> pb.StatsResponse:
        return await self.engine.call(lambda engine: engine_stats(engine, self.role))


def merge_into_complete(result: pb.CompleteResponse, response: pb.GenerateResponse) -> None:
    result.request_id = response.request_id
    result.token_ids.extend(response.token_ids)
    result.text += response.text
    result.num_prompt_tokens = response.num_prompt_tokens
    if response.finish_reason:
        result.finish_reason = response.finish_reason
