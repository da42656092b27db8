"""Where a waiting request starts: the leading blocks of its tokens that are already
computed, so it shares them instead of computing them again. No torch.

Two sources: the prefix cache (automatic prefix caching), and for a sibling of a
parallel-sampling request (`n` > 1), its leader's prompt blocks, shared by reference
count whether caching is on or not. A sibling waits until its leader has computed those
blocks, so the prompt runs once, whatever `n` is.
"""

from __future__ import annotations

from kvservice.connector.base import KVConnectorBase
from kvservice.core.kv_cache_manager import KVCacheManager
from kvservice.core.request import Request, RequestStatus


def reusable_prefix(request: Request, kv: KVCacheManager, connector: KVConnectorBase | None) -> list[int]:
    """The blocks of the request's longest computed prefix. Its last token is computed here
    (its logits give the first token) unless a remote prefill sends that token."""
    remote_first_token = connector is not None and connector.supplies_first_token(request)
    if request.needs_prompt_logprobs and not remote_first_token:
        return []  # every prompt position it reports must be computed here
    max_tokens = request.num_prompt_tokens if remote_first_token else request.num_tokens - 1
    cached = kv.find_cached_prefix(request, max_tokens)
    leader = request.leader
    if leader is not None and leader.status is RequestStatus.RUNNING:
        # The leader's leading blocks hold the same prompt; it never writes into full ones.
        num_shared = min(leader.num_computed_tokens, max_tokens) // kv.block_size
        if num_shared > len(cached):
            return kv.get_block_ids(leader.request_id)[:num_shared]
    return cached


def waits_for_leader(request: Request, block_size: int) -> bool:
    """Whether a parallel-sampling sibling should wait before it starts: its leader is
    alive and has not computed the prompt blocks the sibling would share yet."""
    leader = request.leader
    if leader is None or leader.status.is_finished:
        return False
    if leader.status is not RequestStatus.RUNNING:
        return True  # waiting, preempted, or its prompt's KV still arriving from a prefill worker
    return leader.num_computed_tokens < (request.num_prompt_tokens - 1) // block_size * block_size


def start_after_prefix(request: Request, kv: KVCacheManager, num_cached: int) -> None:
    """The request got its blocks: it starts after its `num_cached` reused prompt tokens."""
    request.num_computed_tokens = num_cached
    request.num_cached_tokens = num_cached
    kv.record_lookup(request.num_tokens, num_cached)
