"""The draft pass of speculative decoding: a small model proposes the next K tokens.

The draft has a paged KV cache of its own, addressed by the same block ids as the
target's (a block id names the same token slots in both caches, so allocation and
freeing serve both). `num_draft_computed_tokens` says how far a request's draft KV is
valid; each pass first catches the draft up to the request's tokens (a prompt chunk,
the accepted tokens, or a whole prompt whose target KV was pulled from a prefill
worker without the draft's KV), then proposes.

With `kv_hooks` (a prefill worker's connector, offset past the target's layers), the catch-up
forward saves the draft's KV like the target's: the runner calls it while the target's save
is still in flight (deferred finalize), and the draft's prompt KV travels on the same pull.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvservice.core.outputs import ScheduledRequest
from kvservice.core.request import Request, RequestStatus
from kvservice.model.attention import AttentionMetadata, LayerKVHooks
from kvservice.model.model import CausalLM
from kvservice.worker.input_batch import BatchItem, build_batch
from kvservice.worker.rejection_sampler import target_probs
from kvservice.worker.sampler import Sampler


@dataclass(frozen=True, slots=True)
class DraftLayerHooks:
    """A connector's per-layer hooks for the draft's layers, numbered after the target's."""

    hooks: LayerKVHooks
    first_layer: int  # the target's layer count

    @property
    def has_layer_hooks(self) -> bool:
        return self.hooks.has_layer_hooks

    def wait_for_layer_load(self, layer: int) -> None:
        self.hooks.wait_for_layer_load(self.first_layer + layer)

    def save_kv_layer(self, layer: int, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata) -> None:
        self.hooks.save_kv_layer(self.first_layer + layer, kv_layer, attn_metadata)


@dataclass(slots=True)
class _Proposal:
    request: Request
    block_ids: list[int]
    item_index: int
    num_tokens: int  # tokens to propose
    token_ids: list[int]
    probs: list[torch.Tensor]


class DraftProposer:
    def __init__(
        self,
        model: CausalLM,
        kv_caches: list[torch.Tensor],
        block_size: int,
        num_speculative_tokens: int,
        device: torch.device,
        kv_hooks: LayerKVHooks | None = None,
    ) -> None:
        self.model = model
        self.kv_hooks = kv_hooks
        # Prompt tokens the draft ran over (since the last `take_num_prompt_tokens_computed`).
        self._num_prompt_tokens_computed = 0
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.num_speculative_tokens = num_speculative_tokens
        self.device = device
        # The draft's distributions of the proposed tokens, for rejection sampling.
        self.draft_probs: dict[str, torch.Tensor] = {}

    def take_num_prompt_tokens_computed(self) -> int:
        """Prompt tokens the draft ran over since the last call."""
        num, self._num_prompt_tokens_computed = self._num_prompt_tokens_computed, 0
        return num

    def forget(self, request_ids: set[str]) -> None:
        for request_id in request_ids:
            self.draft_probs.pop(request_id, None)

    def propose(self, scheduled: list[ScheduledRequest], new_token_ids: dict[str, list[int]], sampler: Sampler) -> None:
        """After the target's step: catch the draft up and set each request's spec_token_ids."""
        items, proposals = self._catch_up_items(scheduled, new_token_ids)
        if not items:
            return
        batch = build_batch(items, self.block_size, self.device)
        hidden = self.model(batch.input_ids, batch.positions, self.kv_caches, batch.attn, self.kv_hooks)
        if not proposals:
            return
        last = torch.tensor([batch.ends[p.item_index] - 1 for p in proposals], device=self.device)
        self._sample(proposals, self.model.compute_logits(hidden[last]), sampler)
        self._extend(proposals, sampler)
        for p in proposals:
            p.request.spec_token_ids = p.token_ids
            if p.probs:
                self.draft_probs[p.request.request_id] = torch.stack(p.probs)

    def _catch_up_items(
        self, scheduled: list[ScheduledRequest], new_token_ids: dict[str, list[int]]
    ) -> tuple[list[BatchItem], list[_Proposal]]:
        """The draft pass's batch: per running request, the tokens whose draft KV is missing
        (advancing `num_draft_computed_tokens` past them); and the requests that propose,
        each from the last token of its item."""
        items: list[BatchItem] = []
        proposals: list[_Proposal] = []
        for s in scheduled:
            request = s.request
            if request.status is not RequestStatus.RUNNING:
                continue
            new = new_token_ids.get(request.request_id, [])
            tokens = request.all_token_ids + new  # the scheduler appends them after this pass
            computed = request.num_computed_tokens + s.num_new_tokens - len(s.spec_token_ids) + max(len(new) - 1, 0)
            start = min(request.num_draft_computed_tokens, computed)
            end = len(tokens) if new else computed
            if end <= start:
                continue
            items.append(BatchItem(tokens[start:end], start, s.block_ids))
            request.num_draft_computed_tokens = end
            self._num_prompt_tokens_computed += max(0, min(end, request.num_prompt_tokens) - start)
            # Never propose past what the request may emit (the target adds one more); a
            # constrained request decodes without drafts (its grammar masks one token a step).
            is_free = new and request.sampling_params.structured_output is None
            num_tokens = min(self.num_speculative_tokens, request.max_num_tokens - len(tokens) - 1) if is_free else 0
            if num_tokens > 0:
                proposals.append(_Proposal(request, s.block_ids, len(items) - 1, num_tokens, [], []))
        return items, proposals

    def _extend(self, proposals: list[_Proposal], sampler: Sampler) -> None:
        """The proposals' later tokens, one draft step each: the last proposed token in, the next one out."""
        for step in range(1, self.num_speculative_tokens):
            active = [p for p in proposals if p.num_tokens > step]
            if not active:
                break
            step_items = [
                BatchItem([p.token_ids[-1]], p.request.num_draft_computed_tokens, p.block_ids) for p in active
            ]
            batch = build_batch(step_items, self.block_size, self.device)
            hidden = self.model(batch.input_ids, batch.positions, self.kv_caches, batch.attn)
            for p in active:
                p.request.num_draft_computed_tokens += 1
            self._sample(active, self.model.compute_logits(hidden), sampler)

    def _sample(self, proposals: list[_Proposal], logits: torch.Tensor, sampler: Sampler) -> None:
        for p, row in zip(proposals, logits):
            params = p.request.sampling_params
            if params.is_greedy:
                p.token_ids.append(int(row.argmax()))
                continue
            probs = target_probs(row[None], params)[0]
            # The draft's own stream: its draws never reuse the target's (rejection sampling needs them independent).
            position = p.request.num_output_tokens + len(p.token_ids)
            token = torch.multinomial(
                probs, 1, generator=sampler.generator_for(p.request.request_id, params, position, stream=1)
            )
            p.token_ids.append(int(token))
            p.probs.append(probs)
