"""KV transfer over gRPC in one process: a prefill engine serving PullKV, a decode engine pulling.

Both engines are plain `LLMEngine`s on the `tiny` model, stepped in worker threads
(`asyncio.to_thread`) while the PullKV server runs on the test's event loop and the
decode connector pulls on its own transfer loop. Stepping them by hand lets the tests
look at both KV caches between steps. Waits are on events (a load finished, staging was
released), each with a deadline that is only reached when something is broken.
"""

from __future__ import annotations

import asyncio
import dataclasses
import secrets

import grpc
import pytest
import torch
from pd_pair import (
    DECODE_PARAMS,
    LAYOUT,
    PREFILL_PARAMS,
    PROMPTS,
    WAIT,
    bits,
    dead_address,
    drive_decode,
    drive_prefill,
    pd_pair,
    prompt_blocks,
)

from kvservice.connector.base import REMOTE_ADDRESS, TRANSFER_TOKEN
from kvservice.connector.kv_puller import LoadSpec, pull_kv
from kvservice.core.outputs import KVTransferCounters
from kvservice.engine.engine import RequestOutput
from kvservice.model.kv_cache import allocate_kv_caches

pytestmark = pytest.mark.timeout(120)


# ---------------------------------------------------------------- correctness


@pytest.mark.parametrize("use_shared_memory", [False, True], ids=["grpc", "shm"])
async def test_concurrent_transfers_equal_a_single_engine_and_blocks_are_bit_identical(
    reference: list[list[int]], use_shared_memory: bool
) -> None:
    """Over the gRPC byte stream, and over the same-host segment (every byte through it)."""
    prefill_kv: dict[str, list[torch.Tensor]] = {}
    decode_kv: dict[str, list[torch.Tensor]] = {}
    lengths = {f"req-{i}": len(p) for i, p in enumerate(PROMPTS)}
    async with pd_pair(use_shared_memory=use_shared_memory) as pair:
        for i, prompt in enumerate(PROMPTS):  # all 8 transfers at once
            pair.add(f"req-{i}", prompt)

        def on_prefill_finished(request_id: str) -> None:
            prefill_kv[request_id] = prompt_blocks(pair.prefill, request_id, lengths[request_id])

        def on_decode_loaded(out: RequestOutput) -> None:
            # The load just completed; nothing has run on these blocks yet.
            decode_kv[out.request_id] = prompt_blocks(pair.decode, out.request_id, lengths[out.request_id])

        prefill_out, decode_out = await asyncio.gather(
            drive_prefill(pair, on_prefill_finished), drive_decode(pair, on_decode_loaded)
        )
        await pair.wait_released(set(lengths))
        stats = pair.decode_connector.stats
        assert (stats.num_transfers, stats.num_failed_transfers) == (len(PROMPTS), 0), (
            "a pull failed: output came from a recompute"
        )
        assert stats.num_shared_memory_bytes == (stats.num_bytes if use_shared_memory else 0) and stats.num_bytes > 0
        pair.assert_everything_free()

    assert set(prefill_kv) == set(decode_kv) == set(lengths)
    for i in range(len(PROMPTS)):
        rid = f"req-{i}"
        assert decode_out[rid].error is None
        assert decode_out[rid].token_ids == reference[i], f"{rid} ({lengths[rid]} tokens)"
        assert prefill_out[rid].token_ids == reference[i][:1]
        for layer, (sent, received) in enumerate(zip(prefill_kv[rid], decode_kv[rid])):
            assert sent.any(), f"{rid} layer {layer}: the prefill wrote no KV"
            assert torch.equal(bits(sent), bits(received)), f"{rid} layer {layer}: pulled KV differs"


async def test_pull_with_a_wrong_token_is_refused_and_the_transfer_stays_pullable(reference: list[list[int]]) -> None:
    prompt = PROMPTS[4]  # 30 tokens, 4 blocks
    async with pd_pair() as pair:
        token = secrets.token_bytes(16)
        pair.registry.register("r", token, len(prompt))
        pair.prefill.add_request(prompt, PREFILL_PARAMS, "r", {TRANSFER_TOKEN: token})
        await drive_prefill(pair)  # staged and complete

        caches = allocate_kv_caches(LAYOUT, 8, torch.device("cpu"))
        for cache in caches:
            cache.normal_()
        before = [c.clone() for c in caches]
        spec = LoadSpec("r", pair.address, b"not-the-token", block_ids=[7, 1, 3, 5], num_tokens=len(prompt))
        async with grpc.aio.insecure_channel(pair.address) as channel:
            result = await pull_kv(channel, spec, caches, LAYOUT, WAIT, KVTransferCounters())
        assert result.first_token_id is None
        assert result.error is not None and "PERMISSION_DENIED" in result.error
        assert all(torch.equal(bits(a), bits(b)) for a, b in zip(before, caches))
        assert pair.registry.pool.bytes_in_use > 0  # still staged

        # The decode worker holding the right token still gets it, and the right output.
        pair.add_decode("r", prompt, pair.address, token)
        out = await drive_decode(pair)
        assert out["r"].token_ids == reference[4]
        assert pair.decode_connector.stats.num_failed_transfers == 0
        await pair.wait_released({"r"})
        pair.assert_everything_free()


@pytest.mark.parametrize("source", ["unknown_request", "dead_address"])
async def test_failed_load_is_recomputed_by_default(source: str, reference: list[list[int]]) -> None:
    prompt = PROMPTS[3]  # 21 tokens, 3 blocks
    async with pd_pair(registration_timeout=0.5) as pair:
        address = pair.address if source == "unknown_request" else dead_address()
        pair.add_decode("never-prefilled", prompt, address, b"token")
        out = await drive_decode(pair)
        assert pair.decode_connector.stats.num_failed_transfers == 1  # the load did fail
        assert out["never-prefilled"].error is None
        assert out["never-prefilled"].token_ids == reference[3]
        pair.assert_everything_free()


@pytest.mark.parametrize("source", ["unknown_request", "dead_address"])
async def test_failed_load_with_policy_fail_ends_the_request_with_an_error(source: str) -> None:
    prompt = PROMPTS[3]
    async with pd_pair("fail", registration_timeout=0.5) as pair:
        address = pair.address if source == "unknown_request" else dead_address()
        pair.add_decode("never-prefilled", prompt, address, b"token")
        out = (await drive_decode(pair))["never-prefilled"]
        assert out.finish_reason == "error" and out.token_ids == []
        assert out.error is not None and "kv_load_failure_policy=fail" in out.error
        pair.assert_everything_free()


async def test_aborting_a_decode_request_while_its_pull_waits_frees_everything() -> None:
    """The pull waits for a prefill that never registers; the abort cancels it long before its deadline."""
    prompt = PROMPTS[2]
    async with pd_pair() as pair:
        pair.add_decode("orphan", prompt, pair.address, b"token")
        pair.decode.step()  # blocks allocated, the pull started
        assert "orphan" in pair.decode.core.scheduler.waiting_for_remote_kv
        assert pair.decode.num_free_blocks < pair.decode.num_blocks
        assert pair.decode.abort_request("orphan")
        out = await drive_decode(pair)  # fails after WAIT (< the registration timeout) if the pull is not cancelled
        assert out["orphan"].finish_reason == "abort"
        pair.assert_everything_free()


async def test_pull_that_arrives_before_the_prefill_registers_waits_for_it(reference: list[list[int]]) -> None:
    prompt = PROMPTS[4]
    async with pd_pair() as pair:
        token = secrets.token_bytes(16)
        pair.add_decode("r", prompt, pair.address, token)
        decoding = asyncio.ensure_future(drive_decode(pair))
        await asyncio.wait_for(pair.registry.pull_arrived.wait(), WAIT)
        assert pair.registry.get("r") is None  # the decode side is first
        # Now the prefill request reaches its worker.
        pair.registry.register("r", token, len(prompt))
        pair.prefill.add_request(prompt, PREFILL_PARAMS, "r", {TRANSFER_TOKEN: token})
        await drive_prefill(pair)
        out = await asyncio.wait_for(decoding, WAIT)
        assert out["r"].token_ids == reference[4]
        assert pair.decode_connector.stats.num_failed_transfers == 0
        await pair.wait_released({"r"})
        pair.assert_everything_free()


async def test_prefill_aborted_mid_transfer_is_recomputed_on_the_decode_side(reference: list[list[int]]) -> None:
    prompt = PROMPTS[4]  # 30 tokens: two prefill steps of 16
    async with pd_pair() as pair:
        pair.add("r", prompt)
        decoding = asyncio.ensure_future(drive_decode(pair))
        await asyncio.wait_for(pair.registry.pull_started.wait(), WAIT)
        await asyncio.to_thread(pair.prefill.step)  # the first 16 tokens: 2 blocks staged per layer
        assert pair.registry.get("r").chunks  # type: ignore[union-attr]
        assert pair.prefill.abort_request("r")
        prefill_out = await drive_prefill(pair)
        assert prefill_out["r"].finish_reason == "abort"
        out = await asyncio.wait_for(decoding, WAIT)
        assert pair.decode_connector.stats.num_failed_transfers == 1
        assert out["r"].error is None and out["r"].token_ids == reference[4]
        await pair.wait_released({"r"})
        pair.assert_everything_free()


async def test_decode_aborted_mid_transfer_frees_blocks_and_staging() -> None:
    prompt = PROMPTS[4]
    async with pd_pair() as pair:
        pair.add("r", prompt)
        pair.decode.step()  # allocates the blocks and starts the pull
        await asyncio.wait_for(pair.registry.pull_started.wait(), WAIT)
        await asyncio.to_thread(pair.prefill.step)  # part of the prompt is staged and streaming
        assert pair.decode.abort_request("r")
        decode_out, _ = await asyncio.gather(drive_decode(pair), drive_prefill(pair))
        assert decode_out["r"].finish_reason == "abort"
        await pair.wait_released({"r"})
        pair.assert_everything_free()


async def test_remote_first_token_alone_can_finish_the_request(reference: list[list[int]]) -> None:
    prompt = PROMPTS[1]
    async with pd_pair() as pair:
        token = secrets.token_bytes(16)
        pair.registry.register("r", token, len(prompt))
        pair.prefill.add_request(prompt, PREFILL_PARAMS, "r", {TRANSFER_TOKEN: token})
        one_token = dataclasses.replace(DECODE_PARAMS, max_tokens=1)
        pair.decode.add_request(prompt, one_token, "r", {REMOTE_ADDRESS: pair.address, TRANSFER_TOKEN: token})
        _, out = await asyncio.gather(drive_prefill(pair), drive_decode(pair))
        assert out["r"].token_ids == reference[1][:1] and out["r"].finish_reason == "length"
        await pair.wait_released({"r"})
        pair.assert_everything_free()


async def test_pull_with_a_different_kv_layout_is_refused() -> None:
    prompt = PROMPTS[0]
    other = dataclasses.replace(LAYOUT, block_size=4)
    async with pd_pair() as pair:
        token = secrets.token_bytes(16)
        pair.registry.register("r", token, len(prompt))
        caches = allocate_kv_caches(other, 4, torch.device("cpu"))
        spec = LoadSpec("r", pair.address, token, block_ids=[0], num_tokens=len(prompt))
        async with grpc.aio.insecure_channel(pair.address) as channel:
            result = await pull_kv(channel, spec, caches, other, WAIT, KVTransferCounters())
        assert result.error is not None and "FAILED_PRECONDITION" in result.error and "block_size" in result.error
        assert not any(bool(c.any()) for c in caches)
        assert pair.registry.get("r") is not None  # untouched: its own decode worker can still pull it
        pair.registry.fail("r", "test over")
        pair.assert_everything_free()
