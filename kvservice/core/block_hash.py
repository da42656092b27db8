"""Prefix-cache keys: a hash per full KV block, chained over the blocks before it. No torch.

Block i's hash covers (block i-1's hash, block i's token ids), and block 0's parent is a
seed that folds in what else decides the KV (the model, the dtype). Equal hashes thus
mean equal prefixes, on the same model. The functions are deterministic across
processes (blake2b, not Python's salted `hash`), so the proxy, which only has the
tokenizer, computes the same keys as the workers it routes to.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

# Hashes are unsigned 64-bit (a protobuf uint64). Zero is never a block's hash.
HASH_BYTES = 8


def hash_seed(*extra_keys: str) -> int:
    """The parent of a sequence's first block: one value per (model, dtype, ...)."""
    digest = hashlib.blake2b("\x00".join(extra_keys).encode(), digest_size=HASH_BYTES, person=b"kvs-seed").digest()
    return int.from_bytes(digest, "little") or 1


def hash_block_tokens(parent_hash: int, token_ids: Sequence[int]) -> int:
    """The key of one full block: its parent's key and its token ids."""
    h = hashlib.blake2b(parent_hash.to_bytes(HASH_BYTES, "little"), digest_size=HASH_BYTES, person=b"kvs-blk")
    h.update(array("q", token_ids).tobytes())
    return int.from_bytes(h.digest(), "little") or 1


def extend_block_hashes(hashes: list[int], token_ids: Sequence[int], block_size: int, seed: int) -> list[int]:
    """Append to `hashes` (the keys of the first len(hashes) blocks of `token_ids`) the keys
    of the remaining full blocks; returns `hashes`. Incremental: a growing sequence pays
    only for its new blocks."""
    parent = hashes[-1] if hashes else seed
    for start in range(len(hashes) * block_size, len(token_ids) - block_size + 1, block_size):
        parent = hash_block_tokens(parent, token_ids[start : start + block_size])
        hashes.append(parent)
    return hashes


def block_hashes(token_ids: Sequence[int], block_size: int, seed: int) -> list[int]:
    """The keys of every full block of `token_ids` (a partial last block has none)."""
    return extend_block_hashes([], token_ids, block_size, seed)
