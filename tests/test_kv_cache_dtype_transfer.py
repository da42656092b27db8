"""A KV cache dtype across the prefill/decode boundary and into the offload store: a pull moves the
cache's own bytes (a bfloat16 cache: half of float32's), over gRPC and shared memory; a prefill and
a decode worker with different KV cache dtypes are refused naming both (the prompt recomputed); and
an offload store written for one dtype is not served to another."""

from __future__ import annotations

import logging
import pathlib

import pytest
import torch

from kvservice.connector import offload_store
from kvservice.connector.offload_io import pack_block, unpack_block
from kvservice.connector.offload_store import DiskKVStore, StoreFingerprint
from kvservice.engine.llm import LLM
from kvservice.loading.model_files import TINY_CONFIG
from kvservice.model.kv_cache import KVCacheLayout
from kvservice.model.kv_dtype import kv_storage_dtype, row_width
from tests.pd_pair import (
    BLOCK_SIZE,
    DECODE_PARAMS,
    MAX_MODEL_LEN,
    NUM_BLOCKS,
    PROMPTS,
    Pair,
    drive_decode,
    drive_prefill,
    pd_pair,
    prompt_blocks,
)

pytestmark = pytest.mark.timeout(120)

SOME_PROMPTS = PROMPTS[:4]  # 3, 8, 13 and 21 tokens
COLOCATED = dict(block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS, max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=16)


Blocks = dict[str, list[torch.Tensor]]


async def _run(pair: Pair, prompts: list[list[int]]) -> tuple[dict[str, list[int]], Blocks, Blocks]:
    """Every prompt through the pair: the tokens, and each request's prompt blocks per layer on the
    prefill side (when it finished) and on the decode side (when its first token is out)."""
    lengths = {f"req-{i}": len(p) for i, p in enumerate(prompts)}
    tokens = {rid: pair.add(rid, prompt) for rid, prompt in zip(lengths, prompts)}
    prefill_kv: Blocks = {}
    decode_kv: Blocks = {}
    await drive_prefill(pair, lambda rid: prefill_kv.__setitem__(rid, prompt_blocks(pair.prefill, rid, lengths[rid])))
    finished = await drive_decode(
        pair,
        lambda out: decode_kv.__setitem__(
            out.request_id, prompt_blocks(pair.decode, out.request_id, lengths[out.request_id])
        ),
    )
    for request_id, token in tokens.items():
        pair.registry.release(request_id, token)
    pair.assert_everything_free()
    return {rid: out.token_ids for rid, out in finished.items()}, prefill_kv, decode_kv


@pytest.mark.parametrize(
    ("kv_cache_dtype", "use_shared_memory"), [("bfloat16", False), ("bfloat16", True), ("int8", False), ("int8", True)]
)
async def test_a_narrower_pull_moves_the_caches_own_bytes(kv_cache_dtype: str, use_shared_memory: bool) -> None:
    async with pd_pair(use_shared_memory=use_shared_memory) as pair:
        await _run(pair, SOME_PROMPTS)
        float32_bytes = pair.decode_connector.stats.num_bytes
    async with pd_pair(use_shared_memory=use_shared_memory, kv_cache_dtypes=(kv_cache_dtype, kv_cache_dtype)) as pair:
        tokens, prefill_kv, decode_kv = await _run(pair, SOME_PROMPTS)
        assert pair.decode_connector.stats.num_failed_transfers == 0
        num_bytes = pair.decode_connector.stats.num_bytes
    dtype = kv_storage_dtype(kv_cache_dtype, torch.float32)
    for rid, layers in decode_kv.items():  # the prefill side's blocks arrived bit for bit
        for prefill_layer, decode_layer in zip(prefill_kv[rid], layers, strict=True):
            assert decode_layer.dtype == dtype
            assert torch.equal(prefill_layer.view(torch.uint8), decode_layer.view(torch.uint8)), rid
    head_dim = TINY_CONFIG.head_dim
    assert num_bytes * 4 * head_dim == float32_bytes * row_width(dtype, head_dim) * dtype.itemsize
    # As a colocated engine with that cache computes them (the prompts in the same chunks).
    colocated = LLM("tiny", **{**COLOCATED, "kv_cache_dtype": kv_cache_dtype}).generate(SOME_PROMPTS, DECODE_PARAMS)
    assert [tokens[f"req-{i}"] for i in range(len(SOME_PROMPTS))] == [o.token_ids for o in colocated]


async def test_different_kv_cache_dtypes_are_refused_naming_both(caplog: pytest.LogCaptureFixture) -> None:
    prompts = SOME_PROMPTS[:2]
    with caplog.at_level(logging.WARNING):
        async with pd_pair(kv_cache_dtypes=("auto", "bfloat16")) as pair:
            tokens, _, _ = await _run(pair, prompts)
            assert pair.decode_connector.stats.num_failed_transfers == len(prompts)
            assert pair.decode_connector.stats.num_bytes == 0
    assert all(len(t) > 0 for t in tokens.values())  # recomputed on the decode side
    refusals = [r.getMessage() for r in caplog.records if "KV cache dtype mismatch" in r.getMessage()]
    assert refusals, [r.getMessage() for r in caplog.records]
    assert "'bfloat16'" in refusals[0] and "'float32'" in refusals[0] and "--kv-cache-dtype" in refusals[0]


def test_an_offload_store_of_another_kv_dtype_is_reset_not_served(
    tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture
) -> None:
    fingerprints = {
        dtype: StoreFingerprint.from_layout("tiny", KVCacheLayout.for_model(TINY_CONFIG, BLOCK_SIZE, dtype))
        for dtype in (torch.float32, torch.bfloat16, torch.int8)
    }
    assert [f.dtype for f in fingerprints.values()] == ["float32", "bfloat16", "int8"]
    assert len({f.digest for f in fingerprints.values()}) == 3
    caplog.set_level(logging.WARNING, logger=offload_store.logger.name)
    with DiskKVStore(tmp_path, 1 << 20, fingerprints[torch.bfloat16]) as store:
        store.write(1, bytes(100))
        assert store.contains(1)
    with DiskKVStore(tmp_path, 1 << 20, fingerprints[torch.int8]) as store:
        assert not store.contains(1) and store.read(1) is None and store.stats.num_blocks == 0
    assert any("reset" in r.getMessage() and "bfloat16" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.int8])
def test_an_offloaded_block_keeps_the_caches_bytes(dtype: torch.dtype) -> None:
    layout = KVCacheLayout.for_model(TINY_CONFIG, BLOCK_SIZE, dtype)
    caches = [torch.randint(-100, 100, layout.blocks_shape(3)).to(dtype) for _ in range(layout.num_layers)]
    payload = pack_block([cache[:, 1] for cache in caches])
    assert len(payload) == layout.bytes_per_block
    for cache, layer in zip(caches, unpack_block(payload, layout), strict=True):
        assert layer.dtype == dtype and torch.equal(layer.view(torch.uint8), cache[:, 1].view(torch.uint8))
