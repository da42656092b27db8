"""The proxy in-process, in front of fake workers that misbehave."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import grpc
import pytest
import pytest_asyncio

from kvservice.server.grpc_server import SERVICE_NAMES, GrpcServer
from kvservice.server.proxy import ProxyService
from kvservice.server.worker_pool import WorkerPool
from kvservice.v1 import kvservice_pb2 as pb
from kvservice.v1 import kvservice_pb2_grpc as pb_grpc

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(60)]

REQUEST_TIMEOUT_S = 1.0


class _SilentWorker(pb_grpc.WorkerServicer):
    """Healthy by its health check, but its Prefill and Decode never answer."""

    async def Prefill(self, request: pb.PrefillRequest, context: grpc.aio.ServicerContext) -> pb.PrefillResponse:
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    async def Decode(self, request: pb.DecodeRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateResponse]:
        await asyncio.Event().wait()
        yield pb.GenerateResponse()


@pytest_asyncio.fixture
async def silent_worker() -> AsyncIterator[str]:
    server = GrpcServer([SERVICE_NAMES["worker"]])
    pb_grpc.add_WorkerServicer_to_server(_SilentWorker(), server.server)
    port = server.bind("127.0.0.1", 0)
    await server.server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.server.stop(None)


@pytest.mark.parametrize("has_prefill", [False, True], ids=["decode-only", "disaggregated"])
async def test_worker_calls_have_a_deadline(silent_worker: str, has_prefill: bool) -> None:
    prefill = WorkerPool([silent_worker] if has_prefill else [])
    decode = WorkerPool([silent_worker])
    try:
        await asyncio.gather(prefill.check_all(5.0), decode.check_all(5.0))
        assert decode.num_healthy == 1
        service = ProxyService(prefill, decode, request_timeout=REQUEST_TIMEOUT_S)
        request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 2, 3]))
        started = time.monotonic()
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            async with asyncio.timeout(20):
                async for _ in service.responses(request):
                    pass
        assert failed.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert time.monotonic() - started < 10 * REQUEST_TIMEOUT_S
    finally:
        await prefill.close()
        await decode.close()
