"""Peer pulls: a worker pulls a prompt's leading blocks that another worker caches (staged there
by ExportKV) instead of computing them, and computes the rest. Greedy output never changes; a
source that holds nothing, a prefix that is not the prompt's, or a source that is gone all end in
a recompute, never a failed request; nothing leaks on either side.

In-process: the pd_pair's prefill engine is the source, its decode engine the puller (a decode
worker's connector; a prefill worker's is the same one beside its staging). On a launched 1P1D
cluster: the prefill worker pulls the previous turn's answer from the decode worker that made it.
"""

from __future__ import annotations

import secrets
from typing import Any

import grpc
import pytest
from conftest import all_worker_stats, local_cluster, tiny_greedy, wait_for, wait_for_stats, worker_stats
from pd_pair import (
    BLOCK_SIZE,
    DECODE_PARAMS,
    MAX_MODEL_LEN,
    NUM_BLOCKS,
    PREFILL_PARAMS,
    Pair,
    dead_address,
    drive_decode,
    drive_prefill,
    make_prompt,
    pd_pair,
)

from kvservice.client.client import KVServiceClient, build_request
from kvservice.connector.base import PREFIX_ADDRESS, PREFIX_LAST_HASH, PREFIX_NUM_TOKENS, PREFIX_ROLE, PREFIX_TOKEN
from kvservice.connector.prefix_export import NOTHING_EXPORTED, ExportedPrefix, export_prefix
from kvservice.engine.llm import LLM
from kvservice.server.errors import PeerNotAllowed
from kvservice.server.kv_sources import prefix_source_params
from kvservice.v1 import kvservice_pb2 as pb
from kvservice.v1 import kvservice_pb2_grpc as pb_grpc

pytestmark = pytest.mark.timeout(120)

PREFIX = make_prompt(5 * BLOCK_SIZE, seed=200)  # what the source caches: 5 blocks
PROMPT = PREFIX + make_prompt(13, seed=201)  # the puller's prompt: the prefix, then 13 more tokens


@pytest.fixture(scope="module")
def reference() -> list[int]:
    llm = LLM("tiny", block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS, max_model_len=MAX_MODEL_LEN)
    return llm.generate([PROMPT], DECODE_PARAMS)[0].token_ids


async def _cache_on_source(pair: Pair) -> None:
    """The source (the pair's prefill engine) computes PREFIX, which stays in its prefix cache."""
    pair.prefill.add_request(PREFIX, PREFILL_PARAMS, "warm", None)
    await drive_prefill(pair)


def _export(pair: Pair, request_id: str, token: bytes) -> ExportedPrefix:
    core = pair.prefill.core
    return export_prefix(core.scheduler.kv, core.kv_caches, pair.registry, request_id, token, PROMPT)


def _prefix_params(address: str, token: bytes, exported: ExportedPrefix) -> dict[str, Any]:
    return {
        PREFIX_ADDRESS: address,
        PREFIX_TOKEN: token,
        PREFIX_NUM_TOKENS: exported.num_tokens,
        PREFIX_LAST_HASH: exported.last_block_hash,
        PREFIX_ROLE: "prefill",
    }


def _prompt_tokens_computed(pair: Pair) -> int:
    """Prompt tokens the puller found nowhere (neither cached nor pulled): what it computed."""
    stats = pair.decode.core.scheduler.kv.prefix_cache
    return stats.queries - stats.hits


async def test_a_prefix_another_worker_caches_is_pulled_and_the_rest_computed(reference: list[int]) -> None:
    async with pd_pair() as pair:
        await _cache_on_source(pair)
        token = secrets.token_bytes(16)
        exported = _export(pair, "turn", token)
        assert exported.num_tokens == len(PREFIX)
        pair.decode.add_request(PROMPT, DECODE_PARAMS, "turn", _prefix_params(pair.address, token, exported))
        finished = await drive_decode(pair)
        assert finished["turn"].error is None
        assert finished["turn"].token_ids == reference
        assert pair.registry.first_blocks["turn"] == 0
        assert pair.decode_connector.peer_pulls.num_blocks_from_prefill == 5
        assert pair.decode_connector.peer_pulls.num_failed == 0
        # The pulled blocks are cached on the puller now, as if it had computed them.
        block_pool = pair.decode.core.scheduler.kv.block_pool
        assert block_pool.num_cached_blocks >= 5
        await pair.wait_released({"turn"})
        pair.assert_everything_free()


async def test_a_source_that_no_longer_holds_the_prefix_exports_nothing() -> None:
    async with pd_pair() as pair:
        assert _export(pair, "cold", secrets.token_bytes(16)) == NOTHING_EXPORTED
        assert pair.registry.num_transfers == 0


@pytest.mark.parametrize("failure_policy", ["recompute", "fail"])
async def test_a_source_that_is_gone_is_recomputed_whatever_the_failure_policy(
    reference: list[int], failure_policy: str
) -> None:
    async with pd_pair(kv_load_failure_policy=failure_policy) as pair:
        await _cache_on_source(pair)
        token = secrets.token_bytes(16)
        exported = _export(pair, "turn", token)
        pair.registry.release("turn", token)  # the source lost it: nobody serves this transfer
        await pair.wait_released({"turn"})
        params = _prefix_params(dead_address(), token, exported)
        pair.decode.add_request(PROMPT, DECODE_PARAMS, "turn", params)
        finished = await drive_decode(pair)
        assert finished["turn"].error is None
        assert finished["turn"].token_ids == reference
        assert pair.decode_connector.peer_pulls.num_failed == 1
        assert pair.decode_connector.peer_pulls.num_blocks_from_prefill == 0
        pair.assert_everything_free()


async def test_a_source_that_released_the_blocks_mid_way_is_recomputed(reference: list[int]) -> None:
    """The source is up but answers that it no longer stages the transfer (released, expired)."""
    async with pd_pair() as pair:
        await _cache_on_source(pair)
        token = secrets.token_bytes(16)
        exported = _export(pair, "turn", token)
        assert pair.registry.release("turn", token)
        pair.decode.add_request(PROMPT, DECODE_PARAMS, "turn", _prefix_params(pair.address, token, exported))
        finished = await drive_decode(pair)
        assert finished["turn"].token_ids == reference
        assert pair.decode_connector.peer_pulls.num_failed == 1
        pair.assert_everything_free()


async def test_a_prefix_that_is_not_the_prompts_is_never_pulled(reference: list[int]) -> None:
    async with pd_pair() as pair:
        await _cache_on_source(pair)
        token = secrets.token_bytes(16)
        exported = _export(pair, "turn", token)
        wrong = ExportedPrefix(exported.num_tokens, exported.last_block_hash ^ 1)
        pair.decode.add_request(PROMPT, DECODE_PARAMS, "turn", _prefix_params(pair.address, token, wrong))
        finished = await drive_decode(pair)
        assert finished["turn"].token_ids == reference
        assert "turn" not in pair.registry.first_blocks  # no pull was made
        assert pair.decode_connector.peer_pulls.num_failed == 0
        assert _prompt_tokens_computed(pair) == len(PROMPT)
        assert pair.registry.release("turn", token)  # the proxy's release after the request
        await pair.wait_released({"turn"})
        pair.assert_everything_free()


# ---------------------------------------------------------------- through the proxy

CLUSTER_ARGS = ("--num-blocks", "128", "--num-threads", "1")
CLUSTER_BLOCK_SIZE = 16  # the workers' default


@pytest.mark.slow
@pytest.mark.asyncio
@pytest.mark.timeout(240)
async def test_the_prefill_worker_pulls_the_previous_turns_answer_from_the_decode_worker() -> None:
    turn1 = make_prompt(10 * CLUSTER_BLOCK_SIZE, seed=210)
    answer_tokens = 6 * CLUSTER_BLOCK_SIZE
    [answer] = tiny_greedy([turn1], answer_tokens)
    turn2 = turn1 + answer + make_prompt(8, seed=211)
    [expected] = tiny_greedy([turn2], 8)
    async with local_cluster("tiny", num_prefill=1, num_decode=1, worker_args=CLUSTER_ARGS) as cluster:
        [prefill], [decode] = cluster.prefill_addresses, cluster.decode_addresses
        async with KVServiceClient(cluster.address) as client:
            first = await client.complete(turn1, timeout=60, max_tokens=answer_tokens, temperature=0, ignore_eos=True)
            assert list(first.token_ids) == answer

            # The decode worker caches the turn and all of its answer but the last token: 15 blocks
            # (the prefill worker: the prompt's 10).
            async def indexed() -> bool:
                stats = await worker_stats(cluster.address)
                return any(w.address == decode and w.num_indexed_blocks >= 15 for w in stats.workers)

            await wait_for(indexed, "the decode worker's 15 blocks in the proxy's index")
            second = await client.complete(turn2, timeout=60, max_tokens=8, temperature=0, ignore_eos=True)
        assert list(second.token_ids) == expected
        stats = await wait_for_stats(
            [prefill, decode], lambda s: s[decode].num_finished_requests >= 2, "both turns counted"
        )
        # The prefill worker found the turn in its own cache, pulled the answer's 5 blocks from the
        # decode worker, and computed the rest.
        assert stats[prefill].kv_offload.num_peer_blocks_from_decode == 5
        assert stats[prefill].kv_offload.num_peer_pulls_failed == 0
        assert stats[decode].kv_offload.num_blocks_exported == 15
        assert stats[prefill].prefix_cache.hits >= len(turn1)


@pytest.mark.slow
@pytest.mark.asyncio
@pytest.mark.timeout(240)
async def test_a_launched_decode_worker_pulls_a_prefix_from_the_other_decode_worker() -> None:
    """A stream that moves to the other decode worker, as a migration's does: `launch` tells its
    decode workers about each other (a second --kv-peers line), so the one that lacks the
    conversation pulls it from the one that served it, and computes only the rest."""
    turn1 = make_prompt(10 * CLUSTER_BLOCK_SIZE, seed=220)
    [answer] = tiny_greedy([turn1], 6 * CLUSTER_BLOCK_SIZE)
    turn2 = turn1 + answer + make_prompt(8, seed=221)
    [expected] = tiny_greedy([turn2], 8)
    async with local_cluster("tiny", num_prefill=1, num_decode=2, worker_args=CLUSTER_ARGS) as cluster:
        async with KVServiceClient(cluster.address) as client:
            first = await client.complete(turn1, timeout=60, max_tokens=len(answer), temperature=0, ignore_eos=True)
        assert list(first.token_ids) == answer
        decoders = cluster.decode_addresses
        stats = await wait_for_stats(
            decoders, lambda s: sum(s[a].num_finished_requests for a in decoders) == 1, "the turn counted"
        )
        [holder] = [a for a in decoders if stats[a].num_finished_requests == 1]
        [other] = [a for a in decoders if a != holder]
        token = secrets.token_bytes(32)
        async with grpc.aio.insecure_channel(holder) as channel:
            exported = await pb_grpc.WorkerStub(channel).ExportKV(
                pb.ExportKVRequest(request_id="moved", transfer_token=token, prompt_token_ids=turn2)
            )
        assert exported.num_tokens == 15 * CLUSTER_BLOCK_SIZE  # the turn and its answer but the last token
        source = pb.PrefixSource(
            remote_address=holder,
            transfer_token=token,
            num_tokens=exported.num_tokens,
            last_block_hash=exported.last_block_hash,
            source_role="decode",
        )
        request = build_request(turn2, request_id="moved", max_tokens=8, temperature=0, ignore_eos=True)
        async with grpc.aio.insecure_channel(other) as channel:
            responses = pb_grpc.WorkerStub(channel).Decode(pb.DecodeRequest(request=request, prefix_source=source))
            tokens = [t async for response in responses for t in response.token_ids]
        assert tokens == expected
        after = await all_worker_stats([holder, other])
        assert after[other].kv_offload.num_peer_blocks_from_decode == 15
        assert after[other].kv_offload.num_peer_pulls_failed == 0
        assert after[holder].kv_offload.num_blocks_exported == 15


def test_a_prefix_source_is_checked_like_any_kv_peer() -> None:
    source = pb.PrefixSource(remote_address="127.0.0.1:9", transfer_token=b"t", num_tokens=16, last_block_hash=5)
    params = prefix_source_params(source, frozenset({"127.0.0.1:9"}))
    assert params[PREFIX_ADDRESS] == "127.0.0.1:9" and params[PREFIX_NUM_TOKENS] == 16
    assert params[PREFIX_LAST_HASH] == 5 and params[PREFIX_ROLE] == "decode"  # unnamed: not a prefill worker
    with pytest.raises(PeerNotAllowed, match="--kv-peers"):
        prefix_source_params(source, frozenset({"127.0.0.1:10"}))
    with pytest.raises(ValueError, match="HOST:PORT"):
        prefix_source_params(pb.PrefixSource(remote_address="unix:/tmp/s", transfer_token=b"t", num_tokens=16))
    with pytest.raises(ValueError, match="required"):
        prefix_source_params(pb.PrefixSource(remote_address="127.0.0.1:9", num_tokens=16))
