"""The prefill connector's worker side: what `save_kv_layer` stages and publishes."""

from __future__ import annotations

import zlib

import torch

from kvservice.connector.prefill_connector import PrefillConnectorMetadata, PrefillKVConnector, SaveSpec
from kvservice.connector.staging import StagingPool
from kvservice.connector.transfer_registry import TransferRegistry
from kvservice.model.attention import AttentionMetadata
from kvservice.model.kv_cache import KVCacheLayout, allocate_kv_caches

LAYOUT = KVCacheLayout(num_layers=3, block_size=4, num_kv_heads=2, head_dim=8, dtype=torch.bfloat16)


def test_staged_chunks_carry_the_crc32_of_exactly_the_gathered_blocks() -> None:
    """The copy thread checksums each chunk as it stages it; the sender sends that value."""
    num_blocks, num_tokens = 12, 37  # 10 blocks, the last one partial
    kv_caches = allocate_kv_caches(LAYOUT, num_blocks, torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    for kv_layer in kv_caches:
        kv_layer.normal_(generator=gen)
    block_ids = [7, 2, 9, 0, 11, 4, 5, 6, 1, 3]
    pool = StagingPool(LAYOUT.num_blocks_for(num_tokens) * LAYOUT.bytes_per_block)
    registry = TransferRegistry(pool, LAYOUT)
    connector = PrefillKVConnector(registry, chunk_bytes=3 * LAYOUT.bytes_per_block_per_layer)
    connector.register_kv_caches(kv_caches, LAYOUT)  # CPU caches: copies on the staging thread
    try:
        transfer = registry.register("r", b"t" * 16, num_tokens)
        connector.bind_connector_metadata(PrefillConnectorMetadata([SaveSpec("r", 0, block_ids)]))
        no_attention = AttentionMetadata(torch.empty(0, dtype=torch.long), 0, None, None, [])
        for layer, kv_layer in enumerate(kv_caches):
            connector.save_kv_layer(layer, kv_layer, no_attention)
        connector.wait_for_save()
        connector.clear_connector_metadata()
        chunks, _ = registry.snapshot(transfer, 0)
    finally:
        connector.shutdown()

    assert sorted((c.layer, c.first_block) for c in chunks) == [(layer, b) for layer in range(3) for b in (0, 3, 6, 9)]
    arena = transfer.buffer.tensor
    for chunk in chunks:
        staged = arena[chunk.offset : chunk.offset + chunk.num_bytes]
        ids = torch.tensor(block_ids[chunk.first_block : chunk.first_block + chunk.num_blocks])
        expected = kv_caches[chunk.layer].index_select(1, ids).contiguous().view(torch.uint8).reshape(-1)
        assert torch.equal(staged, expected)
        assert chunk.crc32 == zlib.crc32(expected.numpy().tobytes())
