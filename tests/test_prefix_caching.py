"""Automatic prefix caching: shared blocks change no token, and every block comes back.

Colocated engines are compared with transformers and with themselves without caching,
through chunked prefill, preemption, aborts and speculative decoding; the
disaggregated pair (`pd_pair`) shows the decode worker pulling only the blocks its own
cache lacks, nothing at all when it holds the whole prompt.
"""

from __future__ import annotations

import asyncio
import pathlib
import random
import secrets

import grpc
import pytest
import torch
from hf_models import hf_greedy, random_prompts
from pd_pair import (
    BLOCK_SIZE,
    LAYOUT,
    PREFILL_PARAMS,
    WAIT,
    bits,
    drive_decode,
    drive_prefill,
    make_prompt,
    pd_pair,
    prompt_blocks,
)

from kvservice import LLM, SamplingParams
from kvservice.connector.base import TRANSFER_TOKEN
from kvservice.connector.kv_puller import LoadSpec, pull_kv
from kvservice.connector.shared_memory import SegmentPool
from kvservice.core.block_hash import block_hashes, hash_seed
from kvservice.core.kv_cache_manager import KVCacheManager
from kvservice.core.outputs import KVTransferCounters
from kvservice.core.request import Request
from kvservice.engine.engine import LLMEngine
from kvservice.model.kv_cache import allocate_kv_caches

pytestmark = pytest.mark.timeout(300)

MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
# Small on purpose: chunked prefill (40-token steps) and preemption both happen.
SMALL_ENGINE = dict(num_blocks=8, max_num_batched_tokens=40, max_num_seqs=6)
# Prefix lengths around block boundaries (16), and suffixes of 0 (a prompt that is a
# prefix of another, block-aligned or not) to 9 tokens.
PREFIX_LENGTHS = (0, 5, 15, 16, 17, 32, 33, 48)


def shared_prefix_prompts(seed: int = 7, vocab_size: int = 512) -> list[list[int]]:
    rng = random.Random(seed)
    base = [rng.randrange(3, vocab_size) for _ in range(64)]
    prompts = []
    for n in PREFIX_LENGTHS:
        for suffix in (0, 1, 9):
            if n + suffix:
                prompts.append(base[:n] + [rng.randrange(3, vocab_size) for _ in range(suffix)])
    return prompts


def assert_all_blocks_back(engine: LLMEngine) -> None:
    pool = engine.core.scheduler.kv.block_pool
    assert all(block.ref_cnt == 0 for block in pool.blocks)
    assert engine.num_free_blocks == engine.num_blocks
    assert engine.core.scheduler.kv.block_tables == {}


# ---------------------------------------------------------------- block keys


def test_block_keys_chain_over_the_prefix_and_the_seed() -> None:
    seed = hash_seed("tiny", "torch.float32")
    tokens = list(range(40))
    keys = block_hashes(tokens, 16, seed)
    assert len(keys) == 2  # the partial third block has no key
    assert block_hashes(tokens[:32] + [99] * 8, 16, seed) == keys
    assert block_hashes([1000] + tokens[1:], 16, seed)[1] != keys[1]  # a change early changes every later key
    assert block_hashes(tokens, 16, hash_seed("tiny", "torch.bfloat16")) != keys
    assert hash_seed("a", "b") == hash_seed("a", "b") != hash_seed("ab")


def computed_and_cached(kv: KVCacheManager, request_id: str, token_ids: list[int]) -> Request:
    """A request whose tokens all went through the model: its full blocks are in the cache."""
    request = Request(request_id, token_ids, GREEDY)
    assert kv.allocate_slots(request, len(token_ids)) is not None
    request.num_computed_tokens = len(token_ids)
    kv.cache_full_blocks(request)
    return request


def test_a_lookup_stops_at_the_first_miss_and_never_takes_more_than_asked() -> None:
    kv = KVCacheManager(8, 4)
    computed_and_cached(kv, "a", list(range(12)))
    same = Request("b", list(range(12)), GREEDY)
    assert kv.find_cached_prefix(same, 11) == kv.get_block_ids("a")[:2]  # the last token is computed
    assert kv.find_cached_prefix(same, 12) == kv.get_block_ids("a")
    diverged = Request("c", [0, 1, 2, 3, 9, 5, 6, 7, 8, 9, 10, 11], GREEDY)
    assert kv.find_cached_prefix(diverged, 12) == kv.get_block_ids("a")[:1]


def test_a_hit_that_does_not_fit_takes_nothing() -> None:
    kv = KVCacheManager(4, 4)
    computed_and_cached(kv, "a", list(range(8)))
    kv.free("a")  # both blocks cached and free: 4 free in all
    hit = kv.find_cached_prefix(Request("b", list(range(8)) + [1] * 16, GREEDY), 23)
    assert len(hit) == 2
    big = Request("b", list(range(8)) + [1] * 16, GREEDY)
    # 24 tokens need 6 blocks: 2 shared + 4 new, but taking the 2 hits leaves only 2 free.
    assert kv.allocate_slots(big, 16, hit) is None
    assert kv.num_free_blocks == 4 and kv.get_block_ids("b") == []
    assert all(block.ref_cnt == 0 for block in kv.block_pool.blocks)


# ---------------------------------------------------------------- colocated


def test_cached_prefixes_change_no_token_through_chunking_and_preemption(llama_dir: pathlib.Path) -> None:
    prompts = shared_prefix_prompts()
    expected = hf_greedy(llama_dir, prompts, MAX_TOKENS)
    uncached = LLM(str(llama_dir), enable_prefix_caching=False, **SMALL_ENGINE)
    assert [o.token_ids for o in uncached.generate(prompts, GREEDY)] == expected

    llm = LLM(str(llama_dir), **SMALL_ENGINE)
    for round_ in range(2):  # the second round finds the first one's blocks (those not evicted)
        outputs = llm.generate(prompts, GREEDY)
        assert [o.token_ids for o in outputs] == expected, f"round {round_}"
        assert_all_blocks_back(llm.engine)
    stats = llm.engine.core.scheduler.make_stats()
    assert stats.num_preemptions > 0, "no request was preempted: the engine is too large for this test"
    assert stats.prefix_cache.hits > 0
    assert uncached.engine.core.scheduler.make_stats().prefix_cache.hits == 0


def test_a_fully_cached_prompt_still_computes_its_last_token(llama_dir: pathlib.Path) -> None:
    prompt = random_prompts([32], seed=4)[0]  # two full blocks of 16
    llm = LLM(str(llama_dir), num_blocks=32)
    first = llm.generate(prompt, GREEDY)[0]
    engine = llm.engine
    request_id = engine.add_request(prompt, GREEDY)
    request = engine.core.scheduler.requests[request_id]
    engine.step()
    assert request.num_cached_tokens == 16, "the block holding the last prompt token must be computed"
    while engine.has_unfinished_requests():
        engine.step()
    assert request.output_token_ids == first.token_ids
    assert_all_blocks_back(engine)


def test_the_next_turn_finds_the_previous_answer(llama_dir: pathlib.Path) -> None:
    llm = LLM(str(llama_dir), num_blocks=32)
    prompt = random_prompts([21], seed=5)[0]
    answer = llm.generate(prompt, GREEDY)[0].token_ids
    history = prompt + answer  # 33 tokens; the answer's last token has no KV yet
    next_turn = history + random_prompts([6], seed=6)[0]
    engine = llm.engine
    request_id = engine.add_request(next_turn, GREEDY)
    request = engine.core.scheduler.requests[request_id]
    engine.step()
    assert request.num_cached_tokens == 32  # two full blocks, the second one filled while decoding
    while engine.has_unfinished_requests():
        engine.step()
    assert request.output_token_ids == hf_greedy(llama_dir, [next_turn], MAX_TOKENS)[0]
    assert_all_blocks_back(engine)


def test_aborting_requests_that_share_blocks_frees_only_their_own_references(llama_dir: pathlib.Path) -> None:
    prompts = shared_prefix_prompts(seed=8)[6:14]
    expected = hf_greedy(llama_dir, prompts, MAX_TOKENS)
    llm = LLM(str(llama_dir), num_blocks=48, max_num_batched_tokens=64)
    engine = llm.engine
    llm.generate(prompts[:2], GREEDY)  # cache some prefixes first
    ids = [engine.add_request(p, GREEDY) for p in prompts]
    for _ in range(3):
        engine.step()
    aborted = set(ids[::2])
    for request_id in aborted:
        assert engine.abort_request(request_id)
    outputs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out
    for request_id, prompt_expected in zip(ids, expected):
        if request_id in aborted:
            assert outputs[request_id].finish_reason == "abort"
        else:
            assert outputs[request_id].token_ids == prompt_expected
    assert_all_blocks_back(engine)


def test_speculative_decoding_over_cached_prefixes_matches_plain_greedy(
    llama_dir: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    from test_spec_decode import first_layer_draft

    draft = first_layer_draft(llama_dir, tmp_path / "draft")
    prompts = shared_prefix_prompts(seed=9)[::2]
    expected = hf_greedy(llama_dir, prompts, MAX_TOKENS)
    llm = LLM(str(llama_dir), draft_model=str(draft), num_speculative_tokens=3, num_blocks=40, max_num_seqs=4)
    for _ in range(2):
        assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == expected
        assert_all_blocks_back(llm.engine)
    scheduler = llm.engine.core.scheduler
    assert scheduler.num_draft_tokens > 0 and scheduler.make_stats().prefix_cache.hits > 0


# ---------------------------------------------------------------- disaggregated


async def test_the_decode_worker_pulls_only_the_blocks_it_lacks() -> None:
    long_prompt = make_prompt(37, seed=11)  # 4 full blocks of 8 and 5 tokens
    prompts = {
        "first": long_prompt,
        "shares-3-blocks": long_prompt[:24] + make_prompt(10, seed=12),
        "same-prompt": long_prompt,
        "aligned-and-cached": long_prompt[:32],
    }
    reference = dict(
        zip(
            prompts,
            (
                o.token_ids
                for o in LLM("tiny", block_size=BLOCK_SIZE, enable_prefix_caching=False).generate(
                    list(prompts.values()), SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
                )
            ),
        )
    )
    pulled_blocks: dict[str, int] = {}
    async with pd_pair() as pair:
        for request_id, prompt in prompts.items():  # one at a time: each finds the earlier ones cached
            before = pair.decode_connector.stats.num_bytes
            pair.add(request_id, prompt)
            prefill_out, decode_out = await asyncio.gather(drive_prefill(pair), drive_decode(pair))
            await pair.wait_released({request_id})
            assert decode_out[request_id].token_ids == reference[request_id], request_id
            assert prefill_out[request_id].token_ids == reference[request_id][:1]
            sent = pair.decode_connector.stats.num_bytes - before
            assert sent % LAYOUT.bytes_per_block == 0
            pulled_blocks[request_id] = sent // LAYOUT.bytes_per_block
        assert pair.decode_connector.stats.num_failed_transfers == 0, "a pull failed: the output came from a recompute"
        # The prefill worker used its own cache too: it skipped what it had computed before.
        assert pair.prefill.core.scheduler.make_stats().prefix_cache.hits >= 24 + 32 + 24
        pair.assert_everything_free()
    assert pulled_blocks == {
        "first": 5,
        "shares-3-blocks": 2,  # blocks 3 and 4 (of 34 tokens)
        "same-prompt": 1,  # the partial last block only
        "aligned-and-cached": 0,  # the whole prompt is cached: only the first token travels
    }


@pytest.mark.parametrize("use_shared_memory", [False, True], ids=["grpc", "shm"])
async def test_a_pull_that_starts_mid_chunk_receives_only_the_blocks_it_asked_for(use_shared_memory: bool) -> None:
    prompt = make_prompt(37, seed=13)  # 5 blocks, staged as 2-block chunks: [0, 2), [2, 4), [4, 5)
    async with pd_pair() as pair:
        token = secrets.token_bytes(16)
        pair.registry.register("r", token, len(prompt))
        pair.prefill.add_request(prompt, PREFILL_PARAMS, "r", {TRANSFER_TOKEN: token})
        staged: list[torch.Tensor] = []
        await drive_prefill(
            pair, lambda request_id: staged.extend(prompt_blocks(pair.prefill, request_id, len(prompt)))
        )
        caches = allocate_kv_caches(LAYOUT, 8, torch.device("cpu"))
        spec = LoadSpec("r", pair.address, token, block_ids=[7, 6, 5, 4, 3], num_tokens=len(prompt), first_block=3)
        counters = KVTransferCounters()
        segments = SegmentPool() if use_shared_memory else None
        try:
            async with grpc.aio.insecure_channel(pair.address) as channel:
                result = await pull_kv(channel, spec, caches, LAYOUT, WAIT, counters, segments=segments)
        finally:
            if segments is not None:
                segments.close()
        assert result.error is None and result.first_token_id is not None
        assert counters.num_bytes == 2 * LAYOUT.bytes_per_block  # blocks 3 and 4, not the whole [2, 4) chunk
        assert counters.num_shared_memory_bytes == (counters.num_bytes if use_shared_memory else 0)
        for layer, cache in enumerate(caches):
            assert torch.equal(bits(cache[:, [4, 3]]), bits(staged[layer][:, 3:5]))
            assert not cache[:, [7, 6, 5]].any(), "a cached block was written"
        await pair.wait_released({"r"})
        pair.assert_everything_free()
