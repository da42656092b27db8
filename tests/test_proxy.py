"""The proxy in-process, in front of fake workers: deadlines, staging release, the HTTP front."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import grpc
import pytest
import pytest_asyncio
from conftest import serving_worker

from kvservice.server.metrics import start_http
from kvservice.server.openai_front import OpenAIFront
from kvservice.server.proxy.service import ProxyService
from kvservice.server.proxy.worker_pool import WorkerPool
from kvservice.v1 import kvservice_pb2 as pb
from kvservice.v1 import kvservice_pb2_grpc as pb_grpc

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(60)]

REQUEST_TIMEOUT_S = 1.0


class _SilentWorker(pb_grpc.WorkerServicer):
    """Healthy by its health check, but its Prefill, Decode and Stats never answer."""

    def __init__(self) -> None:
        self.stats_calls = asyncio.Queue[None]()  # one item per Stats call that arrived

    async def Prefill(self, request: pb.PrefillRequest, context: grpc.aio.ServicerContext) -> pb.PrefillResponse:
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    async def Decode(
        self, request: pb.DecodeRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        await asyncio.Event().wait()
        yield pb.GenerateResponse()

    async def Stats(self, request: pb.StatsRequest, context: grpc.aio.ServicerContext) -> pb.StatsResponse:
        self.stats_calls.put_nowait(None)
        await asyncio.Event().wait()
        raise AssertionError("unreachable")


class _Deadline:
    """The part of a servicer context the proxy's Stats reads: the caller's time left."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def time_remaining(self) -> float:
        return self.seconds


@pytest_asyncio.fixture
async def silent_worker() -> AsyncIterator[str]:
    async with serving_worker(_SilentWorker()) as address:
        yield address


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


async def test_stats_answer_within_the_callers_deadline_when_workers_do_not(silent_worker: str) -> None:
    """A worker whose Stats hangs, and one dropped (its channel closed) while the proxy
    gathers: the proxy still answers in time, listing both without their stats."""
    prefill, decode = WorkerPool([silent_worker]), WorkerPool([silent_worker, silent_worker])
    try:
        await asyncio.gather(prefill.check_all(5.0), decode.check_all(5.0))
        await decode.workers[1].channel.close()
        service = ProxyService(prefill, decode, request_timeout=REQUEST_TIMEOUT_S)
        started = time.monotonic()
        stats = await service.Stats(pb.StatsRequest(), _Deadline(2.0))  # type: ignore[arg-type]
        assert time.monotonic() - started < 2.0
        assert [w.role for w in stats.workers] == ["prefill", "decode", "decode"]
        assert all(w.address == silent_worker and not w.HasField("stats") for w in stats.workers)
    finally:
        await prefill.close()
        await decode.close()


@contextlib.asynccontextmanager
async def _stats_in_flight(
    caller_deadline_s: float,
) -> AsyncIterator[tuple[asyncio.Future[pb.StatsResponse], WorkerPool, str]]:
    """The proxy's Stats over one silent decode worker, once the worker has its Stats call:
    (the proxy's Stats, still running; the decode pool; the worker's address)."""
    silent = _SilentWorker()
    async with serving_worker(silent) as address:
        prefill, decode = WorkerPool([]), WorkerPool([address])
        try:
            await decode.check_all(5.0)
            service = ProxyService(prefill, decode, request_timeout=REQUEST_TIMEOUT_S)
            gathering = asyncio.ensure_future(service.Stats(pb.StatsRequest(), _Deadline(caller_deadline_s)))  # type: ignore[arg-type]
            await asyncio.wait_for(silent.stats_calls.get(), 4.0)  # the worker's Stats call is in flight
            yield gathering, decode, address
        finally:
            await prefill.close()
            await decode.close()


async def test_stats_answer_when_a_worker_is_dropped_while_its_stats_call_runs() -> None:
    """Scale-down closes a leaving worker's channel whenever its last request ends, which may
    be while the proxy waits on that worker's Stats: gRPC then cancels the call, and the proxy
    must still answer (the cancelled call used to end the whole Stats, and the caller waited
    out its deadline)."""
    started = time.monotonic()
    async with _stats_in_flight(4.0) as (gathering, decode, address):
        await decode.workers[0].channel.close()
        stats = await asyncio.wait_for(gathering, 4.0)
    assert time.monotonic() - started < 4.0
    assert [(w.address, w.HasField("stats")) for w in stats.workers] == [(address, False)]


async def test_a_cancelled_stats_call_still_stops() -> None:
    """The other side of the case above: when the caller goes away, Stats stops at once."""
    async with _stats_in_flight(60.0) as (gathering, _, _):
        gathering.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(gathering, 4.0)


# ---------------------------------------------------------------- staging is always released


class _RecordingPrefill(pb_grpc.WorkerServicer):
    """A prefill worker that answers at once and records the ReleaseKVs it gets."""

    def __init__(self) -> None:
        self.released: list[pb.ReleaseKVRequest] = []
        self.tokens: list[bytes] = []

    async def Prefill(self, request: pb.PrefillRequest, context: grpc.aio.ServicerContext) -> pb.PrefillResponse:
        self.tokens.append(request.transfer_token)
        return pb.PrefillResponse(request_id=request.request.request_id, first_token_id=7, num_prompt_tokens=3)

    async def ReleaseKV(self, request: pb.ReleaseKVRequest, context: grpc.aio.ServicerContext) -> pb.ReleaseKVResponse:
        self.released.append(request)
        return pb.ReleaseKVResponse(was_staged=True)


class _RecomputingDecode(pb_grpc.WorkerServicer):
    """A decode worker that never pulls (as when it recomputed) and streams its tokens."""

    async def Decode(
        self, request: pb.DecodeRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        rid = request.request.request_id
        yield pb.GenerateResponse(request_id=rid, token_ids=[7], num_prompt_tokens=3)
        yield pb.GenerateResponse(
            request_id=rid, token_ids=[8], num_prompt_tokens=3, finish_reason=pb.FINISH_REASON_LENGTH
        )


async def test_staging_is_released_when_the_decode_worker_recomputed() -> None:
    prefill_worker = _RecordingPrefill()
    async with (
        serving_worker(prefill_worker) as prefill_address,
        serving_worker(_RecomputingDecode()) as decode_address,
    ):
        prefill, decode = WorkerPool([prefill_address]), WorkerPool([decode_address])
        try:
            await asyncio.gather(prefill.check_all(5.0), decode.check_all(5.0))
            service = ProxyService(prefill, decode)
            request = pb.GenerateRequest(request_id="r-1", token_ids=pb.TokenIds(ids=[1, 2, 3]))
            token_ids = [t async for response in service.responses(request) for t in response.token_ids]
        finally:
            await prefill.close()
            await decode.close()
    assert token_ids == [7, 8]
    assert [(r.request_id, r.transfer_token) for r in prefill_worker.released] == [("r-1", prefill_worker.tokens[0])]


# ---------------------------------------------------------------- the HTTP front


async def test_a_non_utf8_authorization_header_gets_401() -> None:
    front = OpenAIFront(ProxyService(WorkerPool([]), WorkerPool([])), "kvservice", lambda: True, auth_token="s3cret")
    runner, port = await start_http(front.app(), "127.0.0.1", 0)
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        body = b'{"prompt": [1], "max_tokens": 1}'
        writer.write(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer \xff\xfe\r\n"
            b"Content-Type: application/json\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
        )
        await writer.drain()
        status_line = await asyncio.wait_for(reader.readline(), 10)
        writer.close()
        await writer.wait_closed()
    finally:
        await runner.cleanup()
    assert status_line.split()[1] == b"401", status_line
