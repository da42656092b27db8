"""The source half of a peer pull: stage the leading blocks of a prompt that this worker's KV
cache holds, so that another worker pulls them instead of computing them (`Worker.ExportKV`).

Any role answers it. The blocks are found by the prompt's chained block hashes, the same keys
as prefix caching, and copied into a transfer of the worker's `TransferRegistry` under the
caller's token; the puller then reads them over `KVTransfer.PullKV` like a prefill's KV, with
every chunk validated. Runs on the engine thread between steps: a cached block is immutable,
and nothing can evict or reuse it while the copy runs. The prompt's last token is never
exported (the puller computes it: its logits give the next token), and a worker that runs a
speculative draft exports nothing (its cached blocks carry no draft KV to send).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvservice.connector.transfer_errors import StagingExhausted, TransferDenied
from kvservice.connector.transfer_registry import TransferRegistry
from kvservice.core.block_hash import block_hashes
from kvservice.core.kv_cache_manager import KVCacheManager

logger = logging.getLogger(__name__)

# The done frame's first token of an export: no token was sampled (the puller reads none).
NO_FIRST_TOKEN = -1
# Blocks per staged chunk: each layer's run of blocks is sent in pieces of at most this many.
BLOCKS_PER_CHUNK = 16


@dataclass(frozen=True, slots=True)
class ExportedPrefix:
    """What an export staged: the prompt's first `num_tokens` (whole blocks), and the chained
    hash of the last of those blocks, which the puller checks against its own prompt's."""

    num_tokens: int
    last_block_hash: int


NOTHING_EXPORTED = ExportedPrefix(0, 0)


def cached_prefix_blocks(kv: KVCacheManager, token_ids: Sequence[int]) -> tuple[list[int], list[int]]:
    """The cached blocks holding the longest run of `token_ids`' leading full blocks, the last
    token left out, and those blocks' hashes."""
    if not kv.enable_caching or len(token_ids) < 2:
        return [], []
    hashes = block_hashes(token_ids[: len(token_ids) - 1], kv.block_size, kv.hash_seed)
    block_ids = kv.cached_run(hashes)
    return block_ids, hashes[: len(block_ids)]


def export_prefix(
    kv: KVCacheManager,
    kv_caches: list[torch.Tensor],
    registry: TransferRegistry,
    request_id: str,
    token: bytes,
    token_ids: Sequence[int],
) -> ExportedPrefix:
    """Stage the cached leading blocks of `token_ids` as transfer `request_id` (engine thread,
    between steps). NOTHING_EXPORTED when none is cached, the worker runs a draft, or staging
    has no room now: the puller then computes the prompt itself."""
    layout = registry.layout
    if layout.num_draft_layers:
        return NOTHING_EXPORTED
    block_ids, hashes = cached_prefix_blocks(kv, token_ids)
    if not block_ids:
        return NOTHING_EXPORTED
    num_tokens = len(block_ids) * kv.block_size
    try:
        registry.register(request_id, token, num_tokens)
    except (StagingExhausted, TransferDenied) as e:
        logger.warning("request %s: exporting %d cached tokens refused: %s", request_id, num_tokens, e)
        return NOTHING_EXPORTED
    transfer = registry.pin(request_id)
    if transfer is None:  # released before the copy started
        return NOTHING_EXPORTED
    # Every layer copies the same blocks: each chunk's index, made once.
    device = kv_caches[0].device
    chunks = [
        (start, torch.tensor(block_ids[start : start + BLOCKS_PER_CHUNK], dtype=torch.long, device=device))
        for start in range(0, len(block_ids), BLOCKS_PER_CHUNK)
    ]
    try:
        for layer in range(layout.num_layers):
            kv_layer = kv_caches[layer]
            for start, index in chunks:
                chunk, dst = registry.chunk_buffer(transfer, layer, start, len(index))
                if kv_layer.device == dst.device:
                    torch.index_select(kv_layer, 1, index, out=dst)
                else:  # a GPU cache into host staging
                    dst.copy_(kv_layer.index_select(1, index))
                registry.publish(transfer, chunk)
    finally:
        registry.unpin(transfer)
    registry.complete(request_id, NO_FIRST_TOKEN)
    return ExportedPrefix(num_tokens, hashes[-1])
