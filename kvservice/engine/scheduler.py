"""Continuous batching: which requests run this step, and with how many tokens. No torch.

Each step has a token budget (`max_num_batched_tokens`). Decoding requests go first (one
token each), then the next chunks of running prompts, then waiting requests in arrival
order, while the budget, `max_num_seqs` and free blocks allow. While any request decodes,
the prompt tokens of a step are capped too: a step's time grows with its prompt tokens, and
every decoding request waits for the whole step, so the cap bounds the inter-token latency
that arriving prompts cause (`step_budget`: fixed, or sized by measured step time). When a request
needs a block and none is free, the most recently admitted request not yet scheduled in
this step is preempted: its blocks are freed and it is recomputed later from its tokens so far.

A waiting request starts after its longest computed prefix (`prefix_reuse`: the prefix
cache, or a parallel-sampling leader's prompt), always computing at least its last token.
After every step the blocks that computed tokens filled join the prefix cache.

Two collaborators take waiting requests off the ordinary path. With a KV connector
(`RemoteKVLoads`), a request whose prompt KV comes from elsewhere gets its blocks and parks in
WAITING_FOR_REMOTE_KV until the connector reports the load done; only the part past its local
prefix hit is loaded (possibly nothing but the first token). With a prompt lane
(`PromptLanePath`, a colocated worker's), a request's prompt but its last token is computed in
the lane's big batches while it waits in WAITING_FOR_PROMPT_LANE; a step then computes the last.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from kvservice.connector.base import KVConnectorBase
from kvservice.core.kv_cache_manager import KVCacheManager
from kvservice.core.logprobs import TokenLogprobs
from kvservice.core.outputs import (
    EngineCoreOutput,
    KVConnectorOutput,
    ScheduledRequest,
    SchedulerOutput,
    SchedulerStats,
    SpecDecodingStats,
    request_output,
)
from kvservice.core.request import Request, RequestStatus
from kvservice.engine.prefix_reuse import reusable_prefix, start_after_prefix, waits_for_leader
from kvservice.engine.prompt_lane_path import PromptLanePath, PromptLaneQueue
from kvservice.engine.remote_kv_loads import RemoteKVLoads
from kvservice.engine.step_budget import FixedStepBudget, StepBudget
from kvservice.engine.tier_loads import KVTierIO, TierLoads


@dataclass(slots=True)
class _StepPlan:
    """What one `schedule()` has handed out so far."""

    budget: int  # tokens left in the step
    prefill_budget: int  # prompt tokens left while requests decode
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    scheduled_ids: set[str] = field(default_factory=set)
    preempted: set[str] = field(default_factory=set)
    num_prompt_tokens: int = 0

    def add(self, item: ScheduledRequest, is_prefill: bool) -> None:
        self.scheduled.append(item)
        self.scheduled_ids.add(item.request.request_id)
        self.budget -= item.num_new_tokens
        if is_prefill:
            self.prefill_budget -= item.num_new_tokens
            self.num_prompt_tokens += item.num_new_tokens


class Scheduler:
    def __init__(
        self,
        kv_cache_manager: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        connector: KVConnectorBase | None = None,
        kv_load_failure_policy: str = "recompute",
        vocab_size: int | None = None,
        num_lookahead_tokens: int = 0,
        max_prefill_tokens_with_decode: int | None = None,
        step_budget: StepBudget | None = None,
        prompt_lane: PromptLaneQueue | None = None,
        has_draft_model: bool = False,
        kv_tier: KVTierIO | None = None,
    ) -> None:
        self.kv = kv_cache_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        # The prompt tokens of a step while requests decode; a fixed cap (None: the step's budget) unless given.
        self.step_budget = step_budget or FixedStepBudget(max_prefill_tokens_with_decode or max_num_batched_tokens)
        self.connector = connector
        self.kv_load_failure_policy = kv_load_failure_policy
        self.remote_loads = RemoteKVLoads(self.kv, connector, vocab_size) if connector is not None else None
        self.lane_path = PromptLanePath(prompt_lane, self.kv) if prompt_lane is not None else None
        self.tier_loads = TierLoads(self.kv, kv_tier) if kv_tier is not None else None
        # Slots past the scheduled tokens that the draft pass writes (speculative decoding).
        self.num_lookahead_tokens = num_lookahead_tokens
        self.has_draft_model = has_draft_model  # whose prompt KV a load may or may not bring
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # Finished requests whose blocks a transfer or the lane still touches: freed on its report.
        self.pending_free: dict[str, Request] = {}
        self._finished_req_ids: set[str] = set()
        self._pending_outputs: list[EngineCoreOutput] = []
        self.num_finished = 0
        self.num_aborted = 0
        self.num_preemptions = 0
        # Speculative decoding counters.
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.num_verify_steps = 0
        self.num_draft_prompt_tokens_computed = 0
        self.num_draft_prompt_tokens_received = 0
        self.num_draft_prompt_tokens_recomputed = 0

    @property
    def waiting_for_remote_kv(self) -> dict[str, Request]:
        """The requests whose prompt KV a connector is loading."""
        return self.remote_loads.parked if self.remote_loads is not None else {}

    @property
    def num_loading_from_tier(self) -> int:
        """The requests whose prefix the KV offload tier is reading back."""
        return len(self.tier_loads.parked) if self.tier_loads is not None else 0

    @property
    def in_prompt_lane(self) -> dict[str, Request]:
        """The requests whose prompt the prompt lane is computing."""
        return self.lane_path.in_lane if self.lane_path is not None else {}

    # ------------------------------------------------------------ requests in and out

    def add_request(self, request: Request) -> None:
        needed = self.kv.num_blocks_for(request.max_num_tokens)
        if needed > self.kv.num_blocks:
            raise ValueError(
                f"prompt_token_ids: the request needs up to {needed} KV blocks "
                f"({request.max_num_tokens} tokens) but the cache has {self.kv.num_blocks}"
            )
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def abort_request(self, request_id: str) -> bool:
        """Abort a request in any state; returns False if it is unknown or already finished."""
        if not self.finish_request(request_id, RequestStatus.FINISHED_ABORTED):
            return False
        self.num_aborted += 1
        self._pending_outputs.append(EngineCoreOutput(request_id, [], "abort"))
        return True

    def finish_request(self, request_id: str, status: RequestStatus) -> bool:
        """End a request in any state with a finished `status` (the engine matched a stop
        string); its blocks free as on any finish. No output is queued: the caller reports
        the end. Returns False if the request is unknown or already finished."""
        assert status.is_finished, status
        request = self.requests.get(request_id)
        if request is None or request.status.is_finished:
            return False
        if request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            self.waiting.remove(request)
        elif request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status is RequestStatus.WAITING_FOR_REMOTE_KV:
            del self.waiting_for_remote_kv[request_id]
        elif request.status is RequestStatus.WAITING_FOR_KV_TIER:
            assert self.tier_loads is not None
            self.tier_loads.cancel(request_id)  # the read's result goes nowhere: the blocks free now
        self._finish(request, status)
        return True

    @property
    def num_unfinished(self) -> int:
        num_parked = len(self.waiting_for_remote_kv) + len(self.in_prompt_lane) + self.num_loading_from_tier
        return len(self.waiting) + len(self.running) + num_parked

    def has_work(self) -> bool:
        """Whether a step would do anything: requests to run, or transfers to drive."""
        return bool(self.num_unfinished or self.pending_free or self._pending_outputs or self._finished_req_ids)

    def make_stats(self) -> SchedulerStats:
        """The queues, the cache and the counters: the one way they leave the scheduler.
        Requests in the prompt lane or loading from the offload tier count as waiting: their
        prompt is computed (or read back) here."""
        return SchedulerStats(
            num_running_requests=len(self.running),
            num_waiting_requests=len(self.waiting) + len(self.in_prompt_lane) + self.num_loading_from_tier,
            num_waiting_for_remote_kv=len(self.waiting_for_remote_kv),
            num_finished_requests=self.num_finished,
            num_aborted_requests=self.num_aborted,
            num_preemptions=self.num_preemptions,
            num_blocks_total=self.kv.num_blocks,
            num_blocks_free=self.kv.num_free_blocks,
            prefix_cache=self.kv.prefix_cache,
            spec_decoding=SpecDecodingStats(
                self.num_draft_tokens,
                self.num_accepted_tokens,
                self.num_verify_steps,
                self.num_draft_prompt_tokens_computed,
                self.num_draft_prompt_tokens_received,
                self.num_draft_prompt_tokens_recomputed,
            ),
        )

    # ------------------------------------------------------------ the step

    def schedule(self) -> SchedulerOutput:
        decoding = [r for r in self.running if r.num_tokens - r.num_computed_tokens <= 1]
        prefilling = [r for r in self.running if r.num_tokens - r.num_computed_tokens > 1]
        budget = self.max_num_batched_tokens
        plan = _StepPlan(budget, self.step_budget.prompt_tokens(len(decoding)) if decoding else budget)
        for request in [*decoding, *prefilling]:
            self._schedule_running(request, plan)
        # Admit waiting requests only when nothing was preempted: preemption means
        # memory is short, and admitting more would only thrash.
        if not plan.preempted:
            self._admit_waiting(plan)
        output = SchedulerOutput(
            scheduled=plan.scheduled,
            num_scheduled_tokens=self.max_num_batched_tokens - plan.budget,
            num_prompt_tokens=plan.num_prompt_tokens,
            finished_req_ids=self._finished_req_ids,
            preempted_req_ids=plan.preempted,
        )
        self._finished_req_ids = set()
        if self.connector is not None:
            output.kv_connector_metadata = self.connector.build_connector_meta(output)
        return output

    def update_from_output(
        self,
        scheduler_output: SchedulerOutput,
        sampled_token_ids: dict[str, list[int]],
        connector_output: KVConnectorOutput | None = None,
        logprobs: dict[str, list[TokenLogprobs]] | None = None,
        prompt_logprobs: dict[str, list[TokenLogprobs]] | None = None,
        errors: dict[str, str] | None = None,
        num_draft_prompt_tokens: int = 0,
    ) -> list[EngineCoreOutput]:
        """Advance the scheduled requests by the step's results: per sampling request, the
        accepted draft tokens (if any) then one token from the target, with their `logprobs`
        where asked for; `prompt_logprobs` continue what each request has gathered; the
        requests in `errors` fail with their message; the draft model ran over
        `num_draft_prompt_tokens` prompt tokens. Returns the new tokens."""
        outputs, self._pending_outputs = self._pending_outputs, []
        self.num_draft_prompt_tokens_computed += num_draft_prompt_tokens
        logprobs, prompt_logprobs = logprobs or {}, prompt_logprobs or {}
        errors = errors or {}
        for item in scheduler_output.scheduled:
            request = item.request
            if request.status is not RequestStatus.RUNNING:
                continue
            if request.request_id in errors:
                self.running.remove(request)
                outputs.extend(self._fail(request, errors[request.request_id]))
                continue
            request.prompt_logprobs.extend(prompt_logprobs.get(request.request_id, ()))
            token_ids = sampled_token_ids.get(request.request_id)
            if token_ids is None:
                request.num_computed_tokens += item.num_new_tokens
                self.kv.cache_full_blocks(request)
                continue
            outputs.append(self._advance(item, token_ids, logprobs.get(request.request_id)))
        if connector_output is not None and self.remote_loads is not None:
            outputs.extend(self._update_from_connector(connector_output))
        return outputs

    def update_from_tier(self) -> None:
        """Run the requests whose prefix the offload tier has read back, from the end of the
        blocks that arrived valid."""
        if self.tier_loads is None:
            return
        for request, num_computed in self.tier_loads.take_finished():
            if self.remote_loads is not None and self.remote_loads.has_source(request):
                # Its prompt's KV comes from elsewhere too: it waits again, first in line, and its
                # pull starts past the blocks it found (now in the prefix cache, as freed blocks).
                request.num_computed_tokens = num_computed
                self.kv.cache_full_blocks(request)
                self._wait_again(request)
                continue
            self._run_from(request, num_computed)

    def _run_from(self, request: Request, num_computed: int) -> None:
        """A request whose prompt's leading `num_computed` tokens arrived (from a tier or a peer)
        computes the rest."""
        request.num_computed_tokens = num_computed
        self.kv.cache_full_blocks(request)
        request.status = RequestStatus.RUNNING
        self.running.append(request)

    def _wait_again(self, request: Request) -> None:
        """Back to the head of the queue with nothing computed (what it holds stays cached)."""
        self.kv.free(request.request_id)
        request.num_computed_tokens = 0
        request.num_draft_computed_tokens = 0
        request.status = RequestStatus.WAITING
        self.waiting.appendleft(request)

    def update_from_prompt_lane(self) -> None:
        """Run the requests whose lane batch has ended from their last prompt token; free the
        blocks of cancelled ones the lane's forward no longer writes."""
        if self.lane_path is None:
            return
        done, released_ids = self.lane_path.take_finished()
        for request_id in released_ids:
            if (pending := self.pending_free.pop(request_id, None)) is not None:
                self._release(pending)
        for request in done:
            self._resume(request, None)

    # ------------------------------------------------------------ internals: scheduling

    def _schedule_running(self, request: Request, plan: _StepPlan) -> None:
        """The next tokens of a running request (its next chunk, or one token and its drafts)."""
        if plan.budget <= 0 or request.status is not RequestStatus.RUNNING:
            return  # out of budget, or preempted for an earlier request this step
        is_prefill = request.num_tokens - request.num_computed_tokens > 1
        num_new = min(
            request.num_tokens - request.num_computed_tokens,
            plan.budget,
            plan.prefill_budget if is_prefill else plan.budget,
        )
        if num_new <= 0:
            return
        spec = self._take_spec_tokens(request, plan.budget)
        num_new += len(spec)
        block_ids = self.kv.allocate_slots(request, num_new + self._lookahead(request, num_new))
        while block_ids is None:
            victim = next(r for r in reversed(self.running) if r.request_id not in plan.scheduled_ids)
            self.running.remove(victim)
            self._preempt(victim)
            plan.preempted.add(victim.request_id)
            if victim is request:
                return
            block_ids = self.kv.allocate_slots(request, num_new + self._lookahead(request, num_new))
        plan.add(ScheduledRequest(request, num_new, block_ids, spec), is_prefill)

    def _admit_waiting(self, plan: _StepPlan) -> None:
        """Waiting requests in arrival order (past siblings waiting for their leader's prompt),
        while the step's budgets, `max_num_seqs` and free blocks allow."""
        while self.waiting and min(plan.budget, plan.prefill_budget) > 0 and self._has_seq_room():
            request = next((r for r in self.waiting if not waits_for_leader(r, self.kv.block_size)), None)
            if request is None:
                return
            assert request.num_computed_tokens == 0 and not self.kv.get_block_ids(request.request_id)
            cached = reusable_prefix(request, self.kv, self.connector)
            parked = self._park_elsewhere(request, cached)
            if parked is None:
                return  # its KV comes from elsewhere, and the blocks for it are not free yet
            if parked:
                self.waiting.remove(request)
                continue
            num_cached = len(cached) * self.kv.block_size
            num_new = min(request.num_tokens - num_cached, plan.budget, plan.prefill_budget)
            num_lookahead = self._lookahead(request, num_cached + num_new)
            block_ids = self.kv.allocate_slots(request, num_new + num_lookahead, cached)
            if block_ids is None:
                return
            self.waiting.remove(request)
            start_after_prefix(request, self.kv, num_cached)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            plan.add(ScheduledRequest(request, num_new, block_ids), is_prefill=True)

    def _has_seq_room(self) -> bool:
        """Whether another request may start: the parked ones join the running later."""
        num_started = len(self.running) + len(self.waiting_for_remote_kv) + len(self.in_prompt_lane)
        return num_started + self.num_loading_from_tier < self.max_num_seqs

    def _park_elsewhere(self, request: Request, cached: list[int]) -> bool | None:
        """Hand a waiting request's prefix to the offload tier, else its prompt to a connector's
        load, else its prompt to the prompt lane. True if one took it, None if one must but its
        blocks are not free, else False."""
        # The tier first: a decode worker's own store shortens the pull that follows (see update_from_tier).
        if self.tier_loads is not None:
            parked = self.tier_loads.try_park(request, cached)
            if parked is not False:
                return parked
        if self.remote_loads is not None:
            parked = self.remote_loads.try_park(request, cached)
            if parked is not False:
                return parked
        if self.lane_path is not None:
            return self.lane_path.try_enter(request, cached)
        return False

    def _lookahead(self, request: Request, num_new: int) -> int:
        return min(self.num_lookahead_tokens, max(0, request.max_num_tokens - request.num_computed_tokens - num_new))

    def _take_spec_tokens(self, request: Request, budget: int) -> list[int]:
        """The draft tokens to verify this step: only in decode, within the token budget,
        and never more than the request may still emit (the target adds one more)."""
        spec, request.spec_token_ids = request.spec_token_ids, []
        if not spec or request.num_computed_tokens != request.num_tokens - 1:
            return []
        return spec[: max(0, min(request.max_num_tokens - request.num_tokens - 1, budget - 1))]

    def _preempt(self, request: Request) -> None:
        self.kv.free(request.request_id)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_draft_computed_tokens = 0
        request.spec_token_ids = []
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    # ------------------------------------------------------------ internals: results

    def _advance(
        self, item: ScheduledRequest, token_ids: list[int], logprobs: list[TokenLogprobs] | None
    ) -> EngineCoreOutput:
        """Append a sampling request's new tokens (accepted drafts, then the target's) up to a
        stop, with their `logprobs` where asked for."""
        request = item.request
        num_spec = len(item.spec_token_ids)
        # The KV of the accepted draft tokens is valid; that of rejected ones is not.
        request.num_computed_tokens += item.num_new_tokens - num_spec + len(token_ids) - 1
        self.kv.cache_full_blocks(request)
        if num_spec:
            self.num_draft_tokens += num_spec
            self.num_accepted_tokens += len(token_ids) - 1
            self.num_verify_steps += 1
        appended: list[int] = []
        status = None
        for token_id in token_ids:
            request.append_output_token(token_id)
            appended.append(token_id)
            status = request.check_stop()
            if status is not None:
                break
        is_first = request.num_output_tokens == len(appended)
        if status is not None:
            self.running.remove(request)
            self._finish(request, status)
        return request_output(request, appended, status, logprobs and logprobs[: len(appended)], is_first)

    def _update_from_connector(self, output: KVConnectorOutput) -> list[EngineCoreOutput]:
        assert self.remote_loads is not None
        loads = self.remote_loads.take_finished(output, self.pending_free)
        for request_id in loads.released_ids:
            self._release(self.pending_free.pop(request_id))
        outputs: list[EngineCoreOutput] = []
        for request, first_token in loads.resumed:
            if self.has_draft_model:
                self._count_draft_prompt_kv(request, request.request_id in loads.with_draft_kv)
            outputs.extend(self._resume(request, first_token))
            if request.request_id in loads.with_draft_kv:
                request.num_draft_computed_tokens = request.num_prompt_tokens  # it came with the pull
        for request in loads.failed:
            outputs.extend(self._handle_load_failure(request))
        for request, num_loaded in loads.prefixes:
            self._run_from(request, num_loaded)
        for request in loads.prefixes_failed:
            self._wait_again(request)
        return outputs

    def _count_draft_prompt_kv(self, request: Request, is_received: bool) -> None:
        """A load's draft KV: its pulled prompt tokens' came with it, or the draft computes the
        whole prompt here."""
        if is_received:
            self.num_draft_prompt_tokens_received += request.num_prompt_tokens - request.num_cached_tokens
        else:
            self.num_draft_prompt_tokens_recomputed += request.num_prompt_tokens

    def _resume(self, request: Request, first_token: int | None) -> list[EngineCoreOutput]:
        """The prompt's KV is in place: continue from the first token a prefill sampled or,
        without one (the prompt lane computes all tokens but the last), from the last token,
        whose logits give the next one."""
        request.num_computed_tokens = request.num_tokens - (first_token is None)
        request.num_draft_computed_tokens = 0  # the draft's KV is recomputed here
        self.kv.cache_full_blocks(request)
        status = None
        if first_token is not None:
            request.append_output_token(first_token)
            status = request.check_stop()
        if status is not None:
            self._finish(request, status)
        else:
            request.status = RequestStatus.RUNNING
            self.running.append(request)
        if first_token is None:
            return []
        # The first token's logprobs (and the prompt's) are the prefill worker's to report.
        return [request_output(request, [first_token], status, None, is_first=True)]

    def _handle_load_failure(self, request: Request) -> list[EngineCoreOutput]:
        if self.kv_load_failure_policy == "recompute":
            # Start over as a local prefill: the loaded blocks hold nothing valid, and the
            # cached prefix it shares may end where the prompt does, but its last token
            # must now be computed (never into a shared block).
            self._wait_again(request)
            return []
        return self._fail(
            request, "loading the prompt's KV from the prefill worker failed (kv_load_failure_policy=fail)"
        )

    def _finish(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        self._finished_req_ids.add(request.request_id)
        if status is not RequestStatus.FINISHED_ABORTED:
            self.num_finished += 1
        delay_free = False
        if self.lane_path is not None and request.request_id in self.lane_path.in_lane:
            delay_free = self.lane_path.cancel(request.request_id)
        if self.connector is not None:
            delay_connector, _ = self.connector.request_finished(request, self.kv.get_block_ids(request.request_id))
            delay_free = delay_free or delay_connector
        if delay_free:
            self.pending_free[request.request_id] = request
        else:
            self._release(request)

    def _release(self, request: Request) -> None:
        self.kv.free(request.request_id)
        self.requests.pop(request.request_id, None)

    def _fail(self, request: Request, error: str) -> list[EngineCoreOutput]:
        """End a request (already out of its queue) with an error its caller sees."""
        request.error = error
        self._finish(request, RequestStatus.FINISHED_ERROR)
        return [EngineCoreOutput(request.request_id, [], "error", error)]
