"""The pool of fixed-size KV cache blocks: free queues, reference counts, the prefix cache. No torch.

Automatic prefix caching lives here. A full block whose KV is computed gets a hash
(chained over its tokens, `kvservice.core.block_hash`) and stays findable by it, in use or
not: requests that share a prefix share its blocks through reference counts. A cached
block whose count drops to zero keeps its KV and waits in an LRU queue; it is evicted
(its hash forgotten) only when no never-cached free block is left, least recently
freed first. Each change to what is cached is recorded as a `KVCacheEvent`, which is
how a prefix-aware router learns what this worker holds.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

# Where a block lives, as KV events say: a worker's KV cache, or its offload tier.
CACHE_TIER, OFFLOAD_TIER = "cache", "offload"


@dataclass(slots=True)
class KVCacheBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: int | None = None
    parent_hash: int = 0  # the hash of the block before it (the seed for a first block)


@dataclass(frozen=True, slots=True)
class KVCacheEvent:
    """A change a prefix-aware router cares about. `stored`: a chain of blocks, each the
    parent of the next, the first one's parent `parent_hash`; `removed`: evicted blocks.
    `tier`: where: the KV cache, or the offload tier under it (whose blocks a worker loads
    back instead of computing them; stored there in any order, so no chain)."""

    kind: str  # "stored" | "removed"
    block_hashes: tuple[int, ...]
    parent_hash: int = 0
    tier: str = CACHE_TIER


class BlockPool:
    """Hands out blocks and takes them back; `num_free_blocks` (never-cached plus cached
    but unused) is exact at all times."""

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be > 0, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        # Free blocks without a hash: handed out first, in any order.
        self._free_plain: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        # Free blocks with a hash, least recently freed first: evicted in that order.
        self._free_cached: OrderedDict[int, None] = OrderedDict()
        self._cached: dict[int, int] = {}  # block hash -> block id
        # Events are kept only once someone takes them (a worker publishing them).
        self.record_events = False
        self._events: list[KVCacheEvent] = []
        # Evicted (block hash, block id) pairs, kept for an offload tier to save before the
        # blocks are written again (`take_evicted`), when one is attached.
        self.record_evictions = False
        self._evicted: list[tuple[int, int]] = []

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_plain) + len(self._free_cached)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def allocate(self, num_blocks: int) -> list[int] | None:
        """Take `num_blocks` free blocks (ref count 1), or None (nothing taken) if too few are free."""
        if num_blocks > self.num_free_blocks:
            return None
        block_ids = []
        for _ in range(num_blocks):
            if self._free_plain:
                block_id, _ = self._free_plain.popitem(last=False)
            else:
                block_id, _ = self._free_cached.popitem(last=False)
                self._evict(self.blocks[block_id])
            self.blocks[block_id].ref_cnt = 1
            block_ids.append(block_id)
        return block_ids

    def get_cached_block(self, block_hash: int) -> int | None:
        """The block holding the KV of the block keyed `block_hash`, if cached."""
        return self._cached.get(block_hash)

    def is_free(self, block_id: int) -> bool:
        return self.blocks[block_id].ref_cnt == 0

    def touch(self, block_ids: list[int]) -> None:
        """Share blocks (a prefix cache hit): one more reference each."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_cnt == 0:
                (self._free_plain if block.block_hash is None else self._free_cached).pop(block_id)
            block.ref_cnt += 1

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference each; a block whose count reaches zero becomes free (still
        findable by its hash until evicted)."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            assert block.ref_cnt > 0, f"double free of block {block_id}"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    self._free_plain[block_id] = None
                else:
                    self._free_cached[block_id] = None

    def cache_block(self, block_id: int, block_hash: int, parent_hash: int) -> bool:
        """Make a full, computed, in-use block findable by `block_hash`. False (nothing
        changes) when caching is off or another block already holds that hash."""
        block = self.blocks[block_id]
        assert block.ref_cnt > 0 and block.block_hash is None, f"block {block_id} cannot be cached"
        if not self.enable_caching or block_hash in self._cached:
            return False
        block.block_hash, block.parent_hash = block_hash, parent_hash
        self._cached[block_hash] = block_id
        if not self.record_events:
            return True
        last = self._events[-1] if self._events else None
        if last is not None and last.kind == "stored" and last.block_hashes[-1] == parent_hash:
            # Extend the chain the last event stored (one event per request and step).
            self._events[-1] = KVCacheEvent("stored", (*last.block_hashes, block_hash), last.parent_hash)
        else:
            self._events.append(KVCacheEvent("stored", (block_hash,), parent_hash))
        return True

    def _evict(self, block: KVCacheBlock) -> None:
        assert block.block_hash is not None
        del self._cached[block.block_hash]
        if self.record_evictions:
            self._evicted.append((block.block_hash, block.block_id))
        if self.record_events:
            last = self._events[-1] if self._events else None
            if last is not None and last.kind == "removed":
                self._events[-1] = KVCacheEvent("removed", (*last.block_hashes, block.block_hash))
            else:
                self._events.append(KVCacheEvent("removed", (block.block_hash,)))
        block.block_hash = None
        block.parent_hash = 0

    def take_evicted(self) -> list[tuple[int, int]]:
        """The (block hash, block id) of each block evicted since the last call: their KV is still
        in place until the step that reuses the blocks runs."""
        evicted, self._evicted = self._evicted, []
        return evicted

    def take_events(self) -> list[KVCacheEvent]:
        """The events since the last call, in the order they happened."""
        events, self._events = self._events, []
        return events

    def snapshot(self) -> list[KVCacheEvent]:
        """Everything cached now, as `stored` events (one per block): what a router that
        lost track starts from. Events not yet taken may repeat what it shows: each event
        sets one hash's presence, so applying them after it in order ends in the same state."""
        return [
            KVCacheEvent("stored", (block_hash,), self.blocks[block_id].parent_hash)
            for block_hash, block_id in self._cached.items()
        ]
