"""`Worker.Decode` on a decode worker: pull the prompt's KV from its prefill worker, then generate.

`Worker.DecodeStream` serves the same requests multiplexed on one stream from a proxy: each
started request runs as its own task, checked as a Decode call would be, and the stream sends
what all of them produced since its last message as one batch. A step's outputs go straight
into the batch as the engine hands them over (`AsyncLLMEngine.run`: no task switch per token),
so a batch holds the whole step: one gRPC message a step instead of one a token (gRPC's asyncio
API costs ~35-45 us of CPU a message on each side here: scripts/token_stream_cost.py).

The worker dials only the workers it may trust (`kv_sources.check_kv_peer`): its prefill
workers, and the peers a prompt's prefix may come from.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

import grpc

from kvservice.connector.base import REMOTE_ADDRESS, TRANSFER_TOKEN
from kvservice.connector.transfer_registry import TransferRegistry
from kvservice.core.outputs import KVTransferCounters
from kvservice.core.request import check_request_id
from kvservice.core.sampling_params import SamplingParams
from kvservice.engine.async_engine import AsyncLLMEngine
from kvservice.engine.engine import RequestOutput
from kvservice.loading.chat_template import Prompt
from kvservice.server.convert import prompt_from_proto, sampling_params_from_proto
from kvservice.server.errors import PeerNotAllowed, ShuttingDown, abort_with, message_for, status_for
from kvservice.server.generation import ResponseConverter, merge_chunk, stream_responses
from kvservice.server.kv_events import KVEventPublisher
from kvservice.server.kv_sources import check_kv_peer, prefix_source_params
from kvservice.server.metrics import ServerMetrics
from kvservice.server.worker_service import EngineWorkerService
from kvservice.v1 import kvservice_pb2 as pb

logger = logging.getLogger(__name__)


class DecodeWorkerService(EngineWorkerService):
    def __init__(
        self,
        engine: AsyncLLMEngine,
        metrics: ServerMetrics | None = None,
        kv_peers: frozenset[str] | None = None,
        kv_events: KVEventPublisher | None = None,
        kv_sending: KVTransferCounters | None = None,
        registry: TransferRegistry | None = None,
    ) -> None:
        """`kv_peers`: the prefill workers KV may be pulled from; None: any that a request names.
        `registry`, `kv_sending`: the prefixes it exports for other workers' pulls, and their counters."""
        super().__init__(engine, "decode", kv_events, kv_sending, registry)
        self.kv_peers = kv_peers
        self.metrics = metrics if metrics is not None else ServerMetrics("decode")
        self.is_draining = False
        self._outboxes: set[_Outbox] = set()  # one per open DecodeStream

    async def Decode(
        self, request: pb.DecodeRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        try:
            async for response in self._responses(request):
                yield response
        except Exception as e:
            await abort_with(context, e)

    async def DecodeStream(
        self, requests: AsyncIterator[pb.DecodeStreamRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.DecodeStreamBatch]:
        # At once, not with the first batch: the proxy writes its first start only after it,
        # so a worker without this RPC answers UNIMPLEMENTED before any write races that answer.
        await context.send_initial_metadata(())
        outbox = _Outbox()
        self._outboxes.add(outbox)
        running: dict[str, asyncio.Task[None]] = {}
        reader = asyncio.create_task(self._read_stream(requests, outbox, running))
        reader.add_done_callback(lambda _: outbox.wake())
        try:
            while True:
                if outbox.has_events:
                    yield outbox.take()
                elif reader.done() and not running:
                    reader.result()  # a broken request stream ends this one with its error
                    return
                elif self.is_draining and not running:
                    return  # what it started has ended; a start still in flight is refused
                else:
                    await outbox.changed.wait()
                    outbox.changed.clear()
        finally:
            self._outboxes.discard(outbox)
            reader.cancel()
            tasks = [reader, *running.values()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def allow_kv_peers(self, peers: frozenset[str]) -> None:
        """More workers this one may pull from (`--kv-peers -`: a later line of stdin)."""
        if self.kv_peers is not None:
            self.kv_peers = self.kv_peers | peers

    def drain(self) -> None:
        """Take no new requests on the open streams; each ends once its requests have."""
        self.is_draining = True
        for outbox in self._outboxes:
            outbox.wake()

    async def _read_stream(
        self, requests: AsyncIterator[pb.DecodeStreamRequest], outbox: _Outbox, running: dict[str, asyncio.Task[None]]
    ) -> None:
        async for message in requests:
            if message.WhichOneof("kind") == "cancel":
                task = running.get(message.cancel)
                if task is not None:
                    task.cancel()
                continue
            request_id = message.start.request.request_id
            if request_id in running:
                outbox.fail(request_id, ValueError(f"request_id {request_id[:64]!r} is already running on this stream"))
            elif self.is_draining:
                outbox.fail(request_id, ShuttingDown("the decode worker is shutting down; retry on another"))
            else:
                task = running[request_id] = asyncio.create_task(self._run_on_stream(message.start, outbox))
                task.add_done_callback(lambda _, rid=request_id: (running.pop(rid, None), outbox.wake()))

    async def _run_on_stream(self, request: pb.DecodeRequest, outbox: _Outbox) -> None:
        request_id = request.request.request_id
        try:
            check_request_id(request_id, "request.request_id")
            with self.metrics.track(request_id, logger) as tracker:
                prompt, params, kv_params = self._admit(request)
                convert = ResponseConverter()

                def on_output(out: RequestOutput) -> None:
                    response = convert(out)
                    tracker.on_tokens(len(response.token_ids))
                    outbox.add_response(request_id, response)

                await self.engine.run(prompt, params, on_output, request_id, kv_params)
        except Exception as e:
            outbox.fail(request_id, e)
        else:
            outbox.add(request_id, done=True)

    async def _responses(self, request: pb.DecodeRequest) -> AsyncIterator[pb.GenerateResponse]:
        """One request's responses, as Decode streams them; errors raise."""
        inner = request.request
        check_request_id(inner.request_id, "request.request_id")
        with self.metrics.track(inner.request_id, logger) as tracker:
            prompt, params, kv_params = self._admit(request)
            async for response in stream_responses(self.engine, prompt, params, inner.request_id, kv_params):
                tracker.on_tokens(len(response.token_ids))
                yield response

    def _admit(self, request: pb.DecodeRequest) -> tuple[Prompt, SamplingParams, dict[str, Any] | None]:
        """A request's prompt, sampling parameters and KV source, checked; ValueError (or
        PeerNotAllowed) names what is wrong."""
        inner = request.request
        prompt = prompt_from_proto(inner, self.engine.engine.max_model_len)
        params = sampling_params_from_proto(inner.sampling_params)
        kv_params = None
        if request.HasField("kv_transfer_params"):
            source = request.kv_transfer_params
            if not source.remote_address or not source.transfer_token:
                raise ValueError("kv_transfer_params: remote_address and transfer_token are required")
            check_kv_peer(source.remote_address, self.kv_peers)
            kv_params = {REMOTE_ADDRESS: source.remote_address, TRANSFER_TOKEN: source.transfer_token}
            logger.info("request_id=%s pulls its KV from %s", inner.request_id, source.remote_address)
        elif request.HasField("prefix_source"):
            try:
                kv_params = prefix_source_params(request.prefix_source, self.kv_peers)
            except PeerNotAllowed as e:  # an offer this worker may not take: it computes the prompt
                logger.warning("request_id=%s: not pulling its prefix: %s", inner.request_id, e)
        return prompt, params, kv_params


class _Outbox:
    """What a DecodeStream's requests produced since its last message. A sequence's chunks
    that pile up while the stream is behind (the proxy reads slower than the engine steps)
    become one event: fewer messages, and the proxy relays them in one."""

    def __init__(self) -> None:
        self.batch = pb.DecodeStreamBatch()  # events are built in it: one copy of each response
        # The batch's response of each (request, sequence), which a later chunk extends.
        self._responses: dict[tuple[str, int], pb.GenerateResponse] = {}
        self.changed = asyncio.Event()

    @property
    def has_events(self) -> bool:
        """Whether anything waits to be sent."""
        return len(self.batch.events) > 0

    def add_response(self, request_id: str, response: pb.GenerateResponse) -> None:
        """The request's next chunk: a new event, or appended to its sequence's waiting one."""
        key = (request_id, response.index)
        waiting = self._responses.get(key)
        if waiting is not None:
            merge_chunk(waiting, response)
        else:
            self._responses[key] = self.batch.events.add(request_id=request_id, response=response).response
        self.changed.set()

    def add(self, request_id: str, **kind: Any) -> None:
        """One event: `error=` or `done=True`."""
        self.batch.events.add(request_id=request_id, **kind)
        self.changed.set()

    def fail(self, request_id: str, error: Exception) -> None:
        """The request ends with the status a Decode call would have ended with."""
        self.add(request_id, error=pb.DecodeStreamError(code=status_for(error).value[0], message=message_for(error)))

    def wake(self) -> None:
        self.changed.set()

    def take(self) -> pb.DecodeStreamBatch:
        batch, self.batch = self.batch, pb.DecodeStreamBatch()
        self._responses = {}
        return batch
