"""One disaggregated attempt's two calls, sent at once: Prefill to P, a decode stream to D.

`PairCalls` opens both (sharing one random transfer token), waits for whichever answers first
(`first_token`), streams the decode worker's responses, and cleans up both and P's staged KV
(`close`). `after_first_token` drops from D's stream the first token the prefill already sent.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc

from kvservice.server.proxy.decode_stream import DecodeCall
from kvservice.server.proxy.worker_pool import WorkerHandle
from kvservice.v1 import kvservice_pb2 as pb

logger = logging.getLogger(__name__)

# Prefill errors that mean "the request itself is bad": the client gets them as they are.
CLIENT_ERRORS = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE}


@dataclass(slots=True)
class PairCalls:
    """The prefill call and the decode stream of one request, and the transfer between them."""

    inner: pb.GenerateRequest
    prefill_worker: WorkerHandle
    transfer_token: bytes
    prefill: asyncio.Future[pb.PrefillResponse]
    decode_call: DecodeCall
    decode_stream: AsyncIterator[pb.GenerateResponse]
    next_decode: asyncio.Future[pb.GenerateResponse | None]

    @classmethod
    def open(
        cls,
        prefill_worker: WorkerHandle,
        decode_worker: WorkerHandle,
        inner: pb.GenerateRequest,
        timeout: float,
        prefix_source: pb.PrefixSource | None = None,
    ) -> PairCalls:
        token = secrets.token_bytes(32)
        kv_params = pb.KVTransferParams(remote_address=prefill_worker.address, transfer_token=token)
        decode_call = decode_worker.decode_streams.open(
            pb.DecodeRequest(request=inner, kv_transfer_params=kv_params), timeout
        )
        prefill = asyncio.ensure_future(
            prefill_worker.stub.Prefill(
                pb.PrefillRequest(request=first_sequence(inner), transfer_token=token, prefix_source=prefix_source),
                timeout=timeout,
                metadata=prefill_worker.metadata,
            )
        )
        decode_stream = decode_call.__aiter__()
        # When the prefill worker is cut off, the decode worker's pull times out, it
        # recomputes, and its first token ends the wait before the Prefill's deadline.
        next_decode = asyncio.ensure_future(next_or_none(decode_stream))
        return cls(inner, prefill_worker, token, prefill, decode_call, decode_stream, next_decode)

    async def first_token(self) -> pb.PrefillResponse | None:
        """The prefill's answer, once either call has answered: None when the decode worker
        answered first (the prefill goes on) or the prefill failed (the decode worker's pull
        fails too, and it recomputes). A prefill refusing the request raises."""
        await asyncio.wait({self.prefill, self.next_decode}, return_when=asyncio.FIRST_COMPLETED)
        if not self.prefill.done() and asks_for_logprobs(self.inner):
            # Only the prefill reports the first token's and the prompt's logprobs: the
            # decode worker got its KV, so the prefill's answer is on its way.
            await asyncio.wait({self.prefill})
        if not self.prefill.done():
            # Left running (cancelled only if still pending when the request ends): cancelling
            # a prefill that is about to return would fail a transfer the decode worker holds.
            logger.info(
                "request %s: the decode worker answered before the prefill on %s",
                self.inner.request_id,
                self.prefill_worker.address,
            )
            return None
        try:
            return self.prefill.result()
        except grpc.aio.AioRpcError as e:
            if e.code() in CLIENT_ERRORS:
                raise
            logger.warning(
                "request %s: prefill on %s failed (%s); the decode worker recomputes",
                self.inner.request_id,
                self.prefill_worker.address,
                e.code().name,
            )
            return None

    @property
    def prefill_failed(self) -> grpc.aio.AioRpcError | None:
        """The prefill's error, once it has failed."""
        if not self.prefill.done() or self.prefill.cancelled():
            return None
        error = self.prefill.exception()
        return error if isinstance(error, grpc.aio.AioRpcError) else None

    async def decode_responses(self) -> AsyncIterator[pb.GenerateResponse]:
        """The decode worker's stream, from its first response on."""
        response = await self.next_decode
        while response is not None:
            yield response
            response = await next_or_none(self.decode_stream)

    async def close(self) -> None:
        """End both calls and free the transfer's staged KV on the prefill worker."""
        self.decode_call.cancel()
        if not self.next_decode.done():
            self.next_decode.cancel()
        with contextlib.suppress(asyncio.CancelledError, grpc.aio.AioRpcError):
            await self.next_decode
        if not self.prefill.done():
            self.prefill.cancel()
        with contextlib.suppress(asyncio.CancelledError, grpc.aio.AioRpcError):
            await self.prefill
        # Whatever the decode worker did (pulled, recomputed because its pull failed or never
        # started, or never got this far), nobody pulls this transfer now: free its staging
        # at once. After a completed pull it is already gone, and this is a no-op.
        with contextlib.suppress(grpc.aio.AioRpcError):
            await self.prefill_worker.stub.ReleaseKV(
                pb.ReleaseKVRequest(request_id=self.inner.request_id, transfer_token=self.transfer_token),
                timeout=2.0,
                metadata=self.prefill_worker.metadata,
            )


async def after_first_token(
    responses: AsyncIterator[pb.GenerateResponse], first: pb.PrefillResponse
) -> AsyncIterator[pb.GenerateResponse]:
    """The decode worker's stream once the prefill's first token went out: sequence 0's copy of
    that token is dropped, and when that token already ended sequence 0, the rest of its copy too."""
    is_first_ending = first.finish_reason != pb.FINISH_REASON_UNSPECIFIED
    skip_first = True
    async for response in responses:
        if response.index != 0:
            yield response
        elif is_first_ending:
            continue
        elif skip_first and response.token_ids:
            skip_first = False
            rest = without_first_token(response, first.text)
            if rest.token_ids or rest.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
                yield rest
        else:
            yield response


def first_response(request_id: str, first: pb.PrefillResponse) -> pb.GenerateResponse:
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


def without_first_token(response: pb.GenerateResponse, sent_text: str) -> pb.GenerateResponse:
    """The decode worker's first token is the prefill's, already sent with `sent_text`: drop
    it and that text. Text past it stays: what the decode worker released on finishing
    (held back in case it started a stop string), or the text of tokens after the first, which
    a chunk carries beside it when the stream fell behind (the decode worker merges them)."""
    rest = pb.GenerateResponse()
    rest.CopyFrom(response)
    # The first token's logprobs are there only where the decode worker computed that token (a
    # recompute); a pulled first token comes without, and the logprobs are the next tokens'.
    if rest.logprobs and len(rest.logprobs) == len(rest.token_ids):
        del rest.logprobs[0]
    del rest.token_ids[0]
    rest.ClearField("prompt_logprobs")  # the prefill's were sent
    rest.ClearField("prompt_token_ids")
    rest.ClearField("num_cached_tokens")
    if rest.text.startswith(sent_text):
        rest.text = rest.text[len(sent_text) :]
    elif not rest.token_ids:
        rest.text = ""  # not a continuation of what was sent: nothing is shown twice
    return rest


def num_sequences(request: pb.GenerateRequest) -> int:
    return request.sampling_params.n if request.sampling_params.HasField("n") else 1


def first_sequence(request: pb.GenerateRequest) -> pb.GenerateRequest:
    """What the prefill worker runs: sequence 0 alone (the decode worker samples the others'
    first tokens from the same prompt KV, so the KV travels once)."""
    if num_sequences(request) == 1:
        return request
    first = pb.GenerateRequest()
    first.CopyFrom(request)
    first.sampling_params.ClearField("n")
    return first


def asks_for_logprobs(request: pb.GenerateRequest) -> bool:
    sp = request.sampling_params
    return sp.HasField("logprobs") or sp.HasField("prompt_logprobs")


async def next_or_none(stream: AsyncIterator[pb.GenerateResponse]) -> pb.GenerateResponse | None:
    """The stream's next response, or None at its end."""
    try:
        return await stream.__anext__()
    except StopAsyncIteration:
        return None
