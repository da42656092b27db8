"""Runs one scheduled step: builds the flat batch, runs the target model inside the
connector lifecycle, samples (or verifies draft tokens), and runs the draft pass.

With a proposer (a draft model, or prompt lookup) the target forward runs with
`defer_finalize=True`: the draft pass runs while the KV save is still in flight, then
`finalize()` waits for the save. The connector output is handed back only after that.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvservice.connector.base import KVConnectorBase
from kvservice.connector.lifecycle import (
    finalize_kv_connector,
    kv_connector_no_forward,
    maybe_get_kv_connector_output,
)
from kvservice.core.logprobs import TokenLogprobs
from kvservice.core.outputs import KVConnectorOutput, ScheduledRequest, SchedulerOutput
from kvservice.model.cpu_kernels import load_cpu_kernels
from kvservice.model.kv_cache import KVCacheLayout
from kvservice.model.model import CausalLM, Pause
from kvservice.worker.grammar_masks import GrammarMasks
from kvservice.worker.input_batch import BatchItem, InputBatch, build_batch
from kvservice.worker.logprobs import token_logprobs
from kvservice.worker.proposer import Proposer
from kvservice.worker.rejection_sampler import verify_draft_tokens
from kvservice.worker.sampler import Sampler


@dataclass(slots=True)
class ModelRunnerOutput:
    # Per sampling request: the accepted draft tokens, then one token from the target.
    sampled_token_ids: dict[str, list[int]] = field(default_factory=dict)
    kv_connector_output: KVConnectorOutput | None = None
    # Requests that asked for logprobs: one per sampled token.
    logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    # Requests that asked for prompt logprobs: those of the prompt positions this step
    # computed, in order, continuing what the request has gathered.
    prompt_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    # Requests that cannot go on (their output left their grammar), with the reason.
    errors: dict[str, str] = field(default_factory=dict)
    # Prompt tokens the draft model ran over this step.
    num_draft_prompt_tokens: int = 0


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        kv_caches: list[torch.Tensor],
        layout: KVCacheLayout,
        device: torch.device,
        seed: int = 0,
        connector: KVConnectorBase | None = None,
        drafter: Proposer | None = None,
        grammar_masks: GrammarMasks | None = None,
        pause: Pause | None = None,
        kv_save_before_draft: bool = False,
    ) -> None:
        """`kv_save_before_draft`: wait for the target's KV save before the draft pass (eager
        finalize, a baseline) instead of running the pass while the save is in flight."""
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = layout.block_size
        self.device = device
        self.sampler = Sampler(device, seed)
        self.connector = connector
        self.drafter = drafter
        self.grammar_masks = grammar_masks
        self.pause = pause  # between the model's matmuls (a prefill worker sharing its cores: CoreLease.pause)
        self.kv_save_before_draft = kv_save_before_draft
        if device.type == "cpu":
            load_cpu_kernels()  # at start-up, so no request waits for the build
            model.prepare_for_cpu(batch_hint=16)  # the packed layout suits any row count

    def execute_model(self, scheduler_output: SchedulerOutput, defer_finalize: bool = False) -> ModelRunnerOutput:
        """One step. With `defer_finalize`, the caller must call `finalize()` after its own draft pass.

        With a draft model the save stays in flight during the draft pass (the connector
        lifecycle's deferred finalize), and `finalize()` follows it."""
        self.sampler.forget(scheduler_output.finished_req_ids)
        if self.grammar_masks is not None:
            self.grammar_masks.forget(scheduler_output.finished_req_ids)
        if self.drafter is not None:
            self.drafter.forget(scheduler_output.finished_req_ids)
        if scheduler_output.is_empty:
            if self.connector is None:
                return ModelRunnerOutput()
            return ModelRunnerOutput(kv_connector_output=kv_connector_no_forward(self.connector, scheduler_output))
        scheduled = scheduler_output.scheduled
        batch = build_batch([_batch_item(s) for s in scheduled], self.block_size, self.device)
        with maybe_get_kv_connector_output(
            self.connector, scheduler_output, defer_finalize or self.drafter is not None
        ) as kv_output:
            hidden = self.model(
                batch.input_ids, batch.positions, self.kv_caches, batch.attn, self.connector, self.pause
            )
        sampled, logits, errors = self._sample(scheduled, batch, hidden)
        num_draft_prompt_tokens = 0
        if self.drafter is not None:
            self.draft_pass(scheduled, sampled)
            num_draft_prompt_tokens = self.drafter.take_num_prompt_tokens_computed()
            if not defer_finalize:
                self.finalize()
        return ModelRunnerOutput(
            sampled,
            kv_output,
            self._sampled_logprobs(scheduled, sampled, logits),
            self._prompt_logprobs(scheduled, batch, hidden),
            errors,
            num_draft_prompt_tokens,
        )

    def draft_pass(self, scheduled: list[ScheduledRequest], sampled: dict[str, list[int]]) -> None:
        """The proposer's tokens for the next step, while the target's KV save is in flight."""
        assert self.drafter is not None
        if self.kv_save_before_draft and self.connector is not None:
            self.connector.wait_for_save()  # the draft's own save is waited for by the finalize after the pass
        self.drafter.propose(scheduled, sampled, self.sampler)

    def finalize(self) -> None:
        finalize_kv_connector(self.connector)

    def _sample(
        self, scheduled: list[ScheduledRequest], batch: InputBatch, hidden: torch.Tensor
    ) -> tuple[dict[str, list[int]], dict[str, torch.Tensor], dict[str, str]]:
        """Plain requests sample one token (batched), constrained ones under their grammar's
        mask; speculative ones verify their drafts. Returns the tokens, the raw logits rows
        they came from for requests that want logprobs, and the requests that must fail."""
        sampling = [(i, s) for i, s in enumerate(scheduled) if s.is_sampling]
        if not sampling:
            return {}, {}, {}
        rows: list[int] = []
        for i, s in sampling:
            rows.extend(batch.last_indices(i, 1 + len(s.spec_token_ids)))
        if all(_is_plain_greedy(s) for _, s in sampling):  # the tokens alone: no logits needed
            tokens = self.model.greedy_tokens(_select_rows(hidden, rows))
            if tokens is not None:
                return {s.request.request_id: [token] for (_, s), token in zip(sampling, tokens)}, {}, {}
        logits = self.model.compute_logits(_select_rows(hidden, rows))
        offsets = _row_offsets([s for _, s in sampling])  # first logits row of each request
        plain = [(offsets[n], s) for n, (_, s) in enumerate(sampling) if not s.spec_token_ids]
        sampled, errors = self._sample_plain(logits, plain)
        for n, (_, s) in enumerate(sampling):
            if s.spec_token_ids:
                sampled[s.request.request_id] = self._verify(logits, offsets[n], s)
        wanted = {
            s.request.request_id: logits[offsets[n] : offsets[n] + len(sampled[s.request.request_id])]
            for n, (_, s) in enumerate(sampling)
            if s.request.sampling_params.logprobs is not None and s.request.request_id in sampled
        }
        return sampled, wanted, errors

    def _sample_plain(
        self, logits: torch.Tensor, plain: list[tuple[int, ScheduledRequest]]
    ) -> tuple[dict[str, list[int]], dict[str, str]]:
        """One token per request without drafts (each given with its logits row), constrained
        ones under their grammar's mask; the requests whose grammar allows no token fail."""
        if not plain:
            return {}, {}
        plain_rows = _select_rows(logits, [row for row, _ in plain])
        errors: dict[str, str] = {}
        is_constrained = any(s.request.sampling_params.structured_output is not None for _, s in plain)
        if is_constrained and plain_rows is logits:
            plain_rows = logits.clone()  # masked in place: `logits` stays raw, for the logprobs
        if self.grammar_masks is not None and is_constrained:
            errors = self.grammar_masks.apply(plain_rows, [s.request for _, s in plain])
        request_ids = [s.request.request_id for _, s in plain]
        params = [s.request.sampling_params for _, s in plain]
        positions = [s.request.num_output_tokens for _, s in plain]
        tokens = self.sampler.sample(plain_rows, request_ids, params, positions)
        return {r: [token] for r, token in zip(request_ids, tokens) if r not in errors}, errors

    def _verify(self, logits: torch.Tensor, offset: int, s: ScheduledRequest) -> list[int]:
        """A speculative request's accepted draft tokens, then the target's own."""
        request = s.request
        params = request.sampling_params
        draft_probs = None if self.drafter is None else self.drafter.draft_probs.pop(request.request_id, None)
        if draft_probs is not None:
            draft_probs = draft_probs[: len(s.spec_token_ids)]
        return verify_draft_tokens(
            logits[offset : offset + 1 + len(s.spec_token_ids)],
            s.spec_token_ids,
            draft_probs,
            params,
            self.sampler.generator_for(request.request_id, params, request.num_output_tokens),
        )

    def _sampled_logprobs(
        self, scheduled: list[ScheduledRequest], sampled: dict[str, list[int]], logits: dict[str, torch.Tensor]
    ) -> dict[str, list[TokenLogprobs]]:
        """Each sampled token's logprobs, from the row that produced it (row j of a speculative
        request: the j-th accepted token, then the target's own)."""
        if not logits:
            return {}
        params = {s.request.request_id: s.request.sampling_params for s in scheduled}
        request_ids = list(logits)
        rows = torch.cat([logits[r] for r in request_ids])
        tokens = [t for r in request_ids for t in sampled[r]]
        num_top = max(params[r].logprobs or 0 for r in request_ids)
        flat = token_logprobs(rows, tokens, num_top)
        out: dict[str, list[TokenLogprobs]] = {}
        start = 0
        for request_id in request_ids:
            k = params[request_id].logprobs or 0
            out[request_id] = [_with_top(lp, k) for lp in flat[start : start + len(sampled[request_id])]]
            start += len(sampled[request_id])
        return out

    def _prompt_logprobs(
        self, scheduled: list[ScheduledRequest], batch: InputBatch, hidden: torch.Tensor
    ) -> dict[str, list[TokenLogprobs]]:
        """The logprobs of the prompt tokens this step's chunks predict: the row at position p
        gives those of the prompt's token p + 1 (positions gathered before are skipped)."""
        out: dict[str, list[TokenLogprobs]] = {}
        for i, s in enumerate(scheduled):
            request = s.request
            if not request.needs_prompt_logprobs:
                continue
            start = request.num_computed_tokens  # position of the chunk's first token
            num_run = s.num_new_tokens - len(s.spec_token_ids)
            first = max(start, len(request.prompt_logprobs))  # first position whose successor is wanted
            last = min(start + num_run, request.num_prompt_tokens - 1)  # one past the last
            if first >= last:
                continue
            flat_start = batch.ends[i] - num_run
            # The chunk's rows are contiguous in the flat batch: a slice, not a gather.
            logits = self.model.compute_logits(hidden[flat_start + first - start : flat_start + last - start])
            targets = request.all_token_ids[first + 1 : last + 1]
            out[request.request_id] = token_logprobs(logits, targets, request.sampling_params.prompt_logprobs or 0)
        return out


def _with_top(logprobs: TokenLogprobs, num_top: int) -> TokenLogprobs:
    """`logprobs` with its top list cut to `num_top` (rows were computed for the batch's largest)."""
    if len(logprobs.top) == num_top:
        return logprobs
    return TokenLogprobs(logprobs.token_id, logprobs.logprob, logprobs.rank, logprobs.top[:num_top])


def _is_plain_greedy(s: ScheduledRequest) -> bool:
    """A request whose next token is the logits' argmax, and that wants nothing else of them."""
    params = s.request.sampling_params
    return not s.spec_token_ids and params.is_greedy and params.logprobs is None and params.structured_output is None


def _select_rows(t: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """t's `rows` (a copy), or t itself when they are all its rows in order (a decode step's
    usual case). Never `t[idx]`: advanced indexing gathers element by element, and an ATen
    op over a 49k-wide logits row starts an OpenMP region (~50 us from the engine's thread)."""
    if rows == list(range(t.shape[0])):
        return t
    return t.index_select(0, torch.tensor(rows, device=t.device))


def _row_offsets(sampling: list[ScheduledRequest]) -> list[int]:
    offsets, total = [], 0
    for s in sampling:
        offsets.append(total)
        total += 1 + len(s.spec_token_ids)
    return offsets


def _batch_item(s: ScheduledRequest) -> BatchItem:
    """A scheduled request's tokens this step (its own, then its draft tokens to verify)."""
    start = s.request.num_computed_tokens
    own = s.request.all_token_ids[start : start + s.num_new_tokens - len(s.spec_token_ids)]
    return BatchItem(own + s.spec_token_ids, start, s.block_ids)
