"""`Worker.DecodeStream`: many requests on one stream from the proxy to a decode worker.

The decode worker's side (`DecodeWorkerService.DecodeStream`) over a tiny engine, and the
proxy's (`DecodeStreams`), which must read like a `Decode` call per request: the same
tokens, the same statuses, deadlines and cancellation, and `Decode` calls for a worker
without the stream.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import grpc
import pytest
import pytest_asyncio
from conftest import serving_worker, tiny_greedy, wait_for

from kvservice.config import EngineConfig
from kvservice.engine.async_engine import AsyncLLMEngine
from kvservice.engine.engine_builder import build_engine
from kvservice.server.decode_service import DecodeWorkerService, _Outbox
from kvservice.server.proxy import decode_stream
from kvservice.server.proxy.decode_stream import DecodeStreams
from kvservice.v1 import kvservice_pb2 as pb
from kvservice.v1 import kvservice_pb2_grpc as pb_grpc

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(60)]

CONFIG = EngineConfig(block_size=8, num_blocks=1024, max_model_len=4096)
LONG = 4000  # tokens: seconds of decoding, longer than any wait in these tests
PROMPTS = [[1, 2, 3, 4, 5], [9, 8, 7], [4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4]]


def _request(request_id: str, prompt: list[int], max_tokens: int) -> pb.DecodeRequest:
    params = pb.SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    return pb.DecodeRequest(
        request=pb.GenerateRequest(request_id=request_id, token_ids=pb.TokenIds(ids=prompt), sampling_params=params)
    )


@pytest_asyncio.fixture
async def decode_worker() -> AsyncIterator[tuple[DecodeWorkerService, pb_grpc.WorkerStub]]:
    """A decode worker's service on a tiny engine, and a stub to it."""
    engine = AsyncLLMEngine(build_engine("tiny", CONFIG))
    engine.start()
    service = DecodeWorkerService(engine)
    try:
        async with serving_worker(service) as address, grpc.aio.insecure_channel(address) as channel:
            yield service, pb_grpc.WorkerStub(channel)
    finally:
        await engine.stop()


async def _has_no_requests(service: DecodeWorkerService) -> bool | None:
    """True once the engine holds no request (for wait_for: None until then)."""
    stats = await service.engine.call(lambda engine: engine.core.scheduler.make_stats())
    return stats.num_running_requests + stats.num_waiting_requests == 0 or None


class _Events:
    """A DecodeStream's events by request, and how many messages carried them."""

    def __init__(self) -> None:
        self.tokens: dict[str, list[int]] = {}
        self.ends: dict[str, str | pb.DecodeStreamError] = {}
        self.num_batches = 0
        self.num_responses = 0

    def add(self, batch: pb.DecodeStreamBatch) -> None:
        self.num_batches += 1
        for event in batch.events:
            kind = event.WhichOneof("kind")
            if kind == "response":
                self.num_responses += 1
                self.tokens.setdefault(event.request_id, []).extend(event.response.token_ids)
            else:
                self.ends[event.request_id] = "done" if kind == "done" else event.error


# ---------------------------------------------------------------- the decode worker's side


async def test_requests_on_one_stream_get_their_greedy_tokens_batched_per_step(
    decode_worker: tuple[DecodeWorkerService, pb_grpc.WorkerStub],
) -> None:
    _, stub = decode_worker
    requests = [pb.DecodeStreamRequest(start=_request(f"r{i}", p, 12)) for i, p in enumerate(PROMPTS)]
    events = _Events()
    async for batch in stub.DecodeStream(iter(requests), timeout=30):
        events.add(batch)
    assert events.ends == {"r0": "done", "r1": "done", "r2": "done"}
    assert [events.tokens[f"r{i}"] for i in range(3)] == tiny_greedy(PROMPTS, 12)
    # The three decode together: a message carries a step's tokens of all of them.
    assert events.num_batches < events.num_responses, (events.num_batches, events.num_responses)


async def test_a_cancelled_request_stops_and_the_others_go_on(
    decode_worker: tuple[DecodeWorkerService, pb_grpc.WorkerStub],
) -> None:
    service, stub = decode_worker
    outgoing: asyncio.Queue[pb.DecodeStreamRequest | None] = asyncio.Queue()

    async def requests() -> AsyncIterator[pb.DecodeStreamRequest]:
        while (message := await outgoing.get()) is not None:
            yield message

    outgoing.put_nowait(pb.DecodeStreamRequest(start=_request("long", PROMPTS[0], LONG)))
    outgoing.put_nowait(pb.DecodeStreamRequest(start=_request("short", PROMPTS[1], 30)))
    events = _Events()
    num_long_at_cancel: int | None = None
    async for batch in stub.DecodeStream(requests(), timeout=30):
        events.add(batch)
        if num_long_at_cancel is None and events.tokens.get("long"):
            num_long_at_cancel = len(events.tokens["long"])
            outgoing.put_nowait(pb.DecodeStreamRequest(cancel="long"))
        if "short" in events.ends:
            outgoing.put_nowait(None)  # half-close: the stream ends with its last request
    assert events.ends == {"short": "done"}  # a cancelled request ends without an event
    assert events.tokens["short"] == tiny_greedy([PROMPTS[1]], 30)[0]
    assert num_long_at_cancel is not None
    assert len(events.tokens["long"]) <= num_long_at_cancel + 30 < LONG  # it stopped within the short one's life
    await wait_for(lambda: _has_no_requests(service), "the engine to drop the cancelled request")


async def test_a_bad_request_fails_alone_with_decodes_status(
    decode_worker: tuple[DecodeWorkerService, pb_grpc.WorkerStub],
) -> None:
    _, stub = decode_worker
    bad = _request("bad", PROMPTS[0], 4)
    bad.kv_transfer_params.remote_address = "unix:/tmp/x"  # not HOST:PORT: refused as Decode refuses it
    bad.kv_transfer_params.transfer_token = b"t"
    requests = [pb.DecodeStreamRequest(start=bad), pb.DecodeStreamRequest(start=_request("good", PROMPTS[1], 4))]
    events = _Events()
    async for batch in stub.DecodeStream(iter(requests), timeout=30):
        events.add(batch)
    error = events.ends["bad"]
    assert isinstance(error, pb.DecodeStreamError)
    assert error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "remote_address" in error.message
    assert events.ends["good"] == "done"
    assert events.tokens["good"] == tiny_greedy([PROMPTS[1]], 4)[0]


async def test_a_draining_worker_finishes_its_requests_refuses_new_ones_and_ends_the_stream(
    decode_worker: tuple[DecodeWorkerService, pb_grpc.WorkerStub],
) -> None:
    service, stub = decode_worker
    outgoing: asyncio.Queue[pb.DecodeStreamRequest] = asyncio.Queue()

    async def requests() -> AsyncIterator[pb.DecodeStreamRequest]:
        while True:  # never half-closes: only the drain ends the stream
            yield await outgoing.get()

    outgoing.put_nowait(pb.DecodeStreamRequest(start=_request("first", PROMPTS[0], 40)))
    events = _Events()
    async with asyncio.timeout(30):
        async for batch in stub.DecodeStream(requests()):
            events.add(batch)
            if events.tokens.get("first") and not service.is_draining:
                service.drain()
                outgoing.put_nowait(pb.DecodeStreamRequest(start=_request("late", PROMPTS[1], 4)))
    assert events.ends["first"] == "done"
    assert events.tokens["first"] == tiny_greedy([PROMPTS[0]], 40)[0]
    late = events.ends.get("late")
    # The late start either reached the worker while it drained (refused as a Decode call
    # would be), or the stream ended first; never served.
    assert "late" not in events.tokens
    if late is not None:
        assert isinstance(late, pb.DecodeStreamError)
        assert late.code == grpc.StatusCode.UNAVAILABLE.value[0]


# ---------------------------------------------------------------- the proxy's side


@contextlib.asynccontextmanager
async def _proxy_streams(stub: pb_grpc.WorkerStub, address: str) -> AsyncIterator[DecodeStreams]:
    """The proxy's DecodeStreams to `stub`'s worker, closed after the test."""
    streams = DecodeStreams(stub, None, address)
    try:
        yield streams
    finally:
        await streams.close()


async def _tokens(call: AsyncIterator[pb.GenerateResponse]) -> list[int]:
    return [t async for response in call for t in response.token_ids]


async def test_the_proxys_calls_share_one_stream_and_get_their_tokens(
    decode_worker: tuple[DecodeWorkerService, pb_grpc.WorkerStub],
) -> None:
    _, stub = decode_worker
    async with _proxy_streams(stub, "decode") as streams:
        calls = [streams.open(_request(f"r{i}", p, 10), 30.0) for i, p in enumerate(PROMPTS)]
        results = await asyncio.gather(*(_tokens(call) for call in calls))
        assert results == tiny_greedy(PROMPTS, 10)
        assert streams.num_streams_opened == 1
        assert streams.is_supported is True
        # A later request rides the same stream.
        assert await _tokens(streams.open(_request("later", PROMPTS[1], 3), 30.0)) == tiny_greedy([PROMPTS[1]], 3)[0]
        assert streams.num_streams_opened == 1


async def test_a_call_past_its_deadline_fails_and_is_cancelled_on_the_worker(
    decode_worker: tuple[DecodeWorkerService, pb_grpc.WorkerStub],
) -> None:
    service, stub = decode_worker
    async with _proxy_streams(stub, "decode") as streams:
        call = streams.open(_request("slow", PROMPTS[0], LONG), 0.05)
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            await _tokens(call)
        assert failed.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        await wait_for(lambda: _has_no_requests(service), "the worker to abort the request past its deadline")
        assert await _tokens(streams.open(_request("next", PROMPTS[1], 3), 30.0)) == tiny_greedy([PROMPTS[1]], 3)[0]


async def test_cancelling_a_call_aborts_its_request_on_the_worker(
    decode_worker: tuple[DecodeWorkerService, pb_grpc.WorkerStub],
) -> None:
    service, stub = decode_worker
    async with _proxy_streams(stub, "decode") as streams:
        call = streams.open(_request("left", PROMPTS[0], LONG), 30.0)
        first = await aiter(call).__anext__()
        assert first.token_ids
        assert call.cancel() is True
        assert call.cancel() is False
        await wait_for(lambda: _has_no_requests(service), "the worker to abort the cancelled request")


class _DecodeOnly(pb_grpc.WorkerServicer):
    """A decode worker from before DecodeStream: Decode calls only."""

    async def Decode(
        self, request: pb.DecodeRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        rid = request.request.request_id
        yield pb.GenerateResponse(request_id=rid, token_ids=[7])
        yield pb.GenerateResponse(request_id=rid, token_ids=[8], finish_reason=pb.FINISH_REASON_LENGTH)


async def test_a_worker_without_decode_stream_gets_decode_calls() -> None:
    async with serving_worker(_DecodeOnly()) as address, grpc.aio.insecure_channel(address) as channel:
        async with _proxy_streams(pb_grpc.WorkerStub(channel), address) as streams:
            first = [streams.open(_request(f"r{i}", [1, 2], 2), 10.0) for i in range(2)]  # both wait on the stream
            assert await asyncio.gather(*(_tokens(call) for call in first)) == [[7, 8], [7, 8]]
            assert streams.is_supported is False
            assert await _tokens(streams.open(_request("r2", [1, 2], 2), 10.0)) == [7, 8]
            assert streams.num_streams_opened == 1


class _Breaking(pb_grpc.WorkerServicer):
    """A decode worker whose streams answer one token of the first request, then die."""

    def __init__(self) -> None:
        self.num_streams = 0

    async def DecodeStream(
        self, requests: AsyncIterator[pb.DecodeStreamRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.DecodeStreamBatch]:
        self.num_streams += 1
        await context.send_initial_metadata(())  # as the protocol asks: the proxy writes after it
        first = await anext(aiter(requests))
        rid = first.start.request.request_id
        yield pb.DecodeStreamBatch(
            events=[pb.DecodeStreamEvent(request_id=rid, response=pb.GenerateResponse(request_id=rid, token_ids=[5]))]
        )
        await context.abort(grpc.StatusCode.UNAVAILABLE, "worker going away")


async def test_requests_on_a_broken_stream_fail_with_its_status_and_the_next_opens_another() -> None:
    worker = _Breaking()
    async with serving_worker(worker) as address, grpc.aio.insecure_channel(address) as channel:
        async with _proxy_streams(pb_grpc.WorkerStub(channel), address) as streams:
            for attempt in range(2):
                call = streams.open(_request(f"r{attempt}", [1, 2], 5), 10.0)
                received: list[int] = []
                with pytest.raises(grpc.aio.AioRpcError) as failed:
                    async for response in call:
                        received.extend(response.token_ids)
                assert received == [5]
                assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
            assert streams.num_streams_opened == worker.num_streams == 2


async def test_a_request_too_big_to_share_the_stream_gets_a_decode_call_of_its_own(
    decode_worker: tuple[DecodeWorkerService, pb_grpc.WorkerStub],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Past the worker's receive limit it fails alone, not with every request on the stream."""
    _, stub = decode_worker
    request = _request("big", PROMPTS[2], 3)
    monkeypatch.setattr(decode_stream, "STREAM_MAX_REQUEST_BYTES", request.ByteSize() - 1)
    async with _proxy_streams(stub, "decode") as streams:
        assert await _tokens(streams.open(request, 30.0)) == tiny_greedy([PROMPTS[2]], 3)[0]
        assert streams.num_streams_opened == 0
        assert await _tokens(streams.open(_request("small", PROMPTS[1], 3), 30.0)) == tiny_greedy([PROMPTS[1]], 3)[0]
        assert streams.num_streams_opened == 1


# ---------------------------------------------------------------- chunks a stream is behind on


def _chunk(tokens: list[int], text: str, index: int = 0, finish: int = 0) -> pb.GenerateResponse:
    return pb.GenerateResponse(request_id="r", token_ids=tokens, text=text, index=index, finish_reason=finish)


async def test_the_workers_outbox_joins_a_sequences_chunks_waiting_in_one_message() -> None:
    outbox = _Outbox()
    outbox.add_response("r0", _chunk([1], "a"))
    outbox.add_response("r1", _chunk([7], "x"))
    outbox.add_response("r0", _chunk([2], "b"))
    outbox.add_response("r0", _chunk([3], "c", index=1))  # another sequence: its own event
    outbox.add_response("r0", _chunk([4], "d", finish=pb.FINISH_REASON_LENGTH))
    outbox.add("r0", done=True)
    batch = outbox.take()
    kinds = [(e.request_id, e.WhichOneof("kind"), e.response.index) for e in batch.events]
    assert kinds == [("r0", "response", 0), ("r1", "response", 0), ("r0", "response", 1), ("r0", "done", 0)]
    first = batch.events[0].response
    assert (list(first.token_ids), first.text, first.finish_reason) == ([1, 2, 4], "abd", pb.FINISH_REASON_LENGTH)
    # The next message starts afresh: a chunk after it is not appended to one already sent.
    outbox.add_response("r0", _chunk([5], "e"))
    assert [list(e.response.token_ids) for e in outbox.take().events] == [[5]]


async def test_the_proxy_relays_the_chunks_queued_behind_a_read_in_one_response() -> None:
    inbox = decode_stream._Inbox()
    for tokens, text in (([1], "a"), ([2], "b")):
        inbox.put(_chunk(tokens, text))
    inbox.put(_chunk([9], "z", index=1))
    inbox.put(_chunk([3], "c"))
    inbox.put(decode_stream._DONE)
    got = [await inbox.get() for _ in range(4)]
    assert [(list(r.token_ids), r.text, r.index) for r in got[:3]] == [([1, 2], "ab", 0), ([9], "z", 1), ([3], "c", 0)]
    assert got[3] is decode_stream._DONE
    # A read waiting on an empty inbox gets the next chunk as soon as it comes.
    waiting = asyncio.ensure_future(inbox.get())
    await asyncio.sleep(0)
    assert not waiting.done()
    inbox.put(_chunk([4], "d"))
    assert list((await waiting).token_ids) == [4]
