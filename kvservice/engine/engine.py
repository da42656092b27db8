"""The engine: one step = schedule() -> execute_model() -> update_from_output().

Synchronous and single-threaded; `AsyncLLMEngine` runs it in a thread of its own.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import time
from dataclasses import dataclass, field
from typing import Any

from kvservice.config import EngineConfig, ModelConfig
from kvservice.connector.base import KVConnectorBase
from kvservice.core.block_hash import hash_seed
from kvservice.core.block_pool import KVCacheEvent
from kvservice.core.kv_cache_manager import KVCacheManager
from kvservice.core.logprobs import TokenLogprobs
from kvservice.core.outputs import EngineCoreOutput, SchedulerOutput
from kvservice.core.request import Request, RequestStatus, check_request_id
from kvservice.core.sampling_params import SamplingParams
from kvservice.engine.scheduler import Scheduler
from kvservice.engine.step_budget import StepTimeBudget
from kvservice.engine.step_trace import StepTrace
from kvservice.engine.stop_checker import OutputText
from kvservice.loading.chat_template import Prompt, ResumedPrompt, encode_prompt
from kvservice.loading.model_files import load_model_config
from kvservice.loading.model_loader import LoadedModel, load_model
from kvservice.loading.tokenizer import Tokenizer
from kvservice.model.kv_cache import KVCacheLayout, allocate_kv_caches
from kvservice.structured.grammar import GrammarCompiler
from kvservice.worker.core_lease import CoreLease, LeaseRole, prompt_quantum
from kvservice.worker.draft_proposer import DraftProposer
from kvservice.worker.grammar_masks import GrammarMasks
from kvservice.worker.model_runner import ModelRunner
from kvservice.worker.prompt_lane import PromptLane, PromptLaneConnector


@dataclass(slots=True)
class RequestOutput:
    """A request's state after a step: all its generated tokens so far, plus what is new.

    With `SamplingParams.logprobs`, `logprobs` (all so far) and `new_logprobs` have one entry
    per token of `token_ids` and `new_token_ids`. From the first output with tokens on,
    `num_cached_tokens` is the number of prompt tokens found in the prefix cache and, with
    `SamplingParams.prompt_logprobs`, `prompt_logprobs` has one entry per prompt token after the first.

    With `SamplingParams.n` > 1 the request has n sequences: each output is one sequence's
    (`index`), `finished` says that sequence ended, `all_finished` that every one has."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    new_token_ids: list[int]
    new_text: str
    finish_reason: str | None = None
    error: str | None = None
    logprobs: list[TokenLogprobs] | None = None
    new_logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs] | None = None
    num_cached_tokens: int | None = None
    index: int = 0
    all_finished: bool = False

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class _Tracked:
    request_id: str  # the caller's: a sequence of an n > 1 request runs under an id of its own
    index: int
    prompt_token_ids: list[int]
    output_text: OutputText
    token_ids: list[int] = field(default_factory=list)
    wants_logprobs: bool = False
    # All of them so far (not for a resumed stream, whose first tokens' came from elsewhere).
    logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs] | None = None
    num_cached_tokens: int | None = None


class LLMEngine:
    def __init__(
        self,
        model: str,
        config: EngineConfig,
        connector: KVConnectorBase | None = None,
        core_lease: CoreLease | None = None,
    ) -> None:
        """`core_lease`: steps take turns on the cores with other workers on them (see `CoreLease`)."""
        self.config = config
        self.core_lease = core_lease
        self.step_trace = StepTrace.from_env()  # off unless $KVSERVICE_STEP_TRACE names a directory
        if core_lease is not None and self.step_trace is not None:
            core_lease.turn_log = self.step_trace.turns
            self.step_trace.lease_role = core_lease.role.value
        self.loaded: LoadedModel = load_model(
            model, config.dtype, config.device, config.max_model_len or load_model_config(model).max_position_embeddings
        )
        self.model_config: ModelConfig = self.loaded.config
        self.tokenizer: Tokenizer | None = self.loaded.tokenizer
        self.max_model_len = config.max_model_len or self.model_config.max_position_embeddings
        self.layout = KVCacheLayout.for_model(self.model_config, config.block_size, self.loaded.dtype)
        self.draft: LoadedModel | None = None
        bytes_per_block = self.layout.bytes_per_block
        if config.draft_model is not None:
            self.draft = load_model(config.draft_model, config.dtype, config.device, self.max_model_len)
            if self.draft.config.vocab_size != self.model_config.vocab_size:
                raise ValueError(
                    f"draft_model: vocabulary of {self.draft.config.vocab_size} tokens, "
                    f"the target's has {self.model_config.vocab_size}"
                )
            draft_layout = KVCacheLayout.for_model(self.draft.config, config.block_size, self.draft.dtype)
            bytes_per_block += draft_layout.bytes_per_block
        num_blocks = config.num_blocks or max(1, config.kv_cache_memory_bytes // bytes_per_block)
        self.kv_caches = allocate_kv_caches(self.layout, num_blocks, self.loaded.device)
        self.prompt_lane: PromptLane | None = None
        if config.prompt_lane:
            if connector is not None:
                raise ValueError(
                    "prompt_lane: a colocated worker's; this engine's KV already comes through a connector"
                )
            self.prompt_lane = PromptLane(
                self.loaded.model, self.kv_caches, config.block_size, self.loaded.device, config.max_num_batched_tokens
            )
            connector = PromptLaneConnector(self.prompt_lane)
        self._last_step_s = 0.0  # the last step that computed: what a lane slice leaves of the target
        self.connector = connector
        if connector is not None:
            connector.register_kv_caches(self.kv_caches, self.layout)
        # The prefix cache's keys fold in what else decides the KV: the model and its dtype.
        self.kv_hash_seed = hash_seed(model, str(self.loaded.dtype))
        self.scheduler = Scheduler(
            KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching, self.kv_hash_seed),
            config.max_num_seqs,
            config.max_num_batched_tokens,
            connector,
            config.kv_load_failure_policy,
            self.model_config.vocab_size,
            config.num_speculative_tokens,
            config.max_prefill_tokens_with_decode,
            None
            if config.step_target_ms is None
            else StepTimeBudget(
                config.step_target_ms / 1000,
                config.max_prefill_tokens_with_decode or config.max_num_batched_tokens,
                config.max_num_batched_tokens,
            ),
        )
        drafter = None
        if self.draft is not None:
            # Same block ids as the target's cache: one allocation serves both.
            draft_caches = allocate_kv_caches(draft_layout, num_blocks, self.draft.device)
            drafter = DraftProposer(
                self.draft.model, draft_caches, config.block_size, config.num_speculative_tokens, self.draft.device
            )
        self._grammar_compiler: GrammarCompiler | None = None
        self.runner = ModelRunner(
            self.loaded.model,
            self.kv_caches,
            self.layout,
            self.loaded.device,
            config.seed,
            connector,
            drafter,
            GrammarMasks(self.grammar_compiler),
            core_lease.pause if core_lease is not None and core_lease.role is LeaseRole.YIELDING else None,
        )
        self._tracked: dict[str, _Tracked] = {}  # by the id each sequence runs under
        self._sequence_ids: dict[str, list[str]] = {}  # caller's id -> its unfinished sequences' ids
        self._ids = itertools.count()
        # The last step computed nothing and preempted nothing: the next one would do the
        # same until a transfer finishes, a command arrives or blocks come free.
        self.is_last_step_idle = False
        self.eos_token_ids = frozenset(self.model_config.eos_token_ids)

    # ------------------------------------------------------------ requests

    def encode(self, prompt: Prompt) -> list[int]:
        """Token ids of a prompt (a conversation rendered with the model's chat template),
        validated against the vocabulary and the maximum length."""
        token_ids = encode_prompt(self.tokenizer, prompt)
        if not token_ids:
            raise ValueError("prompt: empty prompt")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt: {len(token_ids)} tokens, but the model's maximum length is {self.max_model_len} "
                "(prompt plus at least one generated token)"
            )
        vocab = self.model_config.vocab_size
        bad = next((t for t in token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"prompt_token_ids: token id {bad} is outside the vocabulary [0, {vocab})")
        return token_ids

    def grammar_compiler(self) -> GrammarCompiler:
        """Structured output's grammars for this model, built on first use (~0.2 s)."""
        if self._grammar_compiler is None:
            self._grammar_compiler = GrammarCompiler(
                self.tokenizer, self.model_config.vocab_size, sorted(self.eos_token_ids)
            )
        return self._grammar_compiler

    def add_request(
        self,
        prompt: Prompt,
        params: SamplingParams,
        request_id: str | None = None,
        kv_transfer_params: dict[str, Any] | None = None,
    ) -> str:
        token_ids = self.encode(prompt)
        vocab = self.model_config.vocab_size
        bad = next((t for t in params.stop_token_ids if t >= vocab), None)
        if bad is not None:
            raise ValueError(f"stop_token_ids: token id {bad} is outside the vocabulary [0, {vocab})")
        if params.structured_output is not None:
            # Compiled now (then cached): a schema it cannot enforce is refused before it runs.
            self.grammar_compiler().compile(params.structured_output)
        output_text = OutputText(self.tokenizer, params.stop)
        resumed = token_ids[len(token_ids) - len(prompt.token_ids) :] if isinstance(prompt, ResumedPrompt) else []
        if resumed:
            params = _resumed_params(params, len(resumed))
            # The same detokenizer and stop-string state as the stream had: text held back
            # there stays held back here, and nothing already sent is sent again.
            output_text.push(resumed)
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        check_request_id(request_id)
        if params.n > 1 and resumed:
            raise ValueError("n: a resumed stream continues one sequence, so n must be 1")
        sequence_ids = [request_id, *(f"{request_id}/{i}" for i in range(1, params.n))]
        taken = next((r for r in sequence_ids if r in self._sequence_ids or r in self.scheduler.requests), None)
        if taken is not None:
            raise ValueError(f"request_id {taken!r} is already in use")
        leader: Request | None = None
        for index, sequence_id in enumerate(sequence_ids):
            request = Request(
                sequence_id,
                token_ids,
                _sequence_params(params, index),
                eos_token_ids=self.eos_token_ids,
                max_model_len=self.max_model_len,
                kv_transfer_params=kv_transfer_params if leader is None else None,
                leader=leader,
            )
            self.scheduler.add_request(request)
            leader = leader or request
            # Outputs read as the original request's, continued: resumed tokens count as output.
            self._tracked[sequence_id] = _Tracked(
                request_id,
                index,
                token_ids[: len(token_ids) - len(resumed)],
                output_text if index == 0 else OutputText(self.tokenizer, params.stop),
                list(resumed),
                params.logprobs is not None,
                [] if params.logprobs is not None and not resumed else None,
            )
        self._sequence_ids[request_id] = sequence_ids
        return request_id

    def abort_request(self, request_id: str) -> bool:
        """Abort every sequence of the request; False if none was still running."""
        aborted = [self.scheduler.abort_request(r) for r in self._sequence_ids.get(request_id, [request_id])]
        return any(aborted)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_work()

    # ------------------------------------------------------------ the step

    def step(self, eager_finalize: bool = False) -> list[RequestOutput]:
        """One step; `eager_finalize` is the speculative benchmark's baseline (see `ModelRunner.execute_model`)."""
        step_began = time.monotonic()  # these times: the step budget's, and the trace's (`StepTrace`)
        self._run_prompt_lane()
        scheduler_output = self.scheduler.schedule()
        scheduled = time.monotonic()
        with self._turn(scheduler_output):
            started = time.monotonic()
            runner_output = self.runner.execute_model(scheduler_output, eager_finalize=eager_finalize)
            computed = time.monotonic()
        if scheduler_output.num_scheduled_tokens:  # what the step cost, for the next steps' prompt budget
            num_prompt = scheduler_output.num_prompt_tokens
            self._last_step_s = time.monotonic() - started
            self.scheduler.step_budget.observe(
                scheduler_output.num_scheduled_tokens - num_prompt, num_prompt, self._last_step_s
            )
        kv_output = runner_output.kv_connector_output
        self.is_last_step_idle = (
            scheduler_output.num_scheduled_tokens == 0
            and not scheduler_output.preempted_req_ids
            # Loads that finished run in the next step; the lane's work is the next step's too.
            and not (kv_output is not None and kv_output.finished_recving)
            and not (self.prompt_lane is not None and self.prompt_lane.has_work)
        )
        core_outputs = self.scheduler.update_from_output(
            scheduler_output,
            runner_output.sampled_token_ids,
            kv_output,
            runner_output.logprobs,
            runner_output.prompt_logprobs,
            runner_output.errors,
        )
        outputs = [out for core in core_outputs if (out := self._to_request_output(core)) is not None]
        if self.step_trace is not None and scheduler_output.num_scheduled_tokens:
            self.step_trace.steps.append(
                (
                    step_began,
                    scheduled,
                    started,
                    computed,
                    time.monotonic(),
                    scheduler_output.num_scheduled_tokens,
                    len(scheduler_output.scheduled),
                )
            )
        return outputs

    def _run_prompt_lane(self) -> None:
        """A slice of the prompt lane before the step: what the last step left of the step target
        (at least a quarter of it, so prompts progress), or the whole batch when nothing decodes."""
        lane = self.prompt_lane
        if lane is None or not lane.has_work:
            return
        lane.run(prompt_quantum(self.config.step_target_s, self._last_step_s) if self.scheduler.running else None)

    def _turn(self, scheduler_output: SchedulerOutput) -> contextlib.AbstractContextManager[None]:
        """The cores for a step that computes (a step that only reports connector progress needs none)."""
        if self.core_lease is None or scheduler_output.is_empty:
            return contextlib.nullcontext()
        return self.core_lease.turn()

    def _to_request_output(self, core: EngineCoreOutput) -> RequestOutput | None:
        tracked = self._tracked.get(core.request_id)
        if tracked is None:
            return None
        finish_reason = core.finish_reason
        num_kept, new_text = tracked.output_text.push(core.new_token_ids, is_last=finish_reason is not None)
        new_token_ids = list(core.new_token_ids[:num_kept])
        tracked.token_ids.extend(new_token_ids)
        new_logprobs = None
        if tracked.wants_logprobs:
            new_logprobs = list(core.logprobs[:num_kept]) if core.logprobs is not None else []
            if tracked.logprobs is not None:
                tracked.logprobs.extend(new_logprobs)
        if core.prompt_logprobs is not None:
            tracked.prompt_logprobs = core.prompt_logprobs
        if core.num_cached_tokens is not None:
            tracked.num_cached_tokens = core.num_cached_tokens
        if tracked.output_text.is_stopped:
            if finish_reason is None:
                # The scheduler goes on until told: end the request there, its blocks free now.
                self.scheduler.finish_request(core.request_id, RequestStatus.FINISHED_STOPPED)
            finish_reason = "stop"
        all_finished = False
        if finish_reason is not None:
            del self._tracked[core.request_id]
            unfinished = self._sequence_ids[tracked.request_id]
            unfinished.remove(core.request_id)
            all_finished = not unfinished
            if all_finished:
                del self._sequence_ids[tracked.request_id]
        return RequestOutput(
            request_id=tracked.request_id,
            prompt_token_ids=tracked.prompt_token_ids,
            token_ids=list(tracked.token_ids),
            text=tracked.output_text.text,
            new_token_ids=new_token_ids,
            new_text=new_text,
            finish_reason=finish_reason,
            error=core.error,
            logprobs=None if tracked.logprobs is None else list(tracked.logprobs),
            new_logprobs=new_logprobs,
            prompt_logprobs=tracked.prompt_logprobs,
            num_cached_tokens=tracked.num_cached_tokens,
            index=tracked.index,
            all_finished=all_finished,
        )

    # ------------------------------------------------------------ introspection

    def take_kv_events(self) -> list[KVCacheEvent]:
        """The prefix cache's changes since the last call (recorded from the first call on)."""
        pool = self.scheduler.kv.block_pool
        pool.record_events = True
        return pool.take_events()

    def kv_cache_snapshot(self) -> list[KVCacheEvent]:
        """Everything the prefix cache holds now, as `stored` events."""
        return self.scheduler.kv.block_pool.snapshot()

    @property
    def num_free_blocks(self) -> int:
        return self.scheduler.kv.num_free_blocks

    @property
    def num_blocks(self) -> int:
        return self.scheduler.kv.num_blocks


def _sequence_params(params: SamplingParams, index: int) -> SamplingParams:
    """Sequence `index` of an n > 1 request: one sequence, seed + index (so it equals the
    request sent alone with that seed); the prompt's logprobs are the first sequence's."""
    if params.n == 1:
        return params
    seed = None if params.seed is None else params.seed + index
    return dataclasses.replace(params, n=1, seed=seed, prompt_logprobs=params.prompt_logprobs if index == 0 else None)


def _resumed_params(params: SamplingParams, num_resumed: int) -> SamplingParams:
    """The limits of what is left to generate after `num_resumed` tokens."""
    if num_resumed >= params.max_tokens:
        raise ValueError(f"resume_token_ids: {num_resumed} tokens already reach max_tokens ({params.max_tokens})")
    # The prompt's logprobs went out with the stream's first output.
    return dataclasses.replace(params, max_tokens=params.max_tokens - num_resumed, prompt_logprobs=None)
