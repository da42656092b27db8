"""`Worker.Decode` on a decode worker: pull the prompt's KV from its prefill worker, then generate."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import grpc

from kvservice.async_engine import AsyncLLMEngine
from kvservice.connector.base import REMOTE_ADDRESS, TRANSFER_TOKEN
from kvservice.request import check_request_id
from kvservice.server.convert import prompt_from_proto, sampling_params_from_proto
from kvservice.server.errors import abort_with
from kvservice.server.generation import stream_responses
from kvservice.server.metrics import ServerMetrics
from kvservice.server.stats import engine_stats
from kvservice.v1 import kvservice_pb2 as pb
from kvservice.v1 import kvservice_pb2_grpc as pb_grpc

logger = logging.getLogger(__name__)

class DecodeWorkerService(pb_grpc.WorkerServicer):
    def __init__(self, engine: AsyncLLMEngine, metrics: ServerMetrics | None = None) -> None:
        self.engine = engine
        self.metrics = metrics if metrics is not None else ServerMetrics("decode")

    async def Decode(self, request: pb.DecodeRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateResponse]:
        try:
            inner = request.request
            check_request_id(inner.request_id, "request.request_id")
            with self.metrics.track(inner.request_id, logger) as tracker:
                prompt = prompt_from_proto(inner, self.engine.engine.max_model_len)
                params = sampling_params_from_proto(inner.sampling_params)
                kv_params = None
                if request.HasField("kv_transfer_params"):
                    source = request.kv_transfer_params
                    if not source.remote_address or not source.transfer_token:
                        raise ValueError("kv_transfer_params: remote_address and transfer_token are required")
                    kv_params = {REMOTE_ADDRESS: source.remote_address, TRANSFER_TOKEN: source.transfer_token}
                    logger.info("request_id=%s pulls its KV from %s", inner.request_id, source.remote_address)
                async for response in stream_responses(self.engine, prompt, params, inner.request_id, kv_params):
                    tracker.on_tokens(len(response.token_ids))
                    yield response
        except Exception as e:
            await abort_with(context, e)

    async def Stats(self, request: pb.StatsRequest, context: grpc.aio.ServicerContext) -> pb.StatsResponse:
        return await self.engine.call(lambda engine: engine_stats(engine, "decode"))
