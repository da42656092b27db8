"""The engine core: one step = prompt lane slice -> schedule() -> execute_model() -> update_from_output().

Synchronous and single-threaded (`AsyncLLMEngine` runs it in a thread of its own). It steps
requests by id and emits token ids; `OutputProcessor` turns those into what callers see, and
`kvservice.engine.engine_builder` assembles it from a config.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvservice.config import EngineConfig, ModelConfig
from kvservice.connector.base import KVConnectorBase
from kvservice.core.block_pool import KVCacheEvent
from kvservice.core.outputs import EngineCoreOutput, SchedulerOutput
from kvservice.core.request import Request, RequestStatus
from kvservice.engine.scheduler import Scheduler
from kvservice.engine.step_trace import StepTrace
from kvservice.engine.tier_loads import KVTierIO
from kvservice.loading.model_loader import LoadedModel
from kvservice.model.kv_cache import KVCacheLayout
from kvservice.structured.grammar import GrammarCompiler
from kvservice.worker.core_lease import CoreLease, prompt_quantum
from kvservice.worker.model_runner import ModelRunner
from kvservice.worker.prompt_lane import PromptLane


@dataclass(slots=True)
class EngineCore:
    """The parts one step runs, as `build_engine` wired them."""

    config: EngineConfig
    loaded: LoadedModel  # the target model, its config and tokenizer
    draft: LoadedModel | None
    layout: KVCacheLayout
    kv_caches: list[torch.Tensor]
    scheduler: Scheduler
    runner: ModelRunner
    connector: KVConnectorBase | None
    prompt_lane: PromptLane | None
    core_lease: CoreLease | None  # steps take turns on the cores with other workers on them
    step_trace: StepTrace | None  # off unless $KVSERVICE_STEP_TRACE names a directory
    grammar_compiler: Callable[[], GrammarCompiler]  # built on first use (~0.2 s)
    kv_hash_seed: int  # the prefix cache's keys fold in the model and its dtype
    max_model_len: int
    kv_tier: KVTierIO | None = None  # where evicted blocks go, and missed prefixes come from
    # The last step that computed: what a lane slice leaves of the step target.
    last_step_s: float = 0.0
    # The last step computed nothing and preempted nothing: the next one would do the
    # same until a transfer finishes, a command arrives or blocks come free.
    is_last_step_idle: bool = False

    @property
    def model_config(self) -> ModelConfig:
        return self.loaded.config

    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)

    def step(self) -> list[EngineCoreOutput]:
        """One step: the requests that advanced, finished or failed."""
        step_began = time.monotonic()  # these times: the step budget's, and the trace's (`StepTrace`)
        self._run_prompt_lane()
        self.scheduler.update_from_tier()
        scheduler_output = self.scheduler.schedule()
        if self.kv_tier is not None:  # the blocks this schedule evicted, before the forward reuses them
            self.kv_tier.save(self.scheduler.kv.block_pool.take_evicted())
        scheduled = time.monotonic()
        with self._turn(scheduler_output):
            started = time.monotonic()
            runner_output = self.runner.execute_model(scheduler_output)
            computed = time.monotonic()
        if scheduler_output.num_scheduled_tokens:  # what the step cost, for the next steps' prompt budget
            num_prompt = scheduler_output.num_prompt_tokens
            self.last_step_s = time.monotonic() - started
            self.scheduler.step_budget.observe(
                scheduler_output.num_scheduled_tokens - num_prompt, num_prompt, self.last_step_s
            )
        kv_output = runner_output.kv_connector_output
        self.is_last_step_idle = (
            scheduler_output.num_scheduled_tokens == 0
            and not scheduler_output.preempted_req_ids
            # Loads that finished run in the next step; the lane's work is the next step's too.
            and not (kv_output is not None and kv_output.finished_recving)
            and not (self.prompt_lane is not None and self.prompt_lane.has_work)
        )
        outputs = self.scheduler.update_from_output(
            scheduler_output,
            runner_output.sampled_token_ids,
            kv_output,
            runner_output.logprobs,
            runner_output.prompt_logprobs,
            runner_output.errors,
            runner_output.num_draft_prompt_tokens,
        )
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

    def finish_request(self, request_id: str, status: RequestStatus) -> bool:
        return self.scheduler.finish_request(request_id, status)

    def abort_request(self, request_id: str) -> bool:
        return self.scheduler.abort_request(request_id)

    def take_kv_events(self) -> list[KVCacheEvent]:
        """The prefix cache's and the offload tier's changes since the last call (recorded from
        the first call on)."""
        pool = self.scheduler.kv.block_pool
        pool.record_events = True
        events = pool.take_events()
        return events if self.kv_tier is None else events + self.kv_tier.take_events()

    def kv_cache_snapshot(self) -> list[KVCacheEvent]:
        """Everything the prefix cache and the offload tier hold now, as `stored` events."""
        events = self.scheduler.kv.block_pool.snapshot()
        return events if self.kv_tier is None else events + self.kv_tier.snapshot()

    def _run_prompt_lane(self) -> None:
        """A slice of the prompt lane before the step: what the last step left of the step target
        (at least a quarter of it, so prompts progress), or the whole batch when nothing decodes.
        Requests whose lane batch ended run in this step."""
        lane = self.prompt_lane
        if lane is None:
            return
        if lane.has_work:
            decoding = bool(self.scheduler.running)
            lane.run(prompt_quantum(self.config.step_target_s, self.last_step_s) if decoding else None)
        self.scheduler.update_from_prompt_lane()

    def _turn(self, scheduler_output: SchedulerOutput) -> contextlib.AbstractContextManager[None]:
        """The cores for a step that computes (a step that only reports connector progress needs none)."""
        if self.core_lease is None or scheduler_output.is_empty:
            return contextlib.nullcontext()
        return self.core_lease.turn()
