"""The proxy's decode calls, multiplexed on one `Worker.DecodeStream` per decode worker.

A `Decode` call per request costs a gRPC message per token on both sides; on one stream a
decode worker sends one message per engine step for all the proxy's requests to it.
`DecodeStreams.open` returns a call that reads like a `Decode` call: its responses, then
the end, or an `AioRpcError` with the status `Decode` would have ended with, so the proxy
handles failures (migration included) the same for both.

- The stream opens with the first request and is shared by every request until it ends; the
  next request opens a new one. When it ends or breaks (the worker drained or died), every
  request still on it fails UNAVAILABLE (it may move to another worker), but for a refusal
  they share (UNAUTHENTICATED, PERMISSION_DENIED) and the proxy's own close (CANCELLED).
- A call past its deadline fails with DEADLINE_EXCEEDED and is cancelled on the worker, as
  a `Decode` call's timeout would.
- A worker that does not serve `DecodeStream` (UNIMPLEMENTED) gets `Decode` calls from then
  on; the requests waiting on that stream move to `Decode` calls, having received nothing.
  So does a request past `STREAM_MAX_REQUEST_BYTES`, alone.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Protocol

import grpc

from kvservice.server.generation import merge_chunk
from kvservice.v1 import kvservice_pb2 as pb
from kvservice.v1 import kvservice_pb2_grpc as pb_grpc

logger = logging.getLogger(__name__)

_CODES = {code.value[0]: code for code in grpc.StatusCode}
# A larger request gets a Decode call of its own: a message past the worker's receive limit
# (8 MiB) would end the stream, and fail every request on it.
STREAM_MAX_REQUEST_BYTES = 1 << 20
# A stream that fails with one of these failed for a reason its requests share; any other
# failure means the worker was lost to them (UNAVAILABLE: they may move to another).
_KEPT_CODES = frozenset({grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.CANCELLED})


def rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    """The error a failed call raises, as gRPC builds it."""
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


class DecodeCall(Protocol):
    """What the proxy needs of a decode call: its responses, and cancel."""

    def __aiter__(self) -> AsyncIterator[pb.GenerateResponse]: ...

    def cancel(self) -> bool: ...


class _Done:
    """The request's responses ended normally."""


class _Unsupported:
    """The worker does not serve DecodeStream: go on with a Decode call."""


class _PastDeadline:
    """The call's deadline passed (the request is cancelled on the worker)."""


_DONE, _UNSUPPORTED, _PAST_DEADLINE = _Done(), _Unsupported(), _PastDeadline()
_Item = pb.GenerateResponse | grpc.aio.AioRpcError | _Done | _Unsupported | _PastDeadline


class _Inbox:
    """One request's items from its stream, in order. A read takes, with the first chunk, the
    chunks of the same sequence queued right behind it (the client fell behind its worker):
    one message for all of them, so a busy proxy spends less per token as it falls behind,
    and never holds back a chunk it could relay now."""

    def __init__(self) -> None:
        self._items: collections.deque[_Item] = collections.deque()
        self._waiter: asyncio.Future[None] | None = None

    def put(self, item: _Item) -> None:
        self._items.append(item)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def get(self) -> _Item:
        while not self._items:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        item = self._items.popleft()
        if isinstance(item, pb.GenerateResponse):
            items = self._items
            while items and isinstance(items[0], pb.GenerateResponse) and items[0].index == item.index:
                merge_chunk(item, items.popleft())
        return item


class _Stream:
    """One open DecodeStream and the requests on it."""

    def __init__(self, call: grpc.aio.StreamStreamCall) -> None:
        self.call = call
        self.requests: dict[str, _Inbox] = {}
        self.outgoing: asyncio.Queue[pb.DecodeStreamRequest] = asyncio.Queue()
        self.is_ended = False
        self.tasks: list[asyncio.Task[None]] = []


class DecodeStreams:
    """The proxy's DecodeStream to one decode worker (opened on demand), and its requests."""

    def __init__(
        self, stub: pb_grpc.WorkerStub, metadata: tuple[tuple[str, str], ...] | None, address: str = ""
    ) -> None:
        self._stub, self._metadata, self.address = stub, metadata, address
        self._stream: _Stream | None = None
        self.is_supported: bool | None = None  # None until the worker has answered on a stream
        self.num_streams_opened = 0

    def open(self, request: pb.DecodeRequest, timeout: float | None) -> DecodeCall:
        """Start `request` on this worker; its responses arrive through the call returned."""
        if self.is_supported is False or request.ByteSize() > STREAM_MAX_REQUEST_BYTES:
            return self._stub.Decode(request, timeout=timeout, metadata=self._metadata)
        return _MuxedCall(self, request, timeout)

    async def close(self) -> None:
        """Cancel the open stream (its requests fail CANCELLED) and wait for its tasks."""
        stream, self._stream = self._stream, None
        if stream is not None:
            stream.call.cancel()
            for task in stream.tasks:
                task.cancel()
            await asyncio.gather(*stream.tasks, return_exceptions=True)

    # ------------------------------------------------------------ for _MuxedCall

    def _start(self, request: pb.DecodeRequest) -> tuple[_Stream, _Inbox]:
        stream = self._stream
        if stream is None or stream.is_ended:
            stream = self._stream = self._open_stream()
        request_id = request.request.request_id
        assert request_id not in stream.requests, f"request {request_id} is already on the stream"
        inbox = stream.requests[request_id] = _Inbox()
        stream.outgoing.put_nowait(pb.DecodeStreamRequest(start=request))
        return stream, inbox

    def _cancel(self, stream: _Stream, request_id: str) -> None:
        if stream.requests.pop(request_id, None) is not None and not stream.is_ended:
            stream.outgoing.put_nowait(pb.DecodeStreamRequest(cancel=request_id))

    def _open_stream(self) -> _Stream:
        stream = _Stream(self._stub.DecodeStream(metadata=self._metadata))
        self.num_streams_opened += 1
        stream.tasks = [
            asyncio.create_task(self._write(stream), name=f"decode stream writer {self.address}"),
            asyncio.create_task(self._read(stream), name=f"decode stream reader {self.address}"),
        ]
        return stream

    async def _write(self, stream: _Stream) -> None:
        with contextlib.suppress(grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError):
            # The worker sends its metadata as it takes the stream; a write racing a refusal
            # (UNIMPLEMENTED, UNAUTHENTICATED) would turn the call's status into INTERNAL.
            await stream.call.initial_metadata()
            while not stream.call.done():
                await stream.call.write(await stream.outgoing.get())
        # A failed write means the stream broke: its reader reports why.

    async def _read(self, stream: _Stream) -> None:
        ending: _Item = rpc_error(grpc.StatusCode.UNAVAILABLE, f"the decode stream to {self.address} ended")
        try:
            async for batch in stream.call:
                self.is_supported = True
                for event in batch.events:
                    _deliver(stream, event)
        except grpc.aio.AioRpcError as e:
            ending = self._ending(e)
        except asyncio.CancelledError:
            ending = rpc_error(grpc.StatusCode.CANCELLED, "the proxy closed the decode stream")
            raise
        finally:
            self._retire(stream, ending)

    def _ending(self, error: grpc.aio.AioRpcError) -> _Item:
        """What the requests on a stream that failed with `error` get."""
        if error.code() == grpc.StatusCode.UNIMPLEMENTED and self.is_supported is None:
            logger.info("decode worker %s does not serve DecodeStream: a Decode call per request", self.address)
            self.is_supported = False
            return _UNSUPPORTED
        if error.code() in _KEPT_CODES:
            return error
        # The requests lost their worker, whatever broke the stream (a write racing its end fails INTERNAL).
        return rpc_error(
            grpc.StatusCode.UNAVAILABLE,
            f"the decode stream to {self.address} broke: {error.code().name}: {error.details()}",
        )

    def _retire(self, stream: _Stream, ending: _Item) -> None:
        """Retire `stream`: stop its other task and its call, and end every request on it with `ending`."""
        stream.is_ended = True
        if self._stream is stream:
            self._stream = None
        for task in stream.tasks:
            if task is not asyncio.current_task():
                task.cancel()
        stream.call.cancel()
        requests, stream.requests = stream.requests, {}
        for inbox in requests.values():
            inbox.put(ending)


def _deliver(stream: _Stream, event: pb.DecodeStreamEvent) -> None:
    kind = event.WhichOneof("kind")
    if kind == "response":
        inbox = stream.requests.get(event.request_id)
        if inbox is not None:
            inbox.put(event.response)
        return
    inbox = stream.requests.pop(event.request_id, None)
    if inbox is None:
        return  # cancelled meanwhile
    if kind == "done":
        inbox.put(_DONE)
    else:
        code = _CODES.get(event.error.code, grpc.StatusCode.UNKNOWN)
        inbox.put(rpc_error(code, event.error.message))


class _MuxedCall:
    """One request on its worker's DecodeStream, read as a Decode call."""

    def __init__(self, streams: DecodeStreams, request: pb.DecodeRequest, timeout: float | None) -> None:
        self._streams, self._request = streams, request
        loop = asyncio.get_running_loop()
        self._deadline = loop.time() + timeout if timeout is not None else None
        self._stream, self._inbox = streams._start(request)
        # One timer for the call (a timeout around every read cost ~3 us a token).
        self._timer = loop.call_at(self._deadline, self._expire) if self._deadline is not None else None
        self._fallback: DecodeCall | None = None  # a Decode call, where the worker has no DecodeStream
        self._fallback_responses: AsyncIterator[pb.GenerateResponse] | None = None
        self._is_over = False

    def __aiter__(self) -> _MuxedCall:
        return self

    async def __anext__(self) -> pb.GenerateResponse:
        if self._fallback_responses is not None:
            return await self._fallback_responses.__anext__()
        if self._is_over:
            raise StopAsyncIteration
        item = await self._inbox.get()
        if isinstance(item, pb.GenerateResponse):
            return item
        self._end()
        if isinstance(item, _PastDeadline):
            raise rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
        if isinstance(item, _Unsupported):
            remaining = None if self._deadline is None else max(0.0, self._deadline - asyncio.get_running_loop().time())
            self._fallback = self._streams.open(self._request, remaining)
            self._fallback_responses = aiter(self._fallback)
            return await self._fallback_responses.__anext__()
        if isinstance(item, _Done):
            raise StopAsyncIteration
        raise item

    def cancel(self) -> bool:
        """Abort the request on the worker (once); False when it had already ended."""
        if self._fallback is not None:
            return self._fallback.cancel()
        if self._is_over:
            return False
        self._end()
        self._streams._cancel(self._stream, self._request.request.request_id)
        return True

    def _expire(self) -> None:
        """The deadline: abort the request on the worker; the next read raises DEADLINE_EXCEEDED."""
        self._streams._cancel(self._stream, self._request.request.request_id)
        self._inbox.put(_PAST_DEADLINE)

    def _end(self) -> None:
        self._is_over = True
        if self._timer is not None:
            self._timer.cancel()
