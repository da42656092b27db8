"""Async gRPC client for kvservice's client API (the proxy, or a colocated worker).

async with KVServiceClient("127.0.0.1:8000") as client:
    async for chunk in client.generate("Hello", max_tokens=16, temperature=0):
        print(chunk.text, end="")
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvservice.runtime.finish_reason import finish_reason_from_proto
from kvservice.v1 import kvservice_pb2 as pb
from kvservice.v1 import kvservice_pb2_grpc as pb_grpc


@dataclass(frozen=True, slots=True)
class GenerateChunk:
    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: str | None
    num_prompt_tokens: int


@dataclass(slots=True)
class Completion:
    request_id: str = ""
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    num_prompt_tokens: int = 0


_Result = TypeVar("_Result", GenerateChunk, Completion)


def _from_response(cls: type[_Result], response: pb.GenerateResponse | pb.CompleteResponse) -> _Result:
    """A streamed chunk or a whole completion: the same fields of the same message."""
    return cls(
        request_id=response.request_id,
        token_ids=list(response.token_ids),
        text=response.text,
        finish_reason=finish_reason_from_proto(response.finish_reason),
        num_prompt_tokens=response.num_prompt_tokens,
    )


# A prompt: text, token ids, or a conversation ({"role", "content"} messages) that the
# server renders with the model's chat template.
PromptInput = str | Sequence[int] | Sequence[Mapping[str, str]]


def build_request(
    prompt: PromptInput,
    *,
    max_tokens: int | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    seed: int | None = None,
    stop_token_ids: Sequence[int] = (),
    ignore_eos: bool = False,
    stop: str | Sequence[str] = (),
    request_id: str = "",
    logprobs: int | None = None,
    n: int | None = None,
) -> pb.GenerateRequest:
    """A GenerateRequest; parameters left as None stay unset (the server's defaults apply).
    `stop`: one stop string or several; the text returned ends before the first one.
    `logprobs`: each token's logprob and that many most likely tokens; `n`: sequences."""
    stop = [stop] if isinstance(stop, str) else list(stop)
    sp = pb.SamplingParams(stop_token_ids=list(stop_token_ids), ignore_eos=ignore_eos, stop=stop)
    if max_tokens is not None:
        sp.max_tokens = max_tokens
    if temperature is not None:
        sp.temperature = temperature
    if top_p is not None:
        sp.top_p = top_p
    if top_k is not None:
        sp.top_k = top_k
    if seed is not None:
        sp.seed = seed
    if logprobs is not None:
        sp.logprobs = logprobs
    if n is not None:
        sp.n = n
    request = pb.GenerateRequest(request_id=request_id, sampling_params=sp)
    if isinstance(prompt, str):
        request.text = prompt
    elif prompt and isinstance(prompt[0], Mapping):
        request.chat.messages.extend(pb.ChatMessage(role=m["role"], content=m["content"]) for m in prompt)  # type: ignore[index]
    else:
        request.token_ids.ids.extend(prompt)  # type: ignore[arg-type]
    return request


class KVServiceClient:
    def __init__(
        self,
        target: str,
        credentials: grpc.ChannelCredentials | None = None,
        bearer_token: str | None = None,
    ) -> None:
        options = [("grpc.max_receive_message_length", 64 << 20)]
        if credentials is not None:
            self.channel = grpc.aio.secure_channel(target, credentials, options=options)
        else:
            self.channel = grpc.aio.insecure_channel(target, options=options)
        self.target = target
        self._stub = pb_grpc.GenerationStub(self.channel)
        self._health = health_pb2_grpc.HealthStub(self.channel)
        self._metadata = (("authorization", f"Bearer {bearer_token}"),) if bearer_token else None

    async def __aenter__(self) -> KVServiceClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self.channel.close()

    async def generate(
        self, prompt: PromptInput, timeout: float | None = None, **params: object
    ) -> AsyncIterator[GenerateChunk]:
        """Stream chunks of tokens; the last one has `finish_reason`. Errors raise grpc.aio.AioRpcError."""
        call = self._stub.Generate(build_request(prompt, **params), timeout=timeout, metadata=self._metadata)  # type: ignore[arg-type]
        try:
            async for response in call:
                yield _from_response(GenerateChunk, response)
        finally:
            call.cancel()  # no-op once finished; aborts the request when the caller leaves early

    async def complete(self, prompt: PromptInput, timeout: float | None = None, **params: object) -> Completion:
        response = await self._stub.Complete(build_request(prompt, **params), timeout=timeout, metadata=self._metadata)  # type: ignore[arg-type]
        return _from_response(Completion, response)

    async def stats(self, timeout: float = 10.0) -> pb.StatsResponse:
        """Stats of a proxy or a colocated worker (Generation.Stats), or of a prefill or
        decode worker (Worker.Stats, which is all they serve)."""
        try:
            return await self._stub.Stats(pb.StatsRequest(), timeout=timeout, metadata=self._metadata)
        except grpc.aio.AioRpcError as e:
            if e.code() != grpc.StatusCode.UNIMPLEMENTED:
                raise
        return await pb_grpc.WorkerStub(self.channel).Stats(pb.StatsRequest(), timeout=timeout, metadata=self._metadata)

    async def health(self, service: str = "", timeout: float = 5.0) -> str:
        """The server's health status name (SERVING, NOT_SERVING, ...)."""
        reply = await self._health.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)

    async def wait_until_serving(self, timeout: float) -> None:
        """Block until health says SERVING; raise TimeoutError after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"{self.target} did not become SERVING within {timeout:.0f} s")
            try:
                # wait_for_ready blocks on the connection itself, not a sleep loop.
                reply = await self._health.Check(
                    health_pb2.HealthCheckRequest(service=""), timeout=min(remaining, 2.0), wait_for_ready=True
                )
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.aio.AioRpcError as e:
                if e.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    raise
            # Health says NOT_SERVING yet: the Watch stream tells us when it changes.
            await self._watch_until_serving(deadline)

    async def _watch_until_serving(self, deadline: float) -> None:
        call = self._health.Watch(
            health_pb2.HealthCheckRequest(service=""), timeout=max(0.1, deadline - time.monotonic())
        )
        try:
            async for reply in call:
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
        except grpc.aio.AioRpcError:
            return
        finally:
            call.cancel()
        await asyncio.sleep(0)
