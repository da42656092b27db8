"""Per-request block tables over one `BlockPool`, and the prefix cache's lookups. No torch.

A request's block table covers its first `len(block_ids) * block_size` token slots;
`allocate_slots` grows it before a step writes new tokens. With prefix caching, a new
request first looks up its longest cached prefix (`find_cached_prefix`), shares those
blocks, and computes only the rest; after each step `cache_full_blocks` makes the
blocks its computed tokens filled findable (prompt and output alike, so a
conversation's next turn finds the last answer).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from kvservice.core.block_hash import extend_block_hashes, hash_seed
from kvservice.core.block_pool import BlockPool
from kvservice.core.outputs import PrefixCacheStats
from kvservice.core.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True, seed: int | None = None) -> None:
        self.block_size = block_size
        self.block_pool = BlockPool(num_blocks, enable_caching)
        # The parent of every first block: folds the model and dtype into the keys.
        self.hash_seed = seed if seed is not None else hash_seed("kvservice")
        self.block_tables: dict[str, list[int]] = {}
        self._num_cached_blocks: dict[str, int] = {}  # leading blocks of a table already cached
        self.prefix_cache = PrefixCacheStats()

    @property
    def enable_caching(self) -> bool:
        return self.block_pool.enable_caching

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    def num_blocks_for(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def block_hashes(self, request: Request) -> list[int]:
        """The keys of the request's full blocks (kept on the request, extended as it grows)."""
        return extend_block_hashes(request.block_hashes, request.all_token_ids, self.block_size, self.hash_seed)

    def find_cached_prefix(self, request: Request, max_tokens: int) -> list[int]:
        """The blocks holding the longest cached prefix of the request's tokens, at most
        `max_tokens` of them (whole blocks). Nothing is taken yet: pass them to `allocate_slots`."""
        if not self.enable_caching:
            return []
        return self.cached_run(self.block_hashes(request)[: max_tokens // self.block_size])

    def cached_run(self, block_hashes: Sequence[int]) -> list[int]:
        """The cached blocks of the longest leading run of `block_hashes` (none without caching)."""
        hit: list[int] = []
        if not self.enable_caching:
            return hit
        for block_hash in block_hashes:
            block_id = self.block_pool.get_cached_block(block_hash)
            if block_id is None:
                break
            hit.append(block_id)
        return hit

    def allocate_slots(
        self, request: Request, num_new_tokens: int, cached_blocks: list[int] | None = None
    ) -> list[int] | None:
        """Make room for tokens up to `num_computed_tokens + num_new_tokens`, past the
        `cached_blocks` (a prefix hit for a request without blocks: shared, not computed).

        Returns the request's whole block table, or None (and changes nothing) when
        the pool has too few free blocks.
        """
        cached_blocks = cached_blocks or []
        table = self.block_tables.get(request.request_id, [])
        assert not (cached_blocks and table), "a prefix hit is only taken by a request without blocks"
        num_tokens = request.num_computed_tokens + len(cached_blocks) * self.block_size + num_new_tokens
        needed = self.num_blocks_for(num_tokens) - len(table) - len(cached_blocks)
        # Hit blocks nobody uses sit in the free queue: sharing them takes them out of it.
        num_hit_free = sum(1 for b in cached_blocks if self.block_pool.is_free(b))
        if needed > self.block_pool.num_free_blocks - num_hit_free:
            return None
        if cached_blocks:
            self.block_pool.touch(cached_blocks)
            self._num_cached_blocks[request.request_id] = len(cached_blocks)
        table = self.block_tables.setdefault(request.request_id, table)
        table.extend(cached_blocks)
        if needed > 0:
            new_blocks = self.block_pool.allocate(needed)
            assert new_blocks is not None
            table.extend(new_blocks)
        return table

    def record_lookup(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        """Count one admitted request's prefix lookup (its prompt, and the tokens found)."""
        stats = self.prefix_cache
        self.prefix_cache = PrefixCacheStats(stats.queries + num_query_tokens, stats.hits + num_hit_tokens)

    def cache_full_blocks(self, request: Request) -> None:
        """Make the blocks that the request's computed tokens fill findable by their hash."""
        if not self.enable_caching:
            return
        num_full = min(request.num_computed_tokens, request.num_tokens) // self.block_size
        start = self._num_cached_blocks.get(request.request_id, 0)
        if num_full <= start:
            return
        table = self.block_tables[request.request_id]
        hashes = self.block_hashes(request)
        for i in range(start, num_full):
            self.block_pool.cache_block(table[i], hashes[i], hashes[i - 1] if i else self.hash_seed)
        self._num_cached_blocks[request.request_id] = num_full

    def requests_holding(self, block_ids: set[int], request_ids: Iterable[str]) -> set[str]:
        """Those of `request_ids` whose block tables hold any of `block_ids`."""
        if not block_ids:
            return set()
        return {r for r in request_ids if block_ids.intersection(self.block_tables.get(r, ()))}

    def get_block_ids(self, request_id: str) -> list[int]:
        return self.block_tables.get(request_id, [])

    def free(self, request_id: str) -> None:
        """Return all of a request's blocks to the pool (idempotent)."""
        self._num_cached_blocks.pop(request_id, None)
        table = self.block_tables.pop(request_id, None)
        if table:
            # Free in reverse: a request's tail blocks are evicted before its head.
            self.block_pool.free(table[::-1])
