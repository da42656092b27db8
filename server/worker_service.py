"""The Worker RPCs every role serves from its engine: Stats, SubscribeKVEvents and, given a
transfer registry, ExportKV and ReleaseKV (the source half of peer pulls: `prefix_export`).

`PrefillWorkerService` and `DecodeWorkerService` add their own RPCs to it; a colocated
worker (`--role both`) serves it alone next to the client API, so a router can follow
its cache too.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc

from kvservice.connector.prefix_export import export_prefix
from kvservice.connector.transfer_registry import TransferRegistry
from kvservice.core.outputs import KVTransferCounters
from kvservice.core.request import check_request_id
from kvservice.engine.async_engine import AsyncLLMEngine
from kvservice.engine.engine import LLMEngine
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
        registry: TransferRegistry | None = None,
    ) -> None:
        """`kv_events`: the publisher fed by `engine`'s step thread; None: SubscribeKVEvents is UNIMPLEMENTED.
        `kv_sending`: the worker's PullKV counters (they live in its KVTransferService, not the engine).
        `registry`: the transfers its PullKV serves; None: ExportKV and ReleaseKV are UNIMPLEMENTED."""
        self.engine = engine
        self.role = role
        self.kv_events = kv_events
        self.kv_sending = kv_sending
        self.registry = registry
        self.num_blocks_exported = 0  # staged for peers by ExportKV (the server loop's)

    async def stats(self) -> pb.StatsResponse:
        """This worker's figures: the engine's, and what its PullKV service sent (the Stats RPC and /metrics)."""
        stats: pb.StatsResponse = await self.engine.call(lambda engine: engine_stats(engine, self.role))
        if self.kv_sending is not None:
            transfer_counters_to_proto(self.kv_sending.snapshot(), stats.kv_sending)
        if self.registry is not None:
            stats.kv_offload.num_blocks_exported = self.num_blocks_exported
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

    async def _registry(self, context: grpc.aio.ServicerContext) -> TransferRegistry:
        """The registry the transfer RPCs act on; UNIMPLEMENTED on a worker without one."""
        if self.registry is None:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "this worker serves no KV pulls")
            raise AssertionError  # abort raises
        return self.registry

    async def ExportKV(self, request: pb.ExportKVRequest, context: grpc.aio.ServicerContext) -> pb.ExportKVResponse:
        registry = await self._registry(context)
        try:
            check_transfer_id(request.request_id, request.transfer_token)
            token_ids = list(request.prompt_token_ids)

            def export(engine: LLMEngine) -> pb.ExportKVResponse:
                core = engine.core
                exported = export_prefix(
                    core.scheduler.kv, core.kv_caches, registry, request.request_id, request.transfer_token, token_ids
                )
                return pb.ExportKVResponse(num_tokens=exported.num_tokens, last_block_hash=exported.last_block_hash)

            response: pb.ExportKVResponse = await self.engine.call(export)
            self.num_blocks_exported += response.num_tokens // registry.layout.block_size
            return response
        except Exception as e:
            await abort_with(context, e)
            raise  # abort raises; this line is never reached

    async def ReleaseKV(self, request: pb.ReleaseKVRequest, context: grpc.aio.ServicerContext) -> pb.ReleaseKVResponse:
        registry = await self._registry(context)
        try:
            check_transfer_id(request.request_id, request.transfer_token)
        except ValueError as e:
            await abort_with(context, e)
        return pb.ReleaseKVResponse(was_staged=registry.release(request.request_id, request.transfer_token))


def check_transfer_id(request_id: str, transfer_token: bytes) -> None:
    """Raise ValueError unless a transfer RPC names a valid request id and a token."""
    check_request_id(request_id)
    if not transfer_token:
        raise ValueError("transfer_token: empty")
