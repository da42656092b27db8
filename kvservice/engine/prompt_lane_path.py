"""The scheduler's path into a colocated worker's prompt lane (`kvservice.worker.prompt_lane`). No torch.

A waiting request the lane can take gets blocks for all its tokens past its prefix-cache hit,
queues in the lane for every token but the last, and waits in WAITING_FOR_PROMPT_LANE. When
its lane batch ends, it runs from its last prompt token in an ordinary step, whose logits give
the first token, so every sampling option applies. The lane does not take requests that report
the prompt's logprobs (every position's logits), parallel-sampling siblings (they share their
leader's prompt blocks) and those with nothing to compute but their last token.

This is the scheduler's own path, not a KV connector: a colocated worker may hold a real
connector (a KV source) beside its lane.
"""

from __future__ import annotations

from typing import Protocol

from kvservice.core.kv_cache_manager import KVCacheManager
from kvservice.core.outputs import LanePrompt
from kvservice.core.request import Request, RequestStatus
from kvservice.engine.prefix_reuse import start_after_prefix


class PromptLaneQueue(Protocol):
    """What the scheduler asks of the worker's lane (`PromptLane`)."""

    def add(self, prompt: LanePrompt) -> None: ...

    def cancel(self, request_id: str) -> bool | None: ...

    def take_finished(self) -> set[str]: ...


class PromptLanePath:
    """The requests whose prompt the lane computes, and their way in and out."""

    def __init__(self, lane: PromptLaneQueue, kv: KVCacheManager) -> None:
        self.lane = lane
        self.kv = kv
        self.in_lane: dict[str, Request] = {}

    def try_enter(self, request: Request, cached: list[int]) -> bool | None:
        """Queue a waiting request's prompt (past its cached prefix, all but its last token) in
        the lane. True if it entered, None if it may but its blocks are not free, else False."""
        num_cached = len(cached) * self.kv.block_size
        num_tokens = request.num_tokens - 1 - num_cached
        if num_tokens <= 0 or request.needs_prompt_logprobs or request.leader is not None:
            return False
        block_ids = self.kv.allocate_slots(request, num_tokens, cached)
        if block_ids is None:
            return None
        start_after_prefix(request, self.kv, num_cached)
        token_ids = request.all_token_ids[num_cached : num_cached + num_tokens]
        self.lane.add(LanePrompt(request.request_id, token_ids, num_cached, list(block_ids)))
        request.status = RequestStatus.WAITING_FOR_PROMPT_LANE
        self.in_lane[request.request_id] = request
        return True

    def cancel(self, request_id: str) -> bool:
        """Drop a finished request from the lane; True if freeing its blocks must wait for the
        lane's running forward, which still writes them (`take_finished` then reports it)."""
        self.in_lane.pop(request_id, None)
        return self.lane.cancel(request_id) is False

    def take_finished(self) -> tuple[list[Request], set[str]]:
        """The requests whose prompt KV is now in the cache, and the ids of cancelled requests
        whose blocks the lane no longer writes."""
        finished = self.lane.take_finished()
        done = [request for r in finished if (request := self.in_lane.pop(r, None)) is not None]
        return done, finished - {r.request_id for r in done}
