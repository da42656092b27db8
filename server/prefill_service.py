"""`Worker.Prefill` on a prefill worker: register the transfer, run the prompt, return the first token.

The transfer is registered (with a staging reservation for all of the prompt's KV)
before the prompt is queued, so a decode worker's pull that arrives early waits for
it rather than failing. Whatever ends the prefill early fails the transfer, so a
waiting pull ends at once and the staging memory comes back.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any

import grpc

from kvservice.connector.base import TRANSFER_TOKEN
from kvservice.connector.transfer_registry import TransferRegistry
from kvservice.core.outputs import KVTransferCounters
from kvservice.core.request import check_request_id
from kvservice.core.sampling_params import SamplingParams
from kvservice.engine.async_engine import AsyncLLMEngine
from kvservice.engine.stop_checker import OutputText
from kvservice.loading.tokenizer import Tokenizer
from kvservice.runtime.finish_reason import finish_reason_to_proto
from kvservice.server.convert import logprobs_to_proto, prompt_from_proto, sampling_params_from_proto
from kvservice.server.errors import RequestFailed, ShuttingDown, abort_with
from kvservice.server.kv_events import KVEventPublisher
from kvservice.server.kv_sources import prefix_source_params
from kvservice.server.metrics import ServerMetrics
from kvservice.server.worker_service import EngineWorkerService
from kvservice.v1 import kvservice_pb2 as pb

logger = logging.getLogger(__name__)


class PrefillWorkerService(EngineWorkerService):
    def __init__(
        self,
        engine: AsyncLLMEngine,
        registry: TransferRegistry,
        staging_wait_seconds: float = 10.0,
        metrics: ServerMetrics | None = None,
        kv_events: KVEventPublisher | None = None,
        kv_sending: KVTransferCounters | None = None,
    ) -> None:
        super().__init__(engine, "prefill", kv_events, kv_sending, registry)
        self.registry: TransferRegistry = registry
        self.staging_wait_seconds = staging_wait_seconds
        self.metrics = metrics if metrics is not None else ServerMetrics("prefill")
        self.is_draining = False

    async def drain(self) -> None:
        """Take no new prefill; return once every staged transfer has been pulled, released
        or has expired (the caller bounds the wait by its grace period)."""
        self.is_draining = True
        await self.registry.wait_until_empty()

    async def Prefill(self, request: pb.PrefillRequest, context: grpc.aio.ServicerContext) -> pb.PrefillResponse:
        inner = request.request
        is_valid_id = False
        registered = False
        completed = False
        try:
            check_request_id(inner.request_id, "request.request_id")
            is_valid_id = True
            if self.is_draining:
                raise ShuttingDown("this prefill worker is shutting down; send the request to another")
            with self.metrics.track(inner.request_id, logger) as tracker:
                if not request.transfer_token:
                    raise ValueError("transfer_token: empty")
                params = sampling_params_from_proto(inner.sampling_params)
                kv_params = _kv_transfer_params(request)  # checked before anything is registered
                token_ids = self.engine.engine.encode(prompt_from_proto(inner, self.engine.engine.max_model_len))
                await self.registry.register_when_space(
                    inner.request_id, request.transfer_token, len(token_ids), self.staging_wait_seconds
                )
                registered = True
                # The prefill samples exactly one token; the decode worker applies the real limits.
                prefill_params = replace(params, max_tokens=1)
                last = None
                async for out in self.engine.generate(token_ids, prefill_params, inner.request_id, kv_params):
                    if out.error is not None:
                        raise RequestFailed(out.error)
                    last = out
                assert last is not None and last.token_ids
                tracker.on_tokens(len(last.token_ids))
                completed = True
            first = last.token_ids[0]
            text, finish_reason = first_token_output(
                first, params, self.engine.engine.eos_token_ids, self.engine.engine.tokenizer
            )
            response = pb.PrefillResponse(
                request_id=inner.request_id,
                first_token_id=first,
                text=text,
                finish_reason=finish_reason_to_proto(finish_reason),
                num_prompt_tokens=len(token_ids),
                num_cached_tokens=last.num_cached_tokens or 0,
            )
            if last.logprobs:
                response.first_token_logprobs.CopyFrom(logprobs_to_proto(last.logprobs[:1])[0])
            if last.prompt_logprobs is not None:
                response.prompt_logprobs.extend(logprobs_to_proto(last.prompt_logprobs))
                response.prompt_token_ids.extend(token_ids)
            return response
        except Exception as e:
            await abort_with(context, e)
            raise  # abort raises; this line is never reached
        finally:
            if registered and not completed:
                self.registry.fail(inner.request_id, "the prefill did not complete")
            elif not registered and is_valid_id:
                self.registry.reject(inner.request_id, request.transfer_token, "the prefill request was refused")


def _kv_transfer_params(request: pb.PrefillRequest) -> dict[str, Any]:
    """What the prefill's KV moves by: its transfer token, and the prefix source it pulls from."""
    params: dict[str, Any] = {TRANSFER_TOKEN: request.transfer_token}
    if request.HasField("prefix_source"):
        params.update(prefix_source_params(request.prefix_source))
    return params


def first_token_finish_reason(token_id: int, params: SamplingParams, eos_token_ids: frozenset[int]) -> str | None:
    """Whether the first token alone ends the request, under the client's own limits."""
    if (not params.ignore_eos and token_id in eos_token_ids) or token_id in params.stop_token_ids:
        return "stop"
    if params.max_tokens == 1:
        return "length"
    return None


def first_token_output(
    token_id: int, params: SamplingParams, eos_token_ids: frozenset[int], tokenizer: Tokenizer | None
) -> tuple[str, str | None]:
    """The first token's text and finish reason, exactly as the decode worker's engine
    emits them for its first output (the proxy shows this one and skips that one): what
    could start a stop string is held back, a stop string in it ends the request."""
    finish_reason = first_token_finish_reason(token_id, params, eos_token_ids)
    output_text = OutputText(tokenizer, params.stop)
    _, text = output_text.push([token_id], is_last=finish_reason is not None)
    return text, "stop" if output_text.is_stopped else finish_reason
