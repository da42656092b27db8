"""The KV offload tier under one engine: blocks the prefix cache evicts are written to a bounded
store, a prefix that misses the cache but hits the store is read back (off the step loop), a
restarted engine with the same directory serves what it held, and a corrupt block is recomputed.
Greedy output never changes."""

from __future__ import annotations

import logging
import pathlib
import time

import pytest
import torch

from kvservice.config import EngineConfig
from kvservice.connector.offload_store import BLOCKS_DIR, DiskKVStore, OffloadStoreLockedError, StoreFingerprint
from kvservice.connector.offload_tier import OffloadTier
from kvservice.core.block_hash import block_hashes
from kvservice.core.block_pool import CACHE_TIER, OFFLOAD_TIER
from kvservice.core.sampling_params import SamplingParams
from kvservice.engine.engine import LLMEngine
from kvservice.engine.engine_builder import build_engine
from kvservice.engine.llm import LLM
from kvservice.loading.model_files import TINY_CONFIG
from kvservice.model.kv_cache import KVCacheLayout

BLOCK_SIZE = 16
# Room for about two 64-token conversations: the next ones evict the first's blocks.
CONFIG = EngineConfig(block_size=BLOCK_SIZE, num_blocks=12, max_model_len=256)
LAYOUT = KVCacheLayout.for_model(TINY_CONFIG, BLOCK_SIZE, torch.float32)
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
PROMPTS = [[(7 * i + j) % 250 + 3 for j in range(66)] for i in range(4)]  # 4 full blocks + 2 tokens each


def _tier(directory: pathlib.Path) -> OffloadTier:
    store = DiskKVStore(directory, 64 << 20, StoreFingerprint.from_layout("tiny", LAYOUT), label="test")
    return OffloadTier(store)


def _generate(engine: LLMEngine, prompt: list[int], request_id: str) -> list[int]:
    engine.add_request(prompt, GREEDY, request_id)
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        tokens = next((o.token_ids for o in engine.step() if o.finished), tokens)
    return tokens


def _fill_store(directory: pathlib.Path) -> None:
    """Serve every prompt on an engine over a store in `directory`, then close it (its writes
    land before its lock goes): the store then holds what the small cache evicted."""
    tier = _tier(directory)
    engine = build_engine("tiny", CONFIG, kv_tier=tier)
    try:
        for i, prompt in enumerate(PROMPTS):
            _generate(engine, prompt, f"r{i}")
    finally:
        tier.close()


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    llm = LLM("tiny", block_size=BLOCK_SIZE, num_blocks=64, max_model_len=256, enable_prefix_caching=False)
    return [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]


def _run_all_then_first_again(engine: LLMEngine) -> list[list[int]]:
    outputs = [_generate(engine, prompt, f"r{i}") for i, prompt in enumerate(PROMPTS)]
    return [*outputs, _generate(engine, PROMPTS[0], "again")]


def test_evicted_blocks_come_back_from_the_tier(tmp_path: pathlib.Path, reference: list[list[int]]) -> None:
    tier = _tier(tmp_path)
    engine = build_engine("tiny", CONFIG, kv_tier=tier)
    try:
        outputs = _run_all_then_first_again(engine)
        assert outputs == [*reference, reference[0]]
        assert tier.num_blocks_saved >= 4 and tier.stats.num_blocks_written >= 4  # the first prompt's went out
        assert tier.num_hit_blocks == 4  # and came back for its second run
        assert tier.num_blocks_loaded == 4 and tier.num_blocks_invalid == 0
        assert engine.num_free_blocks == engine.num_blocks
    finally:
        tier.close()


def test_a_restarted_engine_serves_what_its_directory_holds(tmp_path: pathlib.Path, reference: list[list[int]]) -> None:
    _fill_store(tmp_path)
    warm = _tier(tmp_path)
    restarted = build_engine("tiny", CONFIG, kv_tier=warm)
    try:
        assert _generate(restarted, PROMPTS[0], "warm") == reference[0]
        assert warm.num_blocks_loaded == 4  # nothing of it was cached in this engine
    finally:
        warm.close()


def test_a_corrupt_block_is_dropped_and_recomputed(
    tmp_path: pathlib.Path, reference: list[list[int]], caplog: pytest.LogCaptureFixture
) -> None:
    _fill_store(tmp_path)
    for path in (tmp_path / BLOCKS_DIR).iterdir():  # flip one payload byte of every stored block
        data = bytearray(path.read_bytes())
        data[-1] ^= 0xFF
        path.write_bytes(bytes(data))
    tier = _tier(tmp_path)
    engine = build_engine("tiny", CONFIG, kv_tier=tier)
    try:
        with caplog.at_level(logging.WARNING):
            assert _generate(engine, PROMPTS[0], "r") == reference[0]
        assert tier.num_blocks_loaded == 0 and tier.stats.num_blocks_dropped >= 1
        assert any("checksum" in r.getMessage().lower() or "crc" in r.getMessage().lower() for r in caplog.records)
    finally:
        tier.close()


def test_two_workers_on_one_directory_are_refused(tmp_path: pathlib.Path) -> None:
    tier = _tier(tmp_path)
    try:
        with pytest.raises(OffloadStoreLockedError, match="test"):
            _tier(tmp_path)
    finally:
        tier.close()


# ---------------------------------------------------------------- served, across a restart

SERVED_ARGS = ["--num-blocks", "12", "--max-model-len", "256", "--num-threads", "1", "--no-prompt-lane"]


async def _served_tokens(address: str, prompt: list[int]) -> list[int]:
    from kvservice.client.client import KVServiceClient

    async with KVServiceClient(address) as client:
        out = await client.complete(prompt, max_tokens=GREEDY.max_tokens, temperature=0.0, ignore_eos=True)
        return list(out.token_ids)


@pytest.mark.slow
async def test_a_relaunched_worker_serves_its_prefixes_from_the_same_directory(
    tmp_path: pathlib.Path, reference: list[list[int]]
) -> None:
    import subprocess
    import sys

    from kvservice.client.client import KVServiceClient
    from tests.conftest import local_cluster

    kwargs = dict(colocated=True, worker_args=SERVED_ARGS, kv_offload_dir=str(tmp_path), kv_offload_gib=0.25)
    async with local_cluster("tiny", **kwargs) as cluster:
        for prompt, expected in zip(PROMPTS, reference):
            assert await _served_tokens(cluster.address, prompt) == expected
        # A second worker on the same directory is refused at start, naming the lock's holder.
        second = subprocess.run(
            [sys.executable, "-m", "kvservice", "serve", "--role", "both", "--port", "0",
             "--kv-offload-dir", str(tmp_path / "both")],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert second.returncode == 2 and "lock" in second.stderr and "both worker" in second.stderr, second.stderr
    assert (tmp_path / "both" / BLOCKS_DIR).is_dir()  # launch's layout: DIR/<worker name>
    async with local_cluster("tiny", **kwargs) as cluster:
        assert await _served_tokens(cluster.address, PROMPTS[0]) == reference[0]
        async with KVServiceClient(cluster.address) as client:
            stats = await client.stats()
    offload = stats.kv_offload if stats.HasField("kv_offload") else stats.workers[0].stats.kv_offload
    assert offload.enabled and offload.num_hit_blocks == 4 and offload.num_blocks_read == 4


def test_the_engines_kv_events_say_which_blocks_went_to_the_tier(tmp_path: pathlib.Path) -> None:
    tier = _tier(tmp_path)
    engine = build_engine("tiny", CONFIG, kv_tier=tier)
    engine.core.take_kv_events()  # start recording, as a worker's publisher does
    try:
        for i, prompt in enumerate(PROMPTS):
            _generate(engine, prompt, f"r{i}")
        deadline = time.monotonic() + 30
        while tier.stats.num_blocks_written < tier.num_blocks_saved:  # the I/O thread's writes land
            assert time.monotonic() < deadline, "the tier's writes did not land"
            time.sleep(0.01)
        first = set(block_hashes(PROMPTS[0], BLOCK_SIZE, engine.core.kv_hash_seed))
        events = engine.core.take_kv_events()
        offloaded = {h for e in events if e.tier == OFFLOAD_TIER and e.kind == "stored" for h in e.block_hashes}
        uncached = {h for e in events if e.tier == CACHE_TIER and e.kind == "removed" for h in e.block_hashes}
        assert first <= offloaded and first <= uncached  # evicted from the cache, kept in the tier
        snapshot = engine.core.kv_cache_snapshot()
        assert {h for e in snapshot if e.tier == OFFLOAD_TIER for h in e.block_hashes} == offloaded
    finally:
        tier.close()
