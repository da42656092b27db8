"""The pool of fixed-size KV cache blocks: a free queue and reference counts. No torch.

Blocks are shared through reference counts, so automatic prefix caching can slot in:
a full block will carry `block_hash` (chained over its tokens) and stay findable while
it sits in the free queue, evicted least-recently-freed first. The pool records
`KVCacheEvent`s (stored / removed) for a prefix-aware router to consume.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass(slots=True)
class KVCacheBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: int | None = None


@dataclass(frozen=True, slots=True)
class KVCacheEvent:
    """A change a prefix-aware router cares about: a hashed block stored or removed."""

    kind: str  # "stored" | "removed"
    block_hashes: tuple[int, ...]


class BlockPool:
    """Hands out blocks and takes them back; `num_free_blocks` is exact at all times."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be > 0, got {num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        # Insertion order is eviction order: the least recently freed block goes first.
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._events: list[KVCacheEvent] = []

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def allocate(self, num_blocks: int) -> list[int] | None:
        """Take `num_blocks` free blocks (ref count 1), or None (nothing taken) if too few are free."""
        if num_blocks > len(self._free):
            return None
        block_ids = []
        for _ in range(num_blocks):
            block_id, _ = self._free.popitem(last=False)
            block = self.blocks[block_id]
            if block.block_hash is not None:
                self._events.append(KVCacheEvent("removed", (block.block_hash,)))
                block.block_hash = None
            block.ref_cnt = 1
            block_ids.append(block_id)
        return block_ids

    def touch(self, block_ids: list[int]) -> None:
        """Share blocks (a prefix cache hit): one more reference each."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_cnt == 0:
                del self._free[block_id]
            block.ref_cnt += 1

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference each; a block whose count reaches zero returns to the free queue."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            assert block.ref_cnt > 0, f"double free of block {block_id}"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block_id] = None

    def take_events(self) -> list[KVCacheEvent]:
        events, self._events = self._events, []
        return events
