"""The Worker RPCs every role serves from its engine: Stats and SubscribeKVEvents.

`PrefillWorkerService` and `DecodeWorkerService` add their own RPCs to it; a colocated
worker (`--role both`) serves it alone next to the client API, so a router can follow
its cache too.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc

from kvservice.core.outputs import KVTransferCounters
from kvservice.engine.async_engine import AsyncLLMEngine
from kvservice.server.errors import abort_with
from kvservice.server.kv_events import KVEventPublisher
from kvservice.server.stats import engine_stats, transfer_counters_to_proto
from kvservice.v1 import kvservice_pb2 as pb
from kvservice.v1 import kvservice_pb2_grpc as pb_grpc


class EngineWorkerService(pb_grpc.WorkerServicer):
    def __init__(
        self,
        engine: AsyncLLMEngine,
        role: str,
        kv_events: KVEventPublisher | None = None,
        kv_sending: KVTransferCounters | None = None,
    ) -> None:
        """`kv_events`: the publisher fed by `engine`'s step thread; None: SubscribeKVEvents is UNIMPLEMENTED.
        `kv_sending`: a prefill worker's PullKV counters (they live in its KVTransferService, not the engine)."""
        self.engine = engine
        self.role = role
        self.kv_events = kv_events
        self.kv_sending = kv_sending

    async def stats(self) -> pb.StatsResponse:
        """This worker's figures: the engine's, and what its PullKV service sent (the Stats RPC and /metrics)."""
        stats: pb.StatsResponse = await self.engine.call(lambda engine: engine_stats(engine, self.role))
        if self.kv_sending is not None:
            transfer_counters_to_proto(self.kv_sending.snapshot(), stats.kv_sending)
        return stats

    async def Stats(self, request: pb.StatsRequest, context: grpc.aio.ServicerContext) -> pb.StatsResponse:
        return await self.stats()

    async def SubscribeKVEvents(
        self, request: pb.KVEventsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.KVEventBatch]:
        publisher = self.kv_events
        if publisher is None:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "this worker does not publish KV cache events")
            return

        async def take_snapshot() -> pb.KVEventBatch:
            return await self.engine.call(lambda engine: publisher.snapshot(engine.kv_cache_snapshot()))

        try:
            async for batch in publisher.subscribe(request.after_seq, take_snapshot):
                yield batch
        except Exception as e:
            await abort_with(context, e)
