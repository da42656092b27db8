"""Per-request block tables over one `BlockPool`. No torch.

A request's block table covers its first `len(block_ids) * block_size` token slots;
`allocate_slots` grows it before a step writes new tokens.
"""

from __future__ import annotations

from kvservice.block_pool import BlockPool
from kvservice.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.block_pool = BlockPool(num_blocks)
        self.block_tables: dict[str, list[int]] = {}

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    def num_blocks_for(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def allocate_slots(self, request: Request, num_new_tokens: int) -> list[int] | None:
        """Make room for tokens up to `num_computed_tokens + num_new_tokens`.

        Returns the request's whole block table, or None (and changes nothing) when
        the pool has too few free blocks.
        """
        table = self.block_tables.setdefault(request.request_id, [])
        needed = self.num_blocks_for(request.num_computed_tokens + num_new_tokens) - len(table)
        if needed > 0:
            new_blocks = self.block_pool.allocate(needed)
            if new_blocks is None:
                if not table:
                    del self.block_tables[request.request_id]
                return None
            table.extend(new_blocks)
        return table

    def get_block_ids(self, request_id: str) -> list[int]:
        return self.block_tables.get(request_id, [])

    def free(self, request_id: str) -> None:
        """Return all of a request's blocks to the pool (idempotent)."""
        table = self.block_tables.pop(request_id, None)
        if table:
            # Free in reverse so a request's tail blocks are evicted first once hashed.
            self.block_pool.free(table[::-1])
