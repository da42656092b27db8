"""The client API (`Generation`) served by a colocated worker (`--role both`): the baseline."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import grpc

from kvservice.core.request import check_request_id
from kvservice.engine.async_engine import AsyncLLMEngine
from kvservice.server.convert import prompt_from_proto, sampling_params_from_proto
from kvservice.server.generation import (
    StreamingGenerationService,
    new_request_id,
    stream_responses,
)
from kvservice.server.metrics import ServerMetrics
from kvservice.server.stats import engine_stats
from kvservice.v1 import kvservice_pb2 as pb

logger = logging.getLogger(__name__)


class ColocatedGenerationService(StreamingGenerationService):
    def __init__(self, engine: AsyncLLMEngine, role: str = "both", metrics: ServerMetrics | None = None) -> None:
        self.engine = engine
        self.role = role
        self.metrics = metrics if metrics is not None else ServerMetrics(role)

    async def responses(self, request: pb.GenerateRequest) -> AsyncIterator[pb.GenerateResponse]:
        if request.request_id:
            check_request_id(request.request_id)
        request_id = request.request_id or new_request_id()
        with self.metrics.track(request_id, logger) as tracker:
            prompt = prompt_from_proto(request, self.engine.engine.max_model_len)
            params = sampling_params_from_proto(request.sampling_params)
            async for response in stream_responses(self.engine, prompt, params, request_id):
                tracker.on_tokens(len(response.token_ids))
                yield response

    async def Stats(self, request: pb.StatsRequest, context: grpc.aio.ServicerContext) -> pb.StatsResponse:
        return await self.engine.call(lambda engine: engine_stats(engine, self.role))
