"""Runs one scheduled step: builds the flat batch, runs the model inside the connector lifecycle, samples.

Tokens are laid out decode-first: requests with one new token share one batched
attention call; prompt chunks follow, one span each.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvservice.attention import AttentionMetadata, PrefillSpan
from kvservice.connector.base import KVConnectorBase, KVConnectorOutput
from kvservice.connector.lifecycle import (
    finalize_kv_connector,
    kv_connector_no_forward,
    maybe_get_kv_connector_output,
)
from kvservice.kv_cache import KVCacheLayout
from kvservice.model import CausalLM
from kvservice.sampler import Sampler
from kvservice.scheduler import ScheduledRequest, SchedulerOutput


@dataclass(slots=True)
class ModelRunnerOutput:
    sampled_token_ids: dict[str, int] = field(default_factory=dict)
    kv_connector_output: KVConnectorOutput | None = None


@dataclass(slots=True)
class InputBatch:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    attn: AttentionMetadata
    logits_indices: torch.Tensor  # [N] last token of each sampling request
    sampling: list[ScheduledRequest]


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        kv_caches: list[torch.Tensor],
        layout: KVCacheLayout,
        device: torch.device,
        seed: int = 0,
        connector: KVConnectorBase | None = None,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = layout.block_size
        self.device = device
        self.sampler = Sampler(device, seed)
        self.connector = connector

    def execute_model(self, scheduler_output: SchedulerOutput, defer_finalize: bool = False) -> ModelRunnerOutput:
        """One step. With `defer_finalize`, the caller must call `finalize()` after its draft pass."""
        self.sampler.forget(scheduler_output.finished_req_ids)
        if scheduler_output.is_empty:
            if self.connector is None:
                return ModelRunnerOutput()
            return ModelRunnerOutput(kv_connector_output=kv_connector_no_forward(self.connector, scheduler_output))
        batch = self._prepare(scheduler_output.scheduled)
        with maybe_get_kv_connector_output(self.connector, scheduler_output, defer_finalize) as kv_output:
            hidden = self.model(batch.input_ids, batch.positions, self.kv_caches, batch.attn, self.connector)
        sampled: dict[str, int] = {}
        if batch.sampling:
            logits = self.model.compute_logits(hidden[batch.logits_indices])
            request_ids = [s.request.request_id for s in batch.sampling]
            params = [s.request.sampling_params for s in batch.sampling]
            sampled = dict(zip(request_ids, self.sampler.sample(logits, request_ids, params)))
        return ModelRunnerOutput(sampled, kv_output)

    def finalize(self) -> None:
        finalize_kv_connector(self.connector)

    # ------------------------------------------------------------ batch building

    def _prepare(self, scheduled: list[ScheduledRequest]) -> InputBatch:
        bs = self.block_size
        decodes = [s for s in scheduled if s.num_new_tokens == 1]
        prefills = [s for s in scheduled if s.num_new_tokens > 1]
        ordered = decodes + prefills
        token_ids: list[int] = []
        positions: list[int] = []
        for s in ordered:
            start = s.request.num_computed_tokens
            token_ids.extend(s.request.all_token_ids[start : start + s.num_new_tokens])
            positions.extend(range(start, start + s.num_new_tokens))
        pos = torch.tensor(positions, dtype=torch.long)
        # Block table of each token's request, then the slot of each token.
        token_blocks = torch.tensor(
            [s.block_ids[p // bs] for s in ordered for p in range(s.request.num_computed_tokens, s.request.num_computed_tokens + s.num_new_tokens)],
            dtype=torch.long,
        )
        slot_mapping = token_blocks * bs + pos % bs

        decode_slots = decode_mask = None
        if decodes:
            context_lens = torch.tensor([s.request.num_computed_tokens + 1 for s in decodes])
            max_len = int(context_lens.max())
            max_blocks = -(-max_len // bs)
            table = torch.tensor([(s.block_ids + [0] * max_blocks)[:max_blocks] for s in decodes], dtype=torch.long)
            decode_slots = (table[:, :, None] * bs + torch.arange(bs)).flatten(1)[:, :max_len]  # [D, L]
            decode_mask = (torch.arange(max_len)[None, :] < context_lens[:, None])[:, None, None, :]

        spans: list[PrefillSpan] = []
        offset = len(decodes)
        for s in prefills:
            n, start = s.num_new_tokens, s.request.num_computed_tokens
            span = PrefillSpan(offset, offset + n)
            if start > 0:
                context = start + n
                table = torch.tensor(s.block_ids[: -(-context // bs)], dtype=torch.long)
                span.context_slots = (table[:, None] * bs + torch.arange(bs)).flatten()[:context]
                # Query i (position start + i) sees keys at positions <= start + i.
                span.mask = torch.arange(context)[None, :] <= (start + torch.arange(n))[:, None]
            spans.append(span)
            offset += n

        sampling_idx: list[int] = []
        sampling: list[ScheduledRequest] = []
        end = 0
        for s in ordered:
            end += s.num_new_tokens
            if s.is_sampling:
                sampling_idx.append(end - 1)
                sampling.append(s)

        dev = self.device
        attn = AttentionMetadata(
            slot_mapping=slot_mapping.to(dev),
            num_decode_tokens=len(decodes),
            decode_context_slots=None if decode_slots is None else decode_slots.to(dev),
            decode_mask=None if decode_mask is None else decode_mask.to(dev),
            prefills=[_span_to(span, dev) for span in spans],
        )
        return InputBatch(
            input_ids=torch.tensor(token_ids, dtype=torch.long, device=dev),
            positions=pos.to(dev),
            attn=attn,
            logits_indices=torch.tensor(sampling_idx, dtype=torch.long, device=dev),
            sampling=sampling,
        )


def _span_to(span: PrefillSpan, device: torch.device) -> PrefillSpan:
    if span.context_slots is None or device.type == "cpu":
        return span
    assert span.mask is not None
    return PrefillSpan(span.start, span.end, span.context_slots.to(device), span.mask.to(device))
