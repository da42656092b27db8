"""The proxy (router): the client API in front of prefill and decode workers.

For each request the router (`router.py`) picks a decode worker and, unless that one
prefills the prompt itself (conditional disaggregation), a prefill worker; the proxy
makes a random transfer token and sends the prefill request and the decode request at
the same time. The prefill's first token goes to the client at once; then the decode's
tokens follow (its own first token, the same one, is skipped). With no prefill worker
reachable, or when the prefill fails, the decode worker prefills the prompt itself:
degraded, never down.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import grpc

from kvservice.core.request import check_request_id
from kvservice.loading.tokenizer import Tokenizer
from kvservice.server.convert import check_prompt_length, check_stop_token_ids_count
from kvservice.server.errors import StreamLost
from kvservice.server.generation import StreamingGenerationService, new_request_id
from kvservice.server.metrics import ServerMetrics
from kvservice.server.proxy.pair_calls import PairCalls, after_first_token, first_response, num_sequences
from kvservice.server.proxy.peer_export import export_prefix
from kvservice.server.proxy.prompt_tokens import PromptTokens
from kvservice.server.proxy.router import Router
from kvservice.server.proxy.stats import cluster_stats
from kvservice.server.proxy.worker_pool import WorkerHandle, WorkerPool
from kvservice.v1 import kvservice_pb2 as pb

logger = logging.getLogger(__name__)

# Errors that suggest the worker is gone: stop routing to it until its health check passes.
_WORKER_DOWN = {grpc.StatusCode.UNAVAILABLE}
# Deadline of one request's calls to its workers (the whole decode stream included).
DEFAULT_REQUEST_TIMEOUT_S = 600.0
# Dynamo's default: one move to another decode worker per request.
DEFAULT_MIGRATION_LIMIT = 1
# The proxy does not know its workers' model: it refuses only prompts longer than any
# model's context, before copying them; each worker applies its model's own limit.
DEFAULT_MAX_MODEL_LEN = 1 << 20


class ProxyService(StreamingGenerationService):
    def __init__(
        self,
        prefill: WorkerPool,
        decode: WorkerPool,
        metrics: ServerMetrics | None = None,
        migration_limit: int = DEFAULT_MIGRATION_LIMIT,
        request_timeout: float = DEFAULT_REQUEST_TIMEOUT_S,
        max_model_len: int = DEFAULT_MAX_MODEL_LEN,
        router: Router | None = None,
        tokenizer: Tokenizer | None = None,
    ) -> None:
        """`router`: kv-aware over `prefill` and `decode` by default; `tokenizer`: the workers'
        (text and chat prompts are routed by cache only with it)."""
        if not request_timeout > 0:
            raise ValueError(f"request_timeout must be > 0, got {request_timeout}")
        self.request_timeout = request_timeout
        self.max_model_len = max_model_len
        self.prefill = prefill
        self.decode = decode
        if migration_limit < 0:
            raise ValueError(f"migration_limit must be >= 0, got {migration_limit}")
        # How many times one request may move to another decode worker when its own is lost.
        self.migration_limit = migration_limit
        self.metrics = metrics if metrics is not None else ServerMetrics("proxy")
        self.router = router if router is not None else Router(prefill, decode)
        self.prompt_tokens = PromptTokens(tokenizer, max_model_len)
        self._num_in_flight = 0
        self._idle = asyncio.Event()  # set while no client request is in flight
        self._idle.set()

    async def wait_until_idle(self, deadline: float) -> None:
        """Return once no client request is in flight: the drain waits for this before it
        stops the gRPC server (whose own grace was seen to end with streams still open, under
        load, cancelling them). New requests may still arrive meanwhile, and are served."""
        await self._idle.wait()

    async def responses(self, request: pb.GenerateRequest) -> AsyncIterator[pb.GenerateResponse]:
        """The routing path of `Generate`, also used by the OpenAI-compatible HTTP front.

        Errors raise (map them with `errors.status_for`); closing the iterator early
        cancels the request on its workers."""
        check_prompt_length(request, self.max_model_len)
        check_stop_token_ids_count(request.sampling_params)
        if request.request_id:
            check_request_id(request.request_id)
        inner = pb.GenerateRequest()
        inner.CopyFrom(request)
        if not inner.request_id:
            inner.request_id = new_request_id()
        self._num_in_flight += 1
        self._idle.clear()
        try:
            async for response in self._tracked_responses(request, inner):
                yield response
        finally:
            self._num_in_flight -= 1
            if self._num_in_flight == 0:
                self._idle.set()

    async def _tracked_responses(
        self, request: pb.GenerateRequest, inner: pb.GenerateRequest
    ) -> AsyncIterator[pb.GenerateResponse]:
        with self.metrics.track(inner.request_id, logger) as tracker:
            if request.WhichOneof("prompt") is None:
                raise ValueError("prompt: set one of text, token_ids or chat")
            token_ids = self.prompt_tokens.token_ids(inner) if self.router.needs_kv_events else None
            streamed: list[int] = []  # tokens the client has
            failed_decoders: set[str] = set()
            attempt = inner
            while True:
                try:
                    async for response in self._route(attempt, token_ids, failed_decoders):
                        tracker.on_tokens(len(response.token_ids))
                        streamed.extend(response.token_ids)
                        yield response
                    return
                except DecodeWorkerLost as lost:
                    num_migrations = len(failed_decoders)
                    if num_migrations >= self.migration_limit or num_sequences(inner) > 1:
                        why = (
                            f"--migration-limit {self.migration_limit} allows no further migration"
                            if num_migrations >= self.migration_limit
                            else "a request with n > 1 does not migrate"
                        )
                        raise StreamLost(
                            f"decode worker {lost.address} was lost after {len(streamed)} tokens "
                            f"({lost.error.code().name}: {lost.error.details()}); {why}"
                        ) from None
                    failed_decoders.add(lost.address)
                    attempt = _resumed(inner, streamed)
                    logger.warning(
                        "request_id=%s: decode worker %s lost after %d tokens; migrating (%d of at most %d)",
                        inner.request_id,
                        lost.address,
                        len(streamed),
                        num_migrations + 1,
                        self.migration_limit,
                    )

    async def _route(
        self, inner: pb.GenerateRequest, token_ids: list[int] | None, failed_decoders: set[str]
    ) -> AsyncIterator[pb.GenerateResponse]:
        """One attempt: pick the workers and stream. A migrated attempt has no KV source: its
        decode worker prefills the prompt and the resumed tokens itself (from its prefix cache
        where it has them); the first attempt's transfer went to the lost worker."""
        route = self.router.route(token_ids, exclude_decode=failed_decoders, use_prefill=not failed_decoders)
        decode_worker, prefill_worker = route.decode, route.prefill
        logger.info(
            "request_id=%s routed: prefill=%s decode=%s (uncached there: %s tokens)",
            inner.request_id,
            prefill_worker.address if prefill_worker is not None else "none",
            decode_worker.address,
            route.num_uncached_tokens if route.num_uncached_tokens is not None else "?",
        )
        export = None
        if route.prefix_source is not None and token_ids is not None:
            export = await export_prefix(route.prefix_source, inner.request_id, token_ids)
        prefix_source = export.prefix_source if export is not None else None
        try:
            with self.decode.using(decode_worker):
                if prefill_worker is None:
                    async for response in self._decode_only(decode_worker, inner, prefix_source):
                        yield response
                    return
                with self.prefill.using(prefill_worker):
                    async for response in self._disaggregated(prefill_worker, decode_worker, inner, prefix_source):
                        yield response
        finally:
            if export is not None:
                await export.release()

    async def _decode_only(
        self, decode_worker: WorkerHandle, inner: pb.GenerateRequest, prefix_source: pb.PrefixSource | None
    ) -> AsyncIterator[pb.GenerateResponse]:
        request = pb.DecodeRequest(request=inner, prefix_source=prefix_source)
        call = decode_worker.decode_streams.open(request, self.request_timeout)
        try:
            async for response in self._counted_on_first_token(call.__aiter__(), "decode_worker"):
                yield response
        except grpc.aio.AioRpcError as e:
            raise self._decode_error(decode_worker, e) from None
        finally:
            call.cancel()

    def _count_prefilled(self, where: str) -> None:
        """One request's prompt was prefilled `where` (counted once its first token is out)."""
        assert self.metrics.requests_prefilled is not None
        self.metrics.requests_prefilled.labels(where).inc()

    async def _disaggregated(
        self,
        prefill_worker: WorkerHandle,
        decode_worker: WorkerHandle,
        inner: pb.GenerateRequest,
        prefix_source: pb.PrefixSource | None,
    ) -> AsyncIterator[pb.GenerateResponse]:
        """Prefill on P and decode on D at once: P's first token goes out as soon as it comes,
        then D's stream without its own copy of that token. `prefix_source`: a peer staged the
        prompt's prefix for P to pull."""
        calls = PairCalls.open(prefill_worker, decode_worker, inner, self.request_timeout, prefix_source)
        try:
            first = await calls.first_token()
            if (error := calls.prefill_failed) is not None:
                self._note_failure(self.prefill, prefill_worker, error)
            responses = calls.decode_responses()
            if first is not None:
                self._count_prefilled("prefill_worker")
                yield first_response(inner.request_id, first)
                if first.finish_reason != pb.FINISH_REASON_UNSPECIFIED and num_sequences(inner) == 1:
                    return
                responses = after_first_token(responses, first)
            else:
                # A prefill still running counts as its own (the decode worker answered first,
                # normally with the pulled KV); a failed one leaves the prompt to the decode worker.
                where = "decode_worker" if calls.prefill.done() else "prefill_worker"
                responses = self._counted_on_first_token(responses, where)
            try:
                async for response in responses:
                    yield response
            except grpc.aio.AioRpcError as e:
                raise self._decode_error(decode_worker, e) from None
        finally:
            await calls.close()

    async def _counted_on_first_token(
        self, responses: AsyncIterator[pb.GenerateResponse], where: str
    ) -> AsyncIterator[pb.GenerateResponse]:
        """`responses`, counting the prompt as prefilled `where` once its first token is out
        (a request the workers refuse is no prefill)."""
        is_counted = False
        async for response in responses:
            if not is_counted and response.token_ids:
                self._count_prefilled(where)
                is_counted = True
            yield response

    def _decode_error(self, worker: WorkerHandle, error: grpc.aio.AioRpcError) -> Exception:
        """What a failed decode stream raises: DecodeWorkerLost when the worker is gone
        (a retry may follow), the status itself otherwise."""
        self._note_failure(self.decode, worker, error)
        return DecodeWorkerLost(worker.address, error) if error.code() in _WORKER_DOWN else error

    def _note_failure(self, pool: WorkerPool, worker: WorkerHandle, error: grpc.aio.AioRpcError) -> None:
        if error.code() in _WORKER_DOWN:
            pool.mark_unhealthy(worker, f"{error.code().name}: {error.details()}")

    async def Stats(self, request: pb.StatsRequest, context: grpc.aio.ServicerContext) -> pb.StatsResponse:
        return await cluster_stats(self.prefill, self.decode, context.time_remaining())


class DecodeWorkerLost(Exception):
    """The decode worker of an attempt went away (UNAVAILABLE) mid-request."""

    def __init__(self, address: str, error: grpc.aio.AioRpcError) -> None:
        super().__init__(f"decode worker {address} lost: {error.code().name}")
        self.address = address
        self.error = error


def _resumed(request: pb.GenerateRequest, streamed: list[int]) -> pb.GenerateRequest:
    """The request to send a new decode worker: the same prompt, resumed after `streamed`."""
    resumed = pb.GenerateRequest()
    resumed.CopyFrom(request)
    resumed.resume_token_ids.extend(streamed)
    return resumed
