"""A KV cache dtype across the prefill/decode boundary and into the offload store: a pull moves the
cache's own bytes (a bfloat16 cache: half of float32's), over gRPC and shared memory; a prefill and
a decode worker with different KV cache dtypes are refused naming both (the prompt recomputed); and
an offload store written for one dtype is not served to another."""

from __future__ import annotations

import logging
import pathlib

import pytest
import torch

from kvservice.connector.offload_store import StoreFingerprint
from kvservice.engine.llm import LLM
from kvservice.loading.model_files import TINY_CONFIG
from kvservice.model.kv_cache import KVCacheLayout
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


@pytest.mark.parametrize("use_shared_memory", [False, True])
async def test_a_bfloat16_pull_moves_the_caches_own_bytes(use_shared_memory: bool) -> None:
    async with pd_pair(use_shared_memory=use_shared_memory) as pair:
        float32_tokens, _, _ = await _run(pair, SOME_PROMPTS)
        float32_bytes = pair.decode_connector.stats.num_bytes
    async with pd_pair(use_shared_memory=use_shared_memory, kv_cache_dtypes=("bfloat16", "bfloat16")) as pair:
        tokens, prefill_kv, decode_kv = await _run(pair, SOME_PROMPTS)
        assert pair.decode_connector.stats.num_failed_transfers == 0
        bfloat16_bytes = pair.decode_connector.stats.num_bytes
    for rid, layers in decode_kv.items():  # the prefill side's blocks arrived bit for bit
        for prefill_layer, decode_layer in zip(prefill_kv[rid], layers, strict=True):
            assert decode_layer.dtype == torch.bfloat16
            assert torch.equal(prefill_layer.view(torch.int16), decode_layer.view(torch.int16)), rid
    assert bfloat16_bytes * 2 == float32_bytes > 0
    # As a colocated engine with a bfloat16 cache computes them (the prompts in the same chunks).
    colocated = LLM("tiny", **{**COLOCATED, "kv_cache_dtype": "bfloat16"}).generate(SOME_PROMPTS, DECODE_PARAMS)
    assert [tokens[f"req-{i}"] for i in range(len(SOME_PROMPTS))] == [o.token_ids for o in colocated]
    assert tokens != float32_tokens  # the rounding shows on the tiny model


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


def test_the_offload_store_fingerprint_differs_by_kv_dtype(tmp_path: pathlib.Path) -> None:
    fingerprints = {
        dtype: StoreFingerprint.from_layout("tiny", KVCacheLayout.for_model(TINY_CONFIG, BLOCK_SIZE, dtype))
        for dtype in (torch.float32, torch.bfloat16)
    }
    assert fingerprints[torch.bfloat16].dtype == "bfloat16"
    assert fingerprints[torch.float32].digest != fingerprints[torch.bfloat16].digest
