"""The proxy's picture of one worker's prefix cache and offload tier, kept from its KV event batches.
No grpc calls.

A snapshot batch replaces the picture; every other batch must carry the next number, or
events were lost and the subscriber resubscribes for a snapshot. Batches also carry the
worker's block size and hash seed: a prompt hashed with them (`kvservice.core.block_hash`)
matches the worker's keys exactly.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kvservice.core.block_hash import block_hashes
from kvservice.v1 import kvservice_pb2 as pb


@dataclass(frozen=True, slots=True)
class PrefixLocation:
    """Where a worker holds a prompt's leading blocks, as it would find them: a run in its KV
    cache, then, past the first block the cache misses, a run in its offload tier."""

    num_cached_tokens: int
    num_offloaded_tokens: int

    @property
    def num_held_tokens(self) -> int:
        return self.num_cached_tokens + self.num_offloaded_tokens


NOWHERE = PrefixLocation(0, 0)


@dataclass(slots=True)
class KVBlockIndex:
    block_hashes: set[int] = field(default_factory=set)  # in the worker's KV cache
    offload_hashes: set[int] = field(default_factory=set)  # in its offload tier
    block_size: int = 0  # 0: nothing heard from the worker yet
    hash_seed: int = 0
    last_seq: int = 0
    is_synced: bool = False  # a snapshot was applied and no batch went missing since

    def apply(self, batch: pb.KVEventBatch) -> bool:
        """Apply one batch; False (nothing changes, the picture is stale) when it does not
        follow the last one applied: resubscribe from 0."""
        if batch.is_snapshot:
            self.block_hashes, self.offload_hashes = set(), set()
        elif not self.is_synced or batch.seq != self.last_seq + 1:
            self.is_synced = False
            return False
        for event in batch.events:
            hashes = self.offload_hashes if event.tier == pb.KV_TIER_OFFLOAD else self.block_hashes
            if event.HasField("stored"):
                hashes.update(event.stored.block_hashes)
            else:
                hashes.difference_update(event.removed.block_hashes)
        self.block_size, self.hash_seed = batch.block_size, batch.hash_seed
        self.last_seq = batch.seq
        self.is_synced = True
        return True

    def locate_blocks(self, hashes: Sequence[int]) -> tuple[int, int]:
        """How many leading blocks of a prompt (its block hashes) the worker's cache holds, and
        how many after them its offload tier holds: each run stops at its first miss, as the
        worker's own lookups do."""
        num_cached = _run_length(hashes, 0, self.block_hashes)
        return num_cached, _run_length(hashes, num_cached, self.offload_hashes)

    def locate(self, token_ids: Sequence[int], hashes_cache: dict[tuple[int, int], list[int]]) -> PrefixLocation:
        """Where the worker holds `token_ids`' leading blocks (nowhere before its first batch).
        `hashes_cache` keeps the prompt's hashes per (block size, seed) across workers."""
        if not self.block_size:
            return NOWHERE
        key = (self.block_size, self.hash_seed)
        hashes = hashes_cache.get(key)
        if hashes is None:
            hashes = hashes_cache[key] = block_hashes(token_ids, self.block_size, self.hash_seed)
        num_cached, num_offloaded = self.locate_blocks(hashes)
        return PrefixLocation(num_cached * self.block_size, num_offloaded * self.block_size)


def _run_length(hashes: Sequence[int], start: int, held: set[int]) -> int:
    """How many of `hashes` from `start` on are in `held`, up to the first that is not."""
    for i in range(start, len(hashes)):
        if hashes[i] not in held:
            return i - start
    return len(hashes) - start
