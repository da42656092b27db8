"""Prefixes loaded back from the KV offload tier: the scheduler's collaborator. No torch.

A waiting request whose prefix continues, past its prefix-cache hit, in blocks the tier holds
gets its blocks and waits in WAITING_FOR_KV_TIER while the tier reads them (off the step loop).
When the read is done it runs from the end of the blocks that arrived valid: a block the tier
dropped (corrupt, evicted meanwhile) and everything after it is computed as usual.
"""

from __future__ import annotations

from typing import Protocol

from kvservice.core.block_pool import KVCacheEvent
from kvservice.core.kv_cache_manager import KVCacheManager
from kvservice.core.request import Request, RequestStatus
from kvservice.engine.prefix_reuse import start_after_prefix


class KVTierIO(Protocol):
    """What the engine asks of the tier (`kvservice.connector.offload_tier.OffloadTier`): the
    core saves each step's evicted blocks, the scheduler loads (the builder also registers the
    caches: `engine_builder.KVTier`)."""

    def save(self, evicted: list[tuple[int, int]]) -> None: ...

    def contains(self, block_hash: int) -> bool: ...

    def start_load(self, request_id: str, block_hashes: list[int], block_ids: list[int]) -> None: ...

    def take_finished(self) -> dict[str, int]: ...

    def cancel(self, request_id: str) -> None: ...

    def take_events(self) -> list[KVCacheEvent]: ...

    def snapshot(self) -> list[KVCacheEvent]: ...


class TierLoads:
    """The requests in WAITING_FOR_KV_TIER, each with the first block its load fills."""

    def __init__(self, kv: KVCacheManager, tier: KVTierIO) -> None:
        self.kv = kv
        self.tier = tier
        self.parked: dict[str, tuple[Request, int]] = {}

    def try_park(self, request: Request, cached: list[int]) -> bool | None:
        """Load the blocks after the request's cached prefix that the tier holds (never its last
        token's: it is computed here). True if parked, None if its blocks are not free, else False."""
        if (
            request.has_asked_kv_tier
            or request.needs_prompt_logprobs
            or request.leader is not None
            or not self.kv.enable_caching
        ):
            return False
        request.has_asked_kv_tier = True
        bs = self.kv.block_size
        hashes = self.kv.block_hashes(request)
        first = len(cached)
        last = min(len(hashes), (request.num_tokens - 1) // bs)
        num_found = 0
        while first + num_found < last and self.tier.contains(hashes[first + num_found]):
            num_found += 1
        if num_found == 0:
            return False
        block_ids = self.kv.allocate_slots(request, num_found * bs, cached)
        if block_ids is None:
            return None
        start_after_prefix(request, self.kv, first * bs)
        span = slice(first, first + num_found)
        self.tier.start_load(request.request_id, hashes[span], block_ids[span])
        request.status = RequestStatus.WAITING_FOR_KV_TIER
        self.parked[request.request_id] = (request, first)
        return True

    def cancel(self, request_id: str) -> None:
        if self.parked.pop(request_id, None) is not None:
            self.tier.cancel(request_id)

    def take_finished(self) -> list[tuple[Request, int]]:
        """The loads done: each request with its tokens now computed (its cached prefix and the
        valid blocks that arrived)."""
        done: list[tuple[Request, int]] = []
        for request_id, num_valid in self.tier.take_finished().items():
            parked = self.parked.pop(request_id, None)
            if parked is not None:
                request, first = parked
                done.append((request, (first + num_valid) * self.kv.block_size))
        return done
