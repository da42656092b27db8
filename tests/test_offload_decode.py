"""A decode worker's offload tier: a prompt whose prefix its cache evicted but its store holds is
read back from the store first, and the pull that follows starts past those blocks (the prefill
worker sends only the rest). Greedy output never changes; nothing leaks."""

from __future__ import annotations

import asyncio
import pathlib

import pytest
from pd_pair import (
    BLOCK_SIZE,
    DECODE_PARAMS,
    LAYOUT,
    MAX_MODEL_LEN,
    Pair,
    drive_decode,
    drive_prefill,
    make_prompt,
    pd_pair,
)

from kvservice.connector.offload_store import DiskKVStore, StoreFingerprint
from kvservice.connector.offload_tier import OffloadTier
from kvservice.engine.llm import LLM

pytestmark = pytest.mark.timeout(120)

# 48-token prompts (6 blocks) and a decode cache of 14 blocks: each new prompt evicts older ones.
PROMPT = make_prompt(48, seed=100)
OTHERS = [make_prompt(48, seed=101 + i) for i in range(3)]


@pytest.fixture(scope="module")
def reference() -> list[int]:
    llm = LLM("tiny", block_size=BLOCK_SIZE, num_blocks=64, max_model_len=MAX_MODEL_LEN)
    return llm.generate([PROMPT], DECODE_PARAMS)[0].token_ids


async def _serve(pair: Pair, request_id: str, prompt: list[int]) -> list[int]:
    pair.add(request_id, prompt)
    _, decoded = await asyncio.gather(drive_prefill(pair), drive_decode(pair))
    await pair.wait_released({request_id})
    assert decoded[request_id].error is None
    return decoded[request_id].token_ids


async def test_a_prefix_in_the_decode_workers_store_shortens_its_pull(
    tmp_path: pathlib.Path, reference: list[int]
) -> None:
    store = DiskKVStore(tmp_path, 64 << 20, StoreFingerprint.from_layout("tiny", LAYOUT), label="decode-0")
    tier = OffloadTier(store)
    try:
        async with pd_pair(decode_num_blocks=14, decode_tier=tier) as pair:
            first = await _serve(pair, "first", PROMPT)
            for i, other in enumerate(OTHERS):  # push the first prompt's blocks out of the decode cache
                await _serve(pair, f"other-{i}", other)
            assert pair.registry.first_blocks["first"] == 0
            again = await _serve(pair, "again", PROMPT)
            assert again == first == reference
            # The decode cache had lost the prompt; the store gave back its full blocks but the
            # last (whose last token is computed), and the pull asked for the blocks after them.
            assert tier.num_blocks_loaded == 5 and tier.num_blocks_invalid == 0
            assert pair.registry.first_blocks["again"] == 5
            assert pair.decode.core.scheduler.kv.block_pool.num_cached_blocks <= 14
            pair.assert_everything_free()
    finally:
        tier.close()
