"""Conformance of the KV handoff: every transfer state against every fault.

The states and the expected outcome of each (state, fault) pair are written down in
docs/kv_handoff.md; this module checks the prefill side of each pair over a real gRPC
PullKV stream (a `KVTransferService` in this process, `pull_kv` into a local cache):

- no hang: every pull ends well within its deadline;
- no leak: the staging pool is empty afterwards (at once where the state allows it,
  else once the lease has run out - never later);
- the right output or a clear error: a pull that succeeds brings the staged bytes
  bit-identical with the first token, a failed one says why.

The decode side of the same faults (blocks freed, recompute or a clear error) is covered
by tests/test_grpc_connector.py and, across processes with SIGKILL, tests/test_faults.py.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import cast

import grpc
import pytest
import pytest_asyncio
import torch
from pd_pair import ObservedRegistry

from kvservice.connector import wire
from kvservice.connector.kv_puller import LoadResult, LoadSpec, pull_kv
from kvservice.connector.kv_transfer_service import GRPC_OPTIONS, KVTransferService
from kvservice.connector.staging import StagingPool
from kvservice.connector.transfer_registry import StagedTransfer
from kvservice.kv_cache import KVCacheLayout, allocate_kv_caches
from kvservice.outputs import KVTransferCounters
from kvservice.v1 import kvservice_pb2 as pb

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(60)]

LAYOUT = KVCacheLayout(num_layers=3, block_size=4, num_kv_heads=1, head_dim=8, dtype=torch.float32)
NUM_TOKENS = 10  # 3 blocks, the last one partial
NUM_BLOCKS = 3
TOKEN = b"t" * 32
FIRST_TOKEN = 42
LEASE_S = 30.0
REGISTRATION_TIMEOUT_S = 1.0  # how long a pull waits for a prefill that never registers
PULL_TIMEOUT_S = 10.0
WAIT_S = 20.0  # longer than any deadline above: reaching it is a hang

STATES = ["unregistered", "staging", "complete", "pulling"]
FAULTS = ["client_abort", "kill_prefill", "kill_decode", "dropped_stream", "lease_expiry", "late_duplicate_completion"]


@dataclass
class Prefill:
    """The prefill side in this process: registry, PullKV server, and the engine's staging."""

    registry: ObservedRegistry
    server: grpc.aio.Server
    address: str
    expected: list[torch.Tensor]  # per layer [2, NUM_BLOCKS, block_size, kv_heads, head_dim]

    def register(self) -> StagedTransfer:
        return self.registry.register("r", TOKEN, NUM_TOKENS)

    def stage_layer(self, transfer: StagedTransfer, layer: int) -> None:
        chunk, view = self.registry.chunk_buffer(transfer, layer, 0, NUM_BLOCKS)
        view.copy_(self.expected[layer])
        self.registry.publish(transfer, chunk)

    def finish(self, transfer: StagedTransfer) -> None:
        """The rest of the prefill: every remaining layer staged, then the first token."""
        for layer in range(len(transfer.chunks), LAYOUT.num_layers):
            self.stage_layer(transfer, layer)
        self.registry.complete("r", FIRST_TOKEN)

    @property
    def staging_bytes(self) -> int:
        return self.registry.pool.bytes_in_use


@pytest_asyncio.fixture
async def prefill() -> AsyncIterator[Prefill]:
    registry = ObservedRegistry(StagingPool(16 * LAYOUT.bytes_per_block), LAYOUT, lease_seconds=LEASE_S)
    server = grpc.aio.server(options=GRPC_OPTIONS)
    server.add_generic_rpc_handlers([KVTransferService(registry, registration_timeout=REGISTRATION_TIMEOUT_S).handler()])
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    generator = torch.Generator().manual_seed(0)
    expected = [torch.randn(LAYOUT.blocks_shape(NUM_BLOCKS), generator=generator) for _ in range(LAYOUT.num_layers)]
    try:
        yield Prefill(registry, server, f"127.0.0.1:{port}", expected)
    finally:
        await server.stop(None)


class Decode:
    """The decode side's pull, into a local cache whose blocks [1, 1 + NUM_BLOCKS) receive the KV."""

    def __init__(self, address: str) -> None:
        self.channel = grpc.aio.insecure_channel(address, options=GRPC_OPTIONS)
        self.caches = allocate_kv_caches(LAYOUT, NUM_BLOCKS + 2, torch.device("cpu"))
        spec = LoadSpec("r", address, TOKEN, list(range(1, 1 + NUM_BLOCKS)), NUM_TOKENS)
        self.task = asyncio.create_task(pull_kv(self.channel, spec, self.caches, LAYOUT, PULL_TIMEOUT_S, KVTransferCounters()))

    async def result(self) -> LoadResult | None:
        """The pull's result; None when it was cancelled. Never waits past WAIT_S."""
        try:
            return await asyncio.wait_for(asyncio.shield(self.task), WAIT_S)
        except asyncio.CancelledError:
            if self.task.cancelled():
                return None
            raise

    def received(self) -> list[torch.Tensor]:
        return [cache[:, 1 : 1 + NUM_BLOCKS] for cache in self.caches]

    async def close(self) -> None:
        if not self.task.done():
            self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)
        await self.channel.close()


async def _enter(state: str, prefill: Prefill) -> StagedTransfer | None:
    """Bring the transfer into `state` (the pull has been started by then)."""
    if state == "unregistered":
        await asyncio.sleep(0)  # nothing to wait for: the pull is (or will be) waiting
        return None
    transfer = prefill.register()
    prefill.stage_layer(transfer, 0)
    if state == "complete":
        prefill.finish(transfer)
    if state == "pulling":
        await asyncio.wait_for(prefill.registry.pull_started.wait(), WAIT_S)
    return transfer


def _assert_right_output_or_clear_error(result: LoadResult | None, decode: Decode, prefill: Prefill) -> None:
    if result is None:
        return  # cancelled by its own side: nothing to report
    if result.error is None:
        assert result.first_token_id == FIRST_TOKEN
        for got, want in zip(decode.received(), prefill.expected):
            assert torch.equal(got, want), "pulled KV differs from the staged KV"
    else:
        assert len(result.error) > 10, f"unclear error: {result.error!r}"


@pytest.mark.parametrize("fault", FAULTS)
@pytest.mark.parametrize("state", STATES)
async def test_every_state_survives_every_fault(prefill: Prefill, state: str, fault: str) -> None:
    # The pull is started first in every state: before registration it waits for it.
    decode = Decode(prefill.address) if state in ("unregistered", "pulling") else None
    try:
        transfer = await _enter(state, prefill)
        is_freed_at_once = True
        is_prefill_gone = False
        if fault == "client_abort":
            # The proxy cancels both calls: the prefill fails its transfer (or refuses the id),
            # the decode side cancels its pull.
            if transfer is None:
                prefill.registry.reject("r", TOKEN, "the prefill request was refused")
            else:
                prefill.registry.fail("r", "the prefill request was aborted")
            if decode is not None:
                decode.task.cancel()
        elif fault == "kill_prefill":
            await prefill.server.stop(None)  # connections reset; its memory dies with it
            is_prefill_gone = True
        elif fault in ("kill_decode", "dropped_stream"):
            if decode is not None:
                if fault == "kill_decode":
                    decode.task.cancel()
                else:
                    await decode.channel.close()
            # The proxy releases the staging once the decode stream has ended, whatever happened.
            prefill.registry.release("r", TOKEN)
            if transfer is None:
                # The prefill registers after the release (the rejection is cleared): nobody
                # will pull it, so only its lease frees it.
                transfer = prefill.register()
                prefill.finish(transfer)
                is_freed_at_once = False
        elif fault == "lease_expiry":
            expired = prefill.registry.expire(now=time.monotonic() + 2 * LEASE_S)
            if state == "pulling":
                assert expired == [], "the lease expired under a streaming pull"
                assert transfer is not None
                prefill.finish(transfer)
        elif fault == "late_duplicate_completion":
            if transfer is None:
                transfer = prefill.register()
            prefill.finish(transfer)
            if decode is None:
                decode = Decode(prefill.address)
            result = await decode.result()
            assert result is not None and result.error is None, result
            prefill.registry.complete("r", FIRST_TOKEN + 1)  # late, duplicated: a no-op
            assert prefill.registry.release("r", TOKEN) is False  # a late release too
        if decode is None and not is_prefill_gone:
            decode = Decode(prefill.address)  # a pull arriving after the fault
        if decode is not None:
            result = await decode.result()
            _assert_right_output_or_clear_error(result, decode, prefill)
            if fault in ("kill_prefill", "dropped_stream") and result is not None:
                assert result.error is not None
        if is_prefill_gone:
            return
        if is_freed_at_once:
            # Without the lease: as soon as the prefill side has seen the fault (a cancelled
            # pull is noticed a moment after the decode side cancels it).
            try:
                await asyncio.wait_for(prefill.registry.wait_until_empty(), WAIT_S)
            except TimeoutError:
                raise AssertionError(f"{prefill.staging_bytes} staging bytes left after {fault} in {state}") from None
        prefill.registry.expire(now=time.monotonic() + 2 * LEASE_S)
        assert prefill.staging_bytes == 0 and prefill.registry.num_transfers == 0, "staging outlived the lease"
    finally:
        if decode is not None:
            await decode.close()


class _Context:
    """The one part of a servicer context PullKV touches when it succeeds."""

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise AssertionError(f"PullKV aborted: {code.name}: {details}")


async def test_a_release_while_the_done_frame_is_on_its_way_is_a_no_op(prefill: Prefill) -> None:
    """The decode side can read the done frame before the prefill side's stream has ended, and
    the router's ReleaseKV follows at once: it must find the transfer delivered and freed, not
    fail it under the finished pull (seen as a 1-in-20 flake of late_duplicate_completion)."""
    prefill.finish(prefill.register())
    request = pb.PullKVRequest(
        request_id="r", transfer_token=TOKEN, num_layers=LAYOUT.num_layers, block_size=LAYOUT.block_size,
        num_kv_heads=LAYOUT.num_kv_heads, head_dim=LAYOUT.head_dim, dtype=wire.dtype_name(LAYOUT.dtype),
    )
    frames = KVTransferService(prefill.registry).pull_kv(request, cast(grpc.aio.ServicerContext, _Context()))
    async for frame in frames:
        if wire.decode_frame(frame).done is not None:
            break  # the stream is suspended right after handing over its done frame
    else:
        raise AssertionError("no done frame")
    assert prefill.registry.release("r", TOKEN) is False
    assert prefill.staging_bytes == 0 and prefill.registry.num_transfers == 0
    assert [frame async for frame in frames] == []  # and the stream ends OK
