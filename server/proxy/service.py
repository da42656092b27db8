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
import contextlib
import logging
import secrets
from collections.abc import AsyncIterator

import grpc

from kvservice.core.request import check_request_id
from kvservice.loading.tokenizer import Tokenizer
from kvservice.server.convert import check_prompt_length, check_stop_token_ids_count
from kvservice.server.errors import StreamLost
from kvservice.server.generation import StreamingGenerationService, new_request_id
from kvservice.server.metrics import ServerMetrics
from kvservice.server.proxy.prompt_tokens import PromptTokens
from kvservice.server.proxy.router import Router
from kvservice.server.proxy.stats import cluster_stats
from kvservice.server.proxy.worker_pool import WorkerHandle, WorkerPool
from kvservice.v1 import kvservice_pb2 as pb

logger = logging.getLogger(__name__)

# Prefill errors that mean "the request itself is bad": the client gets them as they are.
_CLIENT_ERRORS = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE}
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
                    if num_migrations >= self.migration_limit or _num_sequences(inner) > 1:
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
        with self.decode.using(decode_worker):
            if prefill_worker is None:
                async for response in self._decode_only(decode_worker, inner):
                    yield response
                return
            with self.prefill.using(prefill_worker):
                async for response in self._disaggregated(prefill_worker, decode_worker, inner):
                    yield response

    async def _decode_only(
        self, decode_worker: WorkerHandle, inner: pb.GenerateRequest
    ) -> AsyncIterator[pb.GenerateResponse]:
        call = decode_worker.decode_streams.open(pb.DecodeRequest(request=inner), self.request_timeout)
        try:
            is_counted = False
            async for response in call:
                if not is_counted and response.token_ids:
                    self._count_prefilled("decode_worker")
                    is_counted = True
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
        self, prefill_worker: WorkerHandle, decode_worker: WorkerHandle, inner: pb.GenerateRequest
    ) -> AsyncIterator[pb.GenerateResponse]:
        token = secrets.token_bytes(32)
        decode_call = decode_worker.decode_streams.open(
            pb.DecodeRequest(
                request=inner,
                kv_transfer_params=pb.KVTransferParams(remote_address=prefill_worker.address, transfer_token=token),
            ),
            self.request_timeout,
        )
        prefill = asyncio.ensure_future(
            prefill_worker.stub.Prefill(
                pb.PrefillRequest(request=_first_sequence(inner), transfer_token=token),
                timeout=self.request_timeout,
                metadata=prefill_worker.metadata,
            )
        )
        decode_stream = decode_call.__aiter__()
        # When the prefill worker is cut off, the decode worker's pull times out, it
        # recomputes, and its first token ends the wait before the Prefill's deadline.
        next_decode = asyncio.ensure_future(_next_or_none(decode_stream))
        try:
            first: pb.PrefillResponse | None = None
            await asyncio.wait({prefill, next_decode}, return_when=asyncio.FIRST_COMPLETED)
            if not prefill.done() and _asks_for_logprobs(inner):
                # Only the prefill reports the first token's and the prompt's logprobs: the
                # decode worker got its KV, so the prefill's answer is on its way.
                await asyncio.wait({prefill})
            if not prefill.done():
                # Left running (cancelled only if still pending when the request ends): cancelling
                # a prefill that is about to return would fail a transfer the decode worker holds.
                logger.info(
                    "request %s: the decode worker answered before the prefill on %s",
                    inner.request_id,
                    prefill_worker.address,
                )
            else:
                try:
                    first = prefill.result()
                except grpc.aio.AioRpcError as e:
                    if e.code() in _CLIENT_ERRORS:
                        raise
                    # The decode worker's pull fails too, and it recomputes: keep streaming from it.
                    self._note_failure(self.prefill, prefill_worker, e)
                    logger.warning(
                        "request %s: prefill on %s failed (%s); the decode worker recomputes",
                        inner.request_id,
                        prefill_worker.address,
                        e.code().name,
                    )
            # A prefill still running counts as its own: the decode worker answered first, normally with
            # the pulled KV. Counted with the first token out (a request the workers refuse is no prefill).
            where: str | None = "prefill_worker" if first is not None or not prefill.done() else "decode_worker"
            # Sequence 0's first token is the prefill's: the decode worker's copy is dropped,
            # and when that token already ended sequence 0, the rest of its copy too.
            is_first_ending = first is not None and first.finish_reason != pb.FINISH_REASON_UNSPECIFIED
            if first is not None:
                self._count_prefilled("prefill_worker")
                where = None
                yield _first_response(inner.request_id, first)
                if is_first_ending and _num_sequences(inner) == 1:
                    return
            skip_first = first is not None
            try:
                response = await next_decode
                while response is not None:
                    if where is not None and response.token_ids:
                        self._count_prefilled(where)
                        where = None
                    if response.index == 0 and is_first_ending:
                        pass
                    elif skip_first and response.index == 0 and response.token_ids:
                        skip_first = False
                        response = _without_first_token(response, first.text if first is not None else "")
                        if response.token_ids or response.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
                            yield response
                    else:
                        yield response
                    response = await _next_or_none(decode_stream)
            except grpc.aio.AioRpcError as e:
                raise self._decode_error(decode_worker, e) from None
        finally:
            decode_call.cancel()
            if not next_decode.done():
                next_decode.cancel()
            with contextlib.suppress(asyncio.CancelledError, grpc.aio.AioRpcError):
                await next_decode
            if not prefill.done():
                prefill.cancel()
            with contextlib.suppress(asyncio.CancelledError, grpc.aio.AioRpcError):
                await prefill
            # Whatever the decode worker did (pulled, recomputed because its pull failed or never
            # started, or never got this far), nobody pulls this transfer now: free its staging
            # at once. After a completed pull it is already gone, and this is a no-op.
            with contextlib.suppress(grpc.aio.AioRpcError):
                await prefill_worker.stub.ReleaseKV(
                    pb.ReleaseKVRequest(request_id=inner.request_id, transfer_token=token),
                    timeout=2.0,
                    metadata=prefill_worker.metadata,
                )

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


async def _next_or_none(stream: AsyncIterator[pb.GenerateResponse]) -> pb.GenerateResponse | None:
    """The stream's next response, or None at its end."""
    try:
        return await stream.__anext__()
    except StopAsyncIteration:
        return None


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


def _without_first_token(response: pb.GenerateResponse, sent_text: str) -> pb.GenerateResponse:
    """The decode worker's first token is the prefill's, already sent with `sent_text`: drop
    it and that text. Text past it stays: what the decode worker released on finishing
    (held back in case it started a stop string), or the text of tokens after the first."""
    rest = pb.GenerateResponse()
    rest.CopyFrom(response)
    del rest.token_ids[0]
    if rest.logprobs:
        del rest.logprobs[0]
    rest.ClearField("prompt_logprobs")  # the prefill's were sent
    rest.ClearField("prompt_token_ids")
    rest.ClearField("num_cached_tokens")
    if not rest.token_ids:
        rest.text = rest.text[len(sent_text) :] if rest.text.startswith(sent_text) else ""
    return rest


def _num_sequences(request: pb.GenerateRequest) -> int:
    return request.sampling_params.n if request.sampling_params.HasField("n") else 1


def _first_sequence(request: pb.GenerateRequest) -> pb.GenerateRequest:
    """What the prefill worker runs: sequence 0 alone (the decode worker samples the others'
    first tokens from the same prompt KV, so the KV travels once)."""
    if _num_sequences(request) == 1:
        return request
    first = pb.GenerateRequest()
    first.CopyFrom(request)
    first.sampling_params.ClearField("n")
    return first


def _asks_for_logprobs(request: pb.GenerateRequest) -> bool:
    sp = request.sampling_params
    return sp.HasField("logprobs") or sp.HasField("prompt_logprobs")


def _first_response(request_id: str, first: pb.PrefillResponse) -> pb.GenerateResponse:
    """The prefill's first token as the stream's first chunk, with what the prompt gave."""
    response = pb.GenerateResponse(
        request_id=request_id,
        token_ids=[first.first_token_id],
        text=first.text,
        finish_reason=first.finish_reason,
        num_prompt_tokens=first.num_prompt_tokens,
        prompt_logprobs=first.prompt_logprobs,
        num_cached_tokens=first.num_cached_tokens,
        prompt_token_ids=first.prompt_token_ids,
    )
    if first.HasField("first_token_logprobs"):
        response.logprobs.append(first.first_token_logprobs)
    return response
