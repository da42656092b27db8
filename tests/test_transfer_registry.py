"""Tests for kvservice.connector.transfer_registry: the prefill side's book of staged transfers.

Waits are driven by the registry's own wake-ups (events set through the loop), never by
sleeping; `_let_started_tasks_run` only hands the loop one turn so that a task created just
before has run up to its first `await` (asyncio runs ready callbacks in FIFO order).
"""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from kvservice.connector.staging import StagingPool
from kvservice.connector.transfer_registry import (
    MAX_REJECTED,
    StagedTransfer,
    StagingExhausted,
    TransferDenied,
    TransferNotFound,
    TransferRegistry,
    TransferState,
)
from kvservice.model.kv_cache import KVCacheLayout

# 2 layers x [2, 4, 1, 8] float32 = 256 bytes per block per layer, 512 per block.
LAYOUT = KVCacheLayout(num_layers=2, block_size=4, num_kv_heads=1, head_dim=8, dtype=torch.float32)
BLOCK_BYTES = LAYOUT.bytes_per_block
TOKEN = b"secret-token"
LEASE = 30.0
WAIT = 10.0  # a deadline for waits that must end much sooner; never reached when the code is right


def make_registry(num_blocks: int = 4) -> TransferRegistry:
    return TransferRegistry(StagingPool(num_blocks * BLOCK_BYTES), LAYOUT, lease_seconds=LEASE)


async def _let_started_tasks_run() -> None:
    """Return once every task created before this call has run up to its first suspension."""
    loop = asyncio.get_running_loop()
    turn = loop.create_future()
    loop.call_soon(turn.set_result, None)
    await turn


def _stage_all(registry: TransferRegistry, transfer: StagedTransfer, fill: float) -> None:
    """Stage every block of every layer (one chunk per layer) as the engine thread would."""
    for layer in range(LAYOUT.num_layers):
        chunk, view = registry.chunk_buffer(transfer, layer, 0, transfer.num_blocks)
        view.fill_(fill + layer)
        registry.publish(transfer, chunk)


# ---------------------------------------------------------------- registration


def test_register_reserves_staging_for_the_whole_prompt() -> None:
    registry = make_registry(num_blocks=4)
    transfer = registry.register("a", TOKEN, num_tokens=5)  # 2 blocks of 4 tokens
    assert transfer.num_blocks == 2
    assert transfer.buffer.num_bytes >= 2 * BLOCK_BYTES
    assert registry.pool.bytes_in_use == transfer.buffer.num_bytes == 2 * BLOCK_BYTES
    assert registry.get("a") is transfer and registry.num_transfers == 1
    assert transfer.state is TransferState.STAGING


def test_prompt_larger_than_the_pool_is_refused() -> None:
    registry = make_registry(num_blocks=4)
    with pytest.raises(StagingExhausted, match="larger than the whole staging pool"):
        registry.register("big", TOKEN, num_tokens=4 * 4 + 1)
    assert registry.pool.bytes_in_use == 0 and registry.num_transfers == 0


def test_full_pool_refuses_until_space_frees() -> None:
    registry = make_registry(num_blocks=4)
    registry.register("a", TOKEN, num_tokens=12)  # 3 blocks
    with pytest.raises(StagingExhausted, match="full"):
        registry.register("b", TOKEN, num_tokens=8)  # 2 blocks: only 1 free
    assert registry.pool.bytes_in_use == 3 * BLOCK_BYTES
    registry.fail("a", "aborted")  # nobody holds it: released at once
    assert registry.register("b", TOKEN, num_tokens=8).num_blocks == 2


def test_same_request_id_cannot_register_twice() -> None:
    registry = make_registry()
    registry.register("a", TOKEN, num_tokens=4)
    with pytest.raises(TransferDenied, match="already has a staged transfer"):
        registry.register("a", b"other", num_tokens=4)
    assert registry.pool.bytes_in_use == BLOCK_BYTES


async def test_register_when_space_waits_and_succeeds_when_space_frees() -> None:
    registry = make_registry(num_blocks=4)
    registry.register("a", TOKEN, num_tokens=12)  # 3 of 4 blocks
    waiting = asyncio.ensure_future(registry.register_when_space("b", TOKEN, num_tokens=8, timeout=WAIT))
    await _let_started_tasks_run()
    assert not waiting.done(), "registered although the pool was full"
    registry.fail("a", "aborted")  # frees 3 blocks and wakes the waiter
    transfer = await asyncio.wait_for(waiting, WAIT)
    assert transfer.request_id == "b" and registry.get("b") is transfer
    assert registry.pool.bytes_in_use == 2 * BLOCK_BYTES


async def test_register_when_space_is_woken_by_a_release_on_another_thread() -> None:
    """The engine thread releases staging (a failed prefill): the waiter on the loop still wakes."""
    registry = make_registry(num_blocks=2)
    registry.register("a", TOKEN, num_tokens=8)
    waiting = asyncio.ensure_future(registry.register_when_space("b", TOKEN, num_tokens=8, timeout=WAIT))
    await _let_started_tasks_run()
    assert not waiting.done()
    await asyncio.to_thread(registry.fail, "a", "aborted")
    assert (await asyncio.wait_for(waiting, WAIT)).request_id == "b"


async def test_register_when_space_gives_up_at_its_deadline() -> None:
    registry = make_registry(num_blocks=2)
    registry.register("a", TOKEN, num_tokens=8)
    with pytest.raises(StagingExhausted):
        await registry.register_when_space("b", TOKEN, num_tokens=4, timeout=0.0)
    assert registry.get("b") is None and registry.pool.bytes_in_use == 2 * BLOCK_BYTES


async def test_register_when_space_fails_at_once_when_it_can_never_fit() -> None:
    registry = make_registry(num_blocks=2)
    with pytest.raises(StagingExhausted, match="larger than the whole staging pool"):
        await asyncio.wait_for(registry.register_when_space("big", TOKEN, num_tokens=100, timeout=WAIT), WAIT / 2)


# ---------------------------------------------------------------- early pulls


async def test_early_pull_waits_for_registration() -> None:
    registry = make_registry()
    pull = asyncio.ensure_future(registry.wait_registered("a", TOKEN, timeout=WAIT))
    await _let_started_tasks_run()
    assert not pull.done(), "the pull did not wait for the prefill to register"
    transfer = registry.register("a", TOKEN, num_tokens=4)
    assert await asyncio.wait_for(pull, WAIT) is transfer


async def test_pull_after_registration_returns_at_once() -> None:
    registry = make_registry()
    transfer = registry.register("a", TOKEN, num_tokens=4)
    assert await registry.wait_registered("a", TOKEN, timeout=0.0) is transfer


async def test_pull_for_a_transfer_never_registered_ends_at_its_deadline() -> None:
    registry = make_registry()
    with pytest.raises(TransferNotFound, match="no transfer registered"):
        await registry.wait_registered("ghost", TOKEN, timeout=0.0)


async def test_reject_makes_a_waiting_early_pull_fail_at_once() -> None:
    registry = make_registry()
    pull = asyncio.ensure_future(registry.wait_registered("a", TOKEN, timeout=WAIT))
    await _let_started_tasks_run()
    assert not pull.done()
    started = time.monotonic()
    registry.reject("a", TOKEN, "staging full")
    with pytest.raises(TransferNotFound, match="staging full"):
        await asyncio.wait_for(pull, WAIT)
    assert time.monotonic() - started < WAIT / 2  # woken by the rejection, not by its deadline


async def test_pull_arriving_after_a_rejection_fails_at_once() -> None:
    registry = make_registry()
    registry.reject("a", TOKEN, "invalid prompt")
    with pytest.raises(TransferNotFound, match="invalid prompt"):
        await asyncio.wait_for(registry.wait_registered("a", TOKEN, timeout=WAIT), WAIT / 2)


def test_reject_does_not_touch_a_registered_transfer() -> None:
    registry = make_registry()
    transfer = registry.register("a", TOKEN, num_tokens=4)
    registry.reject("a", TOKEN, "late refusal")
    assert registry.get("a") is transfer and transfer.state is TransferState.STAGING


# ---------------------------------------------------------------- pulling


async def test_wrong_token_is_denied_and_does_not_claim_the_transfer() -> None:
    registry = make_registry()
    transfer = registry.register("a", TOKEN, num_tokens=4)
    with pytest.raises(TransferDenied, match="transfer_token"):
        registry.start_pull(transfer, b"guess")
    with pytest.raises(TransferDenied, match="transfer_token"):
        registry.start_pull(transfer, b"")
    # The rightful puller still gets it.
    changed = registry.start_pull(transfer, TOKEN)
    registry.end_pull(transfer, changed)


async def test_second_pull_is_denied() -> None:
    registry = make_registry()
    transfer = registry.register("a", TOKEN, num_tokens=4)
    changed = registry.start_pull(transfer, TOKEN)
    with pytest.raises(TransferDenied, match="already pulled"):
        registry.start_pull(transfer, TOKEN)
    registry.end_pull(transfer, changed)
    with pytest.raises(TransferDenied, match="already pulled"):
        registry.start_pull(transfer, TOKEN)


async def test_a_complete_pull_sees_every_chunk_then_frees_the_staging() -> None:
    registry = make_registry(num_blocks=4)
    released: list[str] = []
    registry.on_release = lambda t: released.append(t.request_id)
    transfer = registry.register("a", TOKEN, num_tokens=7)  # 2 blocks
    changed = registry.start_pull(transfer, TOKEN)
    writer = registry.pin("a")
    assert writer is transfer
    _stage_all(registry, transfer, fill=1.0)
    registry.unpin(writer)
    await asyncio.wait_for(changed.wait(), WAIT)  # publishing woke the pull
    registry.complete("a", first_token_id=42)
    chunks, state = registry.snapshot(transfer, num_seen=0)
    assert state is TransferState.COMPLETE and transfer.first_token_id == 42
    assert [(c.layer, c.first_block, c.num_blocks) for c in chunks] == [(0, 0, 2), (1, 0, 2)]
    # The bytes the pull reads are the bytes the writer staged, chunk by chunk.
    for chunk in chunks:
        data = transfer.buffer.tensor[chunk.offset : chunk.offset + chunk.num_bytes].view(torch.float32)
        assert chunk.num_bytes == 2 * LAYOUT.bytes_per_block_per_layer
        assert bool((data == 1.0 + chunk.layer).all())
    assert registry.snapshot(transfer, num_seen=2)[0] == []
    assert registry.pool.bytes_in_use > 0
    registry.end_pull(transfer, changed)
    assert released == ["a"]
    assert registry.pool.bytes_in_use == 0 and registry.get("a") is None


async def test_pull_ending_before_completion_fails_the_transfer_and_frees_it() -> None:
    registry = make_registry()
    transfer = registry.register("a", TOKEN, num_tokens=4)
    changed = registry.start_pull(transfer, TOKEN)
    registry.end_pull(transfer, changed)  # the decode side went away mid-stream
    assert transfer.state is TransferState.FAILED
    assert registry.pool.bytes_in_use == 0
    assert registry.pin("a") is None  # the prefill's writer finds nothing to stage into


# ---------------------------------------------------------------- pins and leases


def test_buffer_is_not_released_while_pinned() -> None:
    registry = make_registry()
    transfer = registry.register("a", TOKEN, num_tokens=4)
    writer = registry.pin("a")
    assert writer is transfer
    registry.fail("a", "aborted")
    assert transfer.state is TransferState.FAILED
    # The engine thread may still be copying into the buffer: it stays reserved.
    assert registry.pool.bytes_in_use == BLOCK_BYTES
    assert registry.pin("a") is None  # but nobody new may use it
    registry.unpin(writer)
    assert registry.pool.bytes_in_use == 0 and registry.get("a") is None


async def test_buffer_held_by_a_pull_survives_failure_until_the_pull_ends() -> None:
    registry = make_registry()
    transfer = registry.register("a", TOKEN, num_tokens=4)
    changed = registry.start_pull(transfer, TOKEN)
    registry.fail("a", "prefill aborted")
    await asyncio.wait_for(changed.wait(), WAIT)  # the pull is told
    assert registry.snapshot(transfer, 0)[1] is TransferState.FAILED
    assert registry.pool.bytes_in_use == BLOCK_BYTES
    registry.end_pull(transfer, changed)
    assert registry.pool.bytes_in_use == 0


def test_lease_expiry_frees_staging() -> None:
    registry = make_registry()
    transfer = registry.register("a", TOKEN, num_tokens=4)
    registry.register("b", TOKEN, num_tokens=4)
    assert registry.expire(now=time.monotonic()) == []  # within the lease
    assert registry.pool.bytes_in_use == 2 * BLOCK_BYTES
    expired = registry.expire(now=transfer.lease_deadline + LEASE)
    assert sorted(expired) == ["a", "b"]
    assert transfer.state is TransferState.FAILED and "lease expired" in (transfer.error or "")
    assert registry.pool.bytes_in_use == 0 and registry.num_transfers == 0


def test_lease_expiry_waits_for_a_pinned_writer() -> None:
    registry = make_registry()
    transfer = registry.register("a", TOKEN, num_tokens=4)
    writer = registry.pin("a")
    assert registry.expire(now=transfer.lease_deadline + 1) == ["a"]
    assert registry.pool.bytes_in_use == BLOCK_BYTES
    registry.unpin(writer)  # type: ignore[arg-type]
    assert registry.pool.bytes_in_use == 0


async def test_the_lease_never_expires_under_a_streaming_pull() -> None:
    """The pull started after the prefill finished and streams its chunks slowly: however
    long that takes (its own deadline bounds it), it ends with the done frame, not a
    lease failure; once it has ended the transfer is freed as usual."""
    registry = make_registry()
    transfer = registry.register("a", TOKEN, num_tokens=4)
    _stage_all(registry, transfer, fill=1.0)
    registry.complete("a", first_token_id=5)
    changed = registry.start_pull(transfer, TOKEN)
    chunks, _ = registry.snapshot(transfer, num_seen=0)
    assert registry.expire(now=time.monotonic() + 10 * LEASE) == []  # the chunks are still on their way
    rest, state = registry.snapshot(transfer, num_seen=len(chunks))
    assert (rest, state) == ([], TransferState.COMPLETE), transfer.error
    registry.end_pull(transfer, changed)
    assert registry.pool.bytes_in_use == 0 and registry.get("a") is None


async def test_rejections_are_forgotten_when_their_lease_runs_out() -> None:
    registry = make_registry()
    registry.reject("a", TOKEN, "refused")
    with pytest.raises(TransferNotFound, match="refused"):
        await registry.wait_registered("a", TOKEN, timeout=0.0)
    registry.expire(now=time.monotonic() + 2 * LEASE)
    # A later pull for the id waits for a registration again instead of failing as refused.
    pull = asyncio.ensure_future(registry.wait_registered("a", TOKEN, timeout=WAIT))
    await _let_started_tasks_run()
    assert not pull.done()
    transfer = registry.register("a", TOKEN, num_tokens=4)
    assert await asyncio.wait_for(pull, WAIT) is transfer


async def test_a_completed_pull_frees_staging_once_the_last_writer_unpins() -> None:
    """The request finished (and the transfer completed) before the engine thread let go of the
    buffer, as with a deferred finalize; the pull takes everything and ends first. The last
    unpin must then give the staging back: nobody else will."""
    registry = make_registry()
    transfer = registry.register("a", TOKEN, num_tokens=4)
    writer = registry.pin("a")
    assert writer is transfer
    _stage_all(registry, transfer, fill=1.0)
    registry.complete("a", first_token_id=5)
    changed = registry.start_pull(transfer, TOKEN)
    chunks, state = registry.snapshot(transfer, num_seen=0)
    assert state is TransferState.COMPLETE and len(chunks) == LAYOUT.num_layers
    registry.end_pull(transfer, changed)  # the decode side has every chunk and the done frame
    assert registry.pool.bytes_in_use == BLOCK_BYTES  # the writer still holds the buffer
    registry.unpin(writer)
    assert registry.pool.bytes_in_use == 0, "staging leaked until the lease runs out"
    assert registry.get("a") is None


async def test_a_request_id_registered_after_an_earlier_refusal_can_be_pulled() -> None:
    """A client retries a refused request (staging was full) with the same request id; this
    time the prefill registers. The retry's pull must get the transfer, not the old refusal."""
    registry = make_registry()
    registry.reject("a", TOKEN, "staging full")
    transfer = registry.register("a", TOKEN, num_tokens=4)
    assert await registry.wait_registered("a", TOKEN, timeout=0.0) is transfer


# ---------------------------------------------------------------- refusals need the token


async def test_a_release_with_another_token_leaves_a_waiting_pull_waiting() -> None:
    """A caller that does not hold the transfer's token cannot fail its early pull."""
    registry = make_registry()
    pull = asyncio.ensure_future(registry.wait_registered("a", TOKEN, timeout=WAIT))
    await _let_started_tasks_run()
    assert registry.release("a", b"guessed-token") is False
    await _let_started_tasks_run()
    await _let_started_tasks_run()
    assert not pull.done(), "a release without the token failed the pull"
    transfer = registry.register("a", TOKEN, num_tokens=4)
    assert await asyncio.wait_for(pull, WAIT) is transfer


async def test_a_release_with_the_token_fails_a_waiting_pull_at_once() -> None:
    registry = make_registry()
    pull = asyncio.ensure_future(registry.wait_registered("a", TOKEN, timeout=WAIT))
    await _let_started_tasks_run()
    started = time.monotonic()
    assert registry.release("a", TOKEN) is False
    with pytest.raises(TransferNotFound, match="released"):
        await asyncio.wait_for(pull, WAIT)
    assert time.monotonic() - started < WAIT / 2


async def test_remembered_refusals_are_bounded() -> None:
    registry = make_registry()
    for i in range(MAX_REJECTED + 1):
        registry.reject(f"r{i}", TOKEN, "refused")
    # The oldest refusal is forgotten: its pull waits for a registration (deadline 0 here).
    with pytest.raises(TransferNotFound, match="no transfer registered"):
        await registry.wait_registered("r0", TOKEN, timeout=0.0)
    with pytest.raises(TransferNotFound, match="refused"):
        await registry.wait_registered(f"r{MAX_REJECTED}", TOKEN, timeout=0.0)
