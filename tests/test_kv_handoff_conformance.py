"""Conformance of the KV handoff: every transfer state against every fault.

The states and the expected outcome of each (state, fault) pair are written down in
docs/kv_handoff.md. The prefill side of each pair is checked over a real gRPC PullKV
stream (a `KVTransferService` in this process, `pull_kv` into a local cache):

- no hang: every pull ends well within its deadline;
- no leak: the staging pool is empty afterwards (at once where the state allows it,
  else once the lease has run out - never later);
- the right output or a clear error: a pull that succeeds brings the staged bytes
  bit-identical with the first token, a failed one says why.

The decode side of each pair runs two engines on the tiny model (tests/pd_pair.py), the
decode one pulling through a TCP relay that can drop the stream: every block freed on both
sides, no staging byte left without waiting for a lease, and the right tokens (pulled or
recomputed, as `EXPECTED` says) or an abort. Across processes with SIGKILL: tests/test_faults.py.

A peer pull (a prompt's leading blocks that another worker exported) meets the same faults mid-pull:
the source killed, the stream dropped, the source releasing the blocks (it no longer holds them),
its lease running out, the client going away. The puller recomputes or aborts, and nothing leaks.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import cast

import grpc
import pytest
import pytest_asyncio
import torch
from pd_pair import (
    DECODE_PARAMS,
    MAX_STEPS,
    PREFILL_PARAMS,
    PROMPTS,
    WAIT,
    ObservedRegistry,
    Pair,
    Relay,
    dead_address,
    drive_decode,
    drive_prefill,
    pd_pair,
    relay,
)

from kvservice.connector import wire
from kvservice.connector.base import (
    PREFIX_ADDRESS,
    PREFIX_LAST_HASH,
    PREFIX_NUM_TOKENS,
    PREFIX_ROLE,
    PREFIX_TOKEN,
    TRANSFER_TOKEN,
)
from kvservice.connector.kv_puller import LoadResult, LoadSpec, pull_kv
from kvservice.connector.kv_transfer_service import KVTransferService, OutgoingChunk
from kvservice.connector.prefix_export import export_prefix
from kvservice.connector.shared_memory import RingWriter
from kvservice.connector.staging import StagingPool
from kvservice.connector.transfer_registry import StagedChunk, StagedTransfer
from kvservice.core.outputs import KVTransferCounters
from kvservice.engine.engine import RequestOutput
from kvservice.model.kv_cache import KVCacheLayout, allocate_kv_caches
from kvservice.runtime.grpc_options import GRPC_OPTIONS
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
    server.add_generic_rpc_handlers(
        [KVTransferService(registry, registration_timeout=REGISTRATION_TIMEOUT_S).handler()]
    )
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
        self.task = asyncio.create_task(
            pull_kv(self.channel, spec, self.caches, LAYOUT, PULL_TIMEOUT_S, KVTransferCounters())
        )

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


@dataclass
class PrefillHandoff:
    """Transfer "r" on the prefill side, and the decode side's pull of it once one started."""

    prefill: Prefill
    decode: Decode | None
    transfer: StagedTransfer | None = None
    is_freed_at_once: bool = True  # False: only its lease frees the staging
    is_prefill_gone: bool = False

    def abort_both(self) -> None:
        """client_abort. The proxy cancels both calls: the prefill fails its transfer (or refuses
        the id), the decode side cancels its pull."""
        if self.transfer is None:
            self.prefill.registry.reject("r", TOKEN, "the prefill request was refused")
        else:
            self.prefill.registry.fail("r", "the prefill request was aborted")
        if self.decode is not None:
            self.decode.task.cancel()

    async def end_decode_stream(self, fault: str) -> None:
        """kill_decode (the pull cancelled) or dropped_stream (its channel closed), then the release."""
        if self.decode is not None:
            if fault == "kill_decode":
                self.decode.task.cancel()
            else:
                await self.decode.channel.close()
        # The proxy releases the staging once the decode stream has ended, whatever happened.
        self.prefill.registry.release("r", TOKEN)
        if self.transfer is None:
            # The prefill registers after the release (the rejection is cleared): nobody
            # will pull it, so only its lease frees it.
            self.transfer = self.prefill.register()
            self.prefill.finish(self.transfer)
            self.is_freed_at_once = False

    def expire_lease(self, state: str) -> None:
        """lease_expiry: every lease runs out, except under a streaming pull."""
        expired = self.prefill.registry.expire(now=time.monotonic() + 2 * LEASE_S)
        if state == "pulling":
            assert expired == [], "the lease expired under a streaming pull"
            assert self.transfer is not None
            self.prefill.finish(self.transfer)

    async def complete_twice(self) -> None:
        """late_duplicate_completion: the transfer completes and is pulled; then a second
        completion and a release arrive late, both no-ops."""
        if self.transfer is None:
            self.transfer = self.prefill.register()
        self.prefill.finish(self.transfer)
        if self.decode is None:
            self.decode = Decode(self.prefill.address)
        result = await self.decode.result()
        assert result is not None and result.error is None, result
        self.prefill.registry.complete("r", FIRST_TOKEN + 1)  # late, duplicated: a no-op
        assert self.prefill.registry.release("r", TOKEN) is False  # a late release too


async def _inject_fault(h: PrefillHandoff, state: str, fault: str) -> None:
    if fault == "client_abort":
        h.abort_both()
    elif fault == "kill_prefill":
        await h.prefill.server.stop(None)  # connections reset; its memory dies with it
        h.is_prefill_gone = True
    elif fault in ("kill_decode", "dropped_stream"):
        await h.end_decode_stream(fault)
    elif fault == "lease_expiry":
        h.expire_lease(state)
    elif fault == "late_duplicate_completion":
        await h.complete_twice()


async def _assert_staging_freed(prefill: Prefill, is_freed_at_once: bool, state: str, fault: str) -> None:
    """No staging byte outlives the lease; with `is_freed_at_once`, none waits for it."""
    if is_freed_at_once:
        # Without the lease: as soon as the prefill side has seen the fault (a cancelled
        # pull is noticed a moment after the decode side cancels it).
        try:
            await asyncio.wait_for(prefill.registry.wait_until_empty(), WAIT_S)
        except TimeoutError:
            raise AssertionError(f"{prefill.staging_bytes} staging bytes left after {fault} in {state}") from None
    prefill.registry.expire(now=time.monotonic() + 2 * LEASE_S)
    assert prefill.staging_bytes == 0 and prefill.registry.num_transfers == 0, "staging outlived the lease"


@pytest.mark.parametrize("fault", FAULTS)
@pytest.mark.parametrize("state", STATES)
async def test_every_state_survives_every_fault(prefill: Prefill, state: str, fault: str) -> None:
    # The pull is started first in every state: before registration it waits for it.
    h = PrefillHandoff(prefill, Decode(prefill.address) if state in ("unregistered", "pulling") else None)
    try:
        h.transfer = await _enter(state, prefill)
        await _inject_fault(h, state, fault)
        if h.decode is None and not h.is_prefill_gone:
            h.decode = Decode(prefill.address)  # a pull arriving after the fault
        if h.decode is not None:
            result = await h.decode.result()
            _assert_right_output_or_clear_error(result, h.decode, prefill)
            if fault in ("kill_prefill", "dropped_stream") and result is not None:
                assert result.error is not None
        if not h.is_prefill_gone:
            await _assert_staging_freed(prefill, h.is_freed_at_once, state, fault)
    finally:
        if h.decode is not None:
            await h.decode.close()


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
        request_id="r",
        transfer_token=TOKEN,
        num_layers=LAYOUT.num_layers,
        block_size=LAYOUT.block_size,
        num_kv_heads=LAYOUT.num_kv_heads,
        head_dim=LAYOUT.head_dim,
        dtype=wire.dtype_name(LAYOUT.dtype),
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


# ---------------------------------------------------------------- the decode side
#
# Two engines on the tiny model (tests/pd_pair.py): the decode engine pulls from the prefill
# engine's PullKV server through a TCP relay, which can drop the stream. Each state is
# entered for real (the pull waiting for the registration, streaming, done; a failed pull's
# recompute; an abort mid-pull), then the fault hits; both engines then run to the end.

DECODE_STATES = ["waiting", "pulling", "loaded", "recompute", "aborted_while_pulling"]
DECODE_REGISTRATION_TIMEOUT_S = 3.0  # a pull left waiting for a prefill that never comes ends here
# What the decode side's client gets: "pulled" (the right tokens over the transferred KV),
# "recomputed" (the right tokens after a failed pull), "aborted", or "dead" (the decode worker
# itself was killed: only the prefill side is left to check).
EXPECTED: dict[str, dict[str, str]] = {
    "waiting": {
        "client_abort": "aborted",
        "kill_prefill": "recomputed",
        "kill_decode": "dead",
        "dropped_stream": "recomputed",
        "lease_expiry": "recomputed",
        "late_duplicate_completion": "pulled",
    },
    "pulling": {
        "client_abort": "aborted",
        "kill_prefill": "recomputed",
        "kill_decode": "dead",
        "dropped_stream": "recomputed",
        "lease_expiry": "pulled",
        "late_duplicate_completion": "pulled",
    },
    "loaded": {
        "client_abort": "aborted",
        "kill_prefill": "pulled",
        "kill_decode": "dead",
        "dropped_stream": "pulled",
        "lease_expiry": "pulled",
        "late_duplicate_completion": "pulled",
    },
    "recompute": {
        "client_abort": "aborted",
        "kill_prefill": "recomputed",
        "kill_decode": "dead",
        "dropped_stream": "recomputed",
        "lease_expiry": "recomputed",
        "late_duplicate_completion": "recomputed",
    },
    "aborted_while_pulling": dict.fromkeys(FAULTS, "aborted") | {"kill_decode": "dead"},
}
DECODE_PROMPT = PROMPTS[4]  # 30 tokens: two prefill steps of 16, 4 blocks


@dataclass
class Handoff:
    """One request, "r", handed from the prefill engine to the decode engine."""

    pair: Pair
    relay: Relay
    token: bytes = TOKEN
    has_prefill: bool = False  # the prefill request reached the prefill engine
    is_prefill_dead: bool = False
    is_decode_dead: bool = False

    def add_prefill(self) -> None:
        self.pair.registry.register("r", self.token, len(DECODE_PROMPT))
        self.pair.prefill.add_request(DECODE_PROMPT, PREFILL_PARAMS, "r", {TRANSFER_TOKEN: self.token})
        self.has_prefill = True

    def add_decode(self, address: str | None = None) -> None:
        self.pair.add_decode("r", DECODE_PROMPT, address or self.relay.address, self.token)

    async def step_decode_until(self, condition: Callable[[], bool], what: str) -> None:
        """Step the decode engine until `condition` holds, waiting for loads when only they can change it."""
        for _ in range(MAX_STEPS):
            if condition():
                return
            self.pair.load_done.clear()
            if not await asyncio.to_thread(self.pair.decode.step) and not condition():
                await asyncio.wait_for(self.pair.load_done.wait(), WAIT)
        raise AssertionError(f"decode side never {what}")


async def _enter_decode_state(h: Handoff, state: str) -> None:
    sched = h.pair.decode.core.scheduler
    if state == "recompute":
        h.add_decode(dead_address())  # the prefill never comes: the pull fails at once
        await h.step_decode_until(
            lambda: h.pair.decode_connector.stats.num_failed_transfers == 1 and "r" not in sched.waiting_for_remote_kv,
            "gave the pull up",
        )
        return
    if state != "waiting":
        h.add_prefill()
    h.add_decode()
    await asyncio.to_thread(h.pair.decode.step)  # blocks allocated, the pull started
    assert "r" in sched.waiting_for_remote_kv
    await asyncio.wait_for(h.pair.registry.pull_arrived.wait(), WAIT)
    if state == "waiting":
        return
    await asyncio.wait_for(h.pair.registry.pull_started.wait(), WAIT)
    await asyncio.to_thread(h.pair.prefill.step)  # the first 16 tokens staged: the pull streams them
    if state == "aborted_while_pulling":
        assert h.pair.decode.abort_request("r")
    elif state == "loaded":
        await drive_prefill(h.pair)
        await h.step_decode_until(lambda: any(r.request_id == "r" for r in sched.running), "loaded the KV")


async def _inject_decode_fault(h: Handoff, fault: str) -> None:
    if fault == "client_abort":
        # The proxy cancels both calls: each worker aborts its request.
        h.pair.decode.abort_request("r")
        if h.has_prefill:
            h.pair.prefill.abort_request("r")
    elif fault == "kill_prefill":
        await h.pair.server.stop(None)  # connections reset; its memory dies with it
        h.is_prefill_dead = True
    elif fault == "kill_decode":
        await asyncio.to_thread(h.pair.decode_connector.shutdown)  # its pulls and connections die with it
        h.is_decode_dead = True
    elif fault == "dropped_stream":
        h.relay.cut()
    elif fault == "lease_expiry":
        transfer = h.pair.registry.get("r")
        is_pulling = transfer is not None and transfer.is_pull_active
        expired = h.pair.registry.expire(now=time.monotonic() + 2 * h.pair.registry.lease_seconds)
        assert not (is_pulling and "r" in expired), "the lease expired under a streaming pull"
    elif fault == "late_duplicate_completion" and not h.has_prefill:
        h.add_prefill()  # the prefill arrives (or completes) after the decode side moved on


def _assert_decode_free(h: Handoff) -> None:
    engine = h.pair.decode
    assert engine.num_free_blocks == engine.num_blocks and engine.core.scheduler.kv.block_tables == {}, (
        "decode blocks leaked"
    )


@pytest.mark.parametrize("draft", [None, "tiny"], ids=["target", "target+draft"])
@pytest.mark.parametrize("fault", FAULTS)
@pytest.mark.parametrize("state", DECODE_STATES)
async def test_every_decode_state_survives_every_fault(
    state: str, fault: str, draft: str | None, reference: list[list[int]]
) -> None:
    """With a speculative draft on both sides too: its KV travels on the same pull, and no block
    of either model leaks."""
    expected = EXPECTED[state][fault]
    pairing = pd_pair(registration_timeout=DECODE_REGISTRATION_TIMEOUT_S, prefill_draft=draft, decode_draft=draft)
    async with pairing as pair, relay(pair.address) as cut:
        h = Handoff(pair, cut)
        await _enter_decode_state(h, state)
        await _inject_decode_fault(h, fault)
        # Both sides run to the end (the prefill engine unless it was killed).
        runs: list[Awaitable[dict[str, RequestOutput]]] = []
        if not h.is_decode_dead:
            runs.append(asyncio.wait_for(drive_decode(pair), WAIT))
        if h.has_prefill and not h.is_prefill_dead:
            runs.append(asyncio.wait_for(drive_prefill(pair), WAIT))
        outputs = await asyncio.gather(*runs)
        stats = pair.decode_connector.stats
        if not h.is_decode_dead:
            out = outputs[0]["r"]
            if expected == "aborted":
                assert out.finish_reason == "abort", out
            else:
                assert out.error is None and out.token_ids == reference[4], out
                num_failed = 1 if expected == "recomputed" else 0
                assert stats.num_failed_transfers == num_failed, f"expected the KV {expected}, {stats}"
            _assert_decode_free(h)
        else:
            assert expected == "dead"
        if h.is_prefill_dead:
            return  # its staging died with it
        if fault == "late_duplicate_completion" and h.has_prefill:
            pair.registry.complete("r", 0)  # late and duplicated: a no-op
        # The proxy's ReleaseKV once the decode stream ended; a pulled transfer is gone already.
        was_staged = pair.registry.release("r", h.token)
        if expected == "pulled":
            assert not was_staged, "staging outlived a completed pull"
        try:
            await asyncio.wait_for(pair.registry.wait_until_empty(), WAIT)
        except TimeoutError:
            raise AssertionError(
                f"{pair.registry.pool.bytes_in_use} staging bytes left after {fault} in {state}"
            ) from None
        assert pair.prefill.num_free_blocks == pair.prefill.num_blocks, "prefill blocks leaked"


# ---------------------------------------------------------------- peer pulls
#
# The pair's prefill engine is the source: it caches a prefix, exports it, and its PullKV stalls
# after the first chunk, so that each fault hits a pull in flight. The decode engine pulls the
# prefix as a prefix source (no first token) and computes the rest of its prompt.

PEER_FAULTS = ["client_abort", "kill_source", "dropped_stream", "source_released", "lease_expiry"]
PEER_EXPECTED = {
    "client_abort": "aborted",
    "kill_source": "recomputed",
    "dropped_stream": "recomputed",
    "source_released": "recomputed",
    "lease_expiry": "pulled",  # a lease never runs out under a streaming pull
}
PEER_PROMPT = PROMPTS[4]  # 30 tokens
PEER_PREFIX = PEER_PROMPT[:24]  # what the source caches: 3 blocks of 8


class _StallingService(KVTransferService):
    """PullKV that sends one chunk, then waits for `resume` before the rest."""

    stalled: asyncio.Event
    resume: asyncio.Event

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self._num_encoded = 0

    async def encode_chunk(
        self, transfer: StagedTransfer, chunk: StagedChunk, ring: RingWriter | None
    ) -> OutgoingChunk | None:
        self._num_encoded += 1
        if self._num_encoded == 2:
            self.stalled.set()
            await self.resume.wait()
        return await super().encode_chunk(transfer, chunk, ring)


async def _inject_peer_fault(pair: Pair, cut: Relay, service: type[_StallingService], fault: str) -> None:
    if fault == "client_abort":
        assert pair.decode.abort_request("r")
    elif fault == "kill_source":
        await pair.server.stop(None)
    elif fault == "dropped_stream":
        cut.cut()
    elif fault == "source_released":
        assert pair.registry.release("r", TOKEN)
    elif fault == "lease_expiry":
        assert pair.registry.expire(now=time.monotonic() + 2 * pair.registry.lease_seconds) == []
    service.resume.set()


@pytest.mark.parametrize("fault", PEER_FAULTS)
async def test_a_peer_pull_survives_every_fault(fault: str, reference: list[list[int]]) -> None:
    expected = PEER_EXPECTED[fault]
    service = cast(
        type[_StallingService],
        type("Stalling", (_StallingService,), {"stalled": asyncio.Event(), "resume": asyncio.Event()}),
    )
    async with pd_pair(service=service) as pair, relay(pair.address) as cut:
        pair.prefill.add_request(PEER_PREFIX, PREFILL_PARAMS, "warm", None)
        await drive_prefill(pair)
        core = pair.prefill.core
        exported = export_prefix(core.scheduler.kv, core.kv_caches, pair.registry, "r", TOKEN, PEER_PROMPT)
        assert exported.num_tokens == len(PEER_PREFIX)
        params = {
            PREFIX_ADDRESS: cut.address,
            PREFIX_TOKEN: TOKEN,
            PREFIX_NUM_TOKENS: exported.num_tokens,
            PREFIX_LAST_HASH: exported.last_block_hash,
            PREFIX_ROLE: "prefill",
        }
        pair.decode.add_request(PEER_PROMPT, DECODE_PARAMS, "r", params)
        await asyncio.to_thread(pair.decode.step)  # blocks allocated, the pull started
        await asyncio.wait_for(service.stalled.wait(), WAIT)
        await _inject_peer_fault(pair, cut, service, fault)
        out = (await asyncio.wait_for(drive_decode(pair), WAIT))["r"]
        peer_pulls = pair.decode_connector.peer_pulls
        if expected == "aborted":
            assert out.finish_reason == "abort", out
        else:
            assert out.error is None and out.token_ids == reference[4], out
            assert peer_pulls.num_failed == (expected == "recomputed"), peer_pulls
            assert peer_pulls.num_blocks_from_prefill == (3 if expected == "pulled" else 0), peer_pulls
        engine = pair.decode
        assert engine.num_free_blocks == engine.num_blocks and engine.core.scheduler.kv.block_tables == {}
        if fault == "kill_source":
            return  # its staging died with it
        pair.registry.release("r", TOKEN)  # the proxy's release once the request is done
        await asyncio.wait_for(pair.registry.wait_until_empty(), WAIT)
        assert pair.prefill.num_free_blocks == pair.prefill.num_blocks
