"""The proxy's picture of one worker's prefix cache, kept from its KV event batches. No grpc calls.

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


@dataclass(slots=True)
class KVBlockIndex:
    block_hashes: set[int] = field(default_factory=set)
    block_size: int = 0  # 0: nothing heard from the worker yet
    hash_seed: int = 0
    last_seq: int = 0
    is_synced: bool = False  # a snapshot was applied and no batch went missing since

    def apply(self, batch: pb.KVEventBatch) -> bool:
        """Apply one batch; False (nothing changes, the picture is stale) when it does not
        follow the last one applied: resubscribe from 0."""
        if batch.is_snapshot:
            self.block_hashes = set()
        elif not self.is_synced or batch.seq != self.last_seq + 1:
            self.is_synced = False
            return False
        for event in batch.events:
            if event.HasField("stored"):
                self.block_hashes.update(event.stored.block_hashes)
            else:
                self.block_hashes.difference_update(event.removed.block_hashes)
        self.block_size, self.hash_seed = batch.block_size, batch.hash_seed
        self.last_seq = batch.seq
        self.is_synced = True
        return True

    def num_cached_blocks(self, hashes: Sequence[int]) -> int:
        """How many leading blocks of a prompt (its block hashes) the worker holds: a lookup
        stops at the first miss, as the worker's own does."""
        for i, block_hash in enumerate(hashes):
            if block_hash not in self.block_hashes:
                return i
        return len(hashes)

    def num_cached_tokens(self, token_ids: Sequence[int], hashes_cache: dict[tuple[int, int], list[int]]) -> int:
        """Tokens of `token_ids` the worker holds as a cached prefix (0 before its first batch).
        `hashes_cache` keeps the prompt's hashes per (block size, seed) across workers."""
        if not self.block_size:
            return 0
        key = (self.block_size, self.hash_seed)
        hashes = hashes_cache.get(key)
        if hashes is None:
            hashes = hashes_cache[key] = block_hashes(token_ids, self.block_size, self.hash_seed)
        return self.num_cached_blocks(hashes) * self.block_size
