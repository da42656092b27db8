"""The decode side's pull against a fake prefill server: well-formed streams land in the
right blocks; every malformed chunk header, payload or first token is refused before it
touches the cache (docs/kv_handoff.md: receivers validate everything a peer sends)."""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import AsyncIterator, Callable

import grpc
import pytest
import torch
from pd_pair import (
    BLOCK_SIZE,
    DECODE_CONFIG,
    DECODE_PARAMS,
    LAYOUT,
    MAX_TOKENS,
    PROMPTS,
    WAIT,
    bits,
    drive_decode,
    pd_pair,
)

from kvservice.connector import wire
from kvservice.connector.base import REMOTE_ADDRESS, TRANSFER_TOKEN
from kvservice.connector.decode_connector import DecodeKVConnector
from kvservice.connector.kv_puller import LoadSpec, pull_kv
from kvservice.core.kv_cache_manager import cdiv
from kvservice.core.outputs import KVTransferCounters
from kvservice.engine.engine_builder import build_engine
from kvservice.loading.model_files import TINY_CONFIG
from kvservice.model.kv_cache import KVCacheLayout, allocate_kv_caches
from kvservice.v1 import kvservice_pb2 as pb

pytestmark = pytest.mark.timeout(120)


# ---------------------------------------------------------------- malformed chunks

SMALL = KVCacheLayout(num_layers=2, block_size=4, num_kv_heads=2, head_dim=8, dtype=torch.float32)
LOCAL_BLOCKS = [5, 2]  # the decode side's blocks for the 2-block transfer
FIRST_TOKEN = 9


def good_payload(layer: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(100 + layer)
    return torch.randn(SMALL.blocks_shape(2), generator=gen)


def chunk_frame(request_id: str, layer: int = 0, **overrides: object) -> bytes:
    kwargs: dict[str, object] = dict(
        request_id=request_id,
        layer=layer,
        first_block=0,
        num_blocks=2,
        dtype="float32",
        shape=SMALL.blocks_shape(2),
        payload=wire.tensor_bytes(good_payload(layer)),
    )
    kwargs.update(overrides)
    return wire.encode_chunk(**kwargs)  # type: ignore[arg-type]


def done_frame(request_id: str, num_chunks: int) -> bytes:
    return wire.encode_done(
        request_id=request_id, first_token_id=FIRST_TOKEN, num_chunks=num_chunks, num_bytes=0, num_tokens=7
    )


# case -> (the frames the fake prefill sends: one bad chunk, then a done frame; the field the error must name)
MALFORMED: dict[str, tuple[Callable[[str], list[bytes]], str]] = {
    "shape": (lambda rid: [chunk_frame(rid, shape=(2, 2, 4, 2, 4)), done_frame(rid, 1)], "header.shape"),
    "dtype": (lambda rid: [chunk_frame(rid, dtype="float16"), done_frame(rid, 1)], "header.dtype"),
    "block_range": (lambda rid: [chunk_frame(rid, first_block=1), done_frame(rid, 1)], "header.first_block"),
    "checksum": (lambda rid: [chunk_frame(rid, crc32=0x1234), done_frame(rid, 1)], "header.crc32"),
    "request_id": (lambda rid: [chunk_frame("someone-else"), done_frame(rid, 1)], "header.request_id"),
    "layer": (lambda rid: [chunk_frame(rid, layer=SMALL.num_layers), done_frame(rid, 1)], "header.layer"),
    "short_payload": (
        lambda rid: [
            chunk_frame(rid, payload=wire.tensor_bytes(good_payload(0))[: SMALL.bytes_per_block_per_layer]),
            done_frame(rid, 1),
        ],
        "header.num_bytes",
    ),
    "done_before_any_chunk": (lambda rid: [done_frame(rid, 0)], "done: layer 0 is missing blocks"),
}


def tiny_frames(rid: str, num_tokens: int, first_token_id: int) -> list[bytes]:
    """A well-formed transfer in the tiny model's layout (all-zero KV) with the given first token."""
    num_blocks = cdiv(num_tokens, BLOCK_SIZE)
    payload = wire.tensor_bytes(torch.zeros(LAYOUT.blocks_shape(num_blocks)))
    frames = [
        wire.encode_chunk(
            request_id=rid,
            layer=layer,
            first_block=0,
            num_blocks=num_blocks,
            dtype="float32",
            shape=LAYOUT.blocks_shape(num_blocks),
            payload=payload,
        )
        for layer in range(LAYOUT.num_layers)
    ]
    done = wire.encode_done(
        request_id=rid, first_token_id=first_token_id, num_chunks=LAYOUT.num_layers, num_bytes=0, num_tokens=num_tokens
    )
    return [*frames, done]


def fake_frames(request: pb.PullKVRequest) -> list[bytes]:
    rid = request.request_id
    if rid == "out-of-vocab-first-token":
        return tiny_frames(rid, len(PROMPTS[1]), first_token_id=TINY_CONFIG.vocab_size + 1000)
    if rid == "well-formed":
        return [chunk_frame(rid, layer) for layer in range(SMALL.num_layers)] + [done_frame(rid, SMALL.num_layers)]
    make_frames, _ = MALFORMED[rid]
    return make_frames(rid)


@pytest.fixture
async def fake_prefill() -> AsyncIterator[str]:
    """A PullKV server that sends whatever `fake_frames` builds, bytes as they are."""

    async def pull_kv_handler(request_bytes: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        for frame in fake_frames(pb.PullKVRequest.FromString(request_bytes)):
            yield frame

    handler = grpc.method_handlers_generic_handler(
        "kvservice.v1.KVTransfer", {"PullKV": grpc.unary_stream_rpc_method_handler(pull_kv_handler)}
    )
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop(None)


async def pull_from(address: str, request_id: str) -> tuple[object, list[torch.Tensor], list[torch.Tensor]]:
    caches = allocate_kv_caches(SMALL, 8, torch.device("cpu"))
    for cache in caches:
        cache.normal_()
    before = [c.clone() for c in caches]
    spec = LoadSpec(request_id, address, b"token", block_ids=LOCAL_BLOCKS, num_tokens=7)
    async with grpc.aio.insecure_channel(address) as channel:
        result = await pull_kv(channel, spec, caches, SMALL, WAIT, KVTransferCounters())
    return result, before, caches


async def test_fake_prefill_well_formed_stream_is_accepted(fake_prefill: str) -> None:
    """The control for the malformed cases: the same frames, unbroken, land in the right blocks."""
    result, before, caches = await pull_from(fake_prefill, "well-formed")
    assert result.error is None and result.first_token_id == FIRST_TOKEN  # type: ignore[attr-defined]
    others = [b for b in range(8) if b not in LOCAL_BLOCKS]
    for layer in range(SMALL.num_layers):
        assert torch.equal(caches[layer][:, LOCAL_BLOCKS], good_payload(layer))
        assert torch.equal(caches[layer][:, others], before[layer][:, others])


@pytest.mark.parametrize("case", sorted(MALFORMED))
async def test_malformed_chunk_is_rejected_without_touching_the_cache(case: str, fake_prefill: str) -> None:
    result, before, caches = await pull_from(fake_prefill, case)
    _, field_name = MALFORMED[case]
    assert result.first_token_id is None  # type: ignore[attr-defined]
    error = result.error  # type: ignore[attr-defined]
    assert error is not None and "rejected a chunk" in error and field_name in error, error
    assert fake_prefill in error  # names the peer
    for layer in range(SMALL.num_layers):
        assert torch.equal(bits(caches[layer]), bits(before[layer])), f"layer {layer} was written"


async def test_first_token_outside_the_vocabulary_is_a_failed_load(
    fake_prefill: str, reference: list[list[int]]
) -> None:
    """A peer's done frame names a token the model does not have: the decode engine must treat
    the load as failed (and recompute), never feed the id to the model or to the client."""
    async with pd_pair() as pair:
        pair.add_decode("out-of-vocab-first-token", PROMPTS[1], fake_prefill, b"token")
        out = (await drive_decode(pair))["out-of-vocab-first-token"]
        assert all(0 <= t < TINY_CONFIG.vocab_size for t in out.token_ids), out.token_ids
        assert out.error is None and out.token_ids == reference[1]
        pair.assert_everything_free()


# ---------------------------------------------------------------- per-peer pull slots


class _Peer:
    """A fake prefill worker: its PullKV either never answers (black-holed) or ends at once
    NOT_FOUND (healthy, but the transfer is gone: the decode side recomputes)."""

    def __init__(self, is_black_hole: bool) -> None:
        self.is_black_hole = is_black_hole
        self.num_pulls = 0
        self.pulled = asyncio.Event()
        self.server = grpc.aio.server()
        self.server.add_generic_rpc_handlers(
            [
                grpc.method_handlers_generic_handler(
                    "kvservice.v1.KVTransfer", {"PullKV": grpc.unary_stream_rpc_method_handler(self.pull)}
                )
            ]
        )
        self.address = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"

    async def pull(self, request: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        self.num_pulls += 1
        self.pulled.set()
        if self.is_black_hole:
            await asyncio.Event().wait()
        await context.abort(grpc.StatusCode.NOT_FOUND, "no such transfer")
        yield b""


async def test_a_dead_peer_holds_up_neither_other_peers_nor_its_own_deadlines() -> None:
    """One pull slot per peer, all held by a black-holed prefill worker: a pull from a
    healthy one starts at once, and a second pull from the dead one ends at its own
    deadline, counted from its start (the wait for the slot included)."""
    from kvservice.engine.async_engine import AsyncLLMEngine  # the engine thread drives the loads

    timeout = 3.0
    dead, healthy = _Peer(is_black_hole=True), _Peer(is_black_hole=False)
    await dead.server.start()
    await healthy.server.start()
    connector = DecodeKVConnector(LAYOUT, transfer_timeout=timeout, max_concurrent_pulls=1)
    engine = AsyncLLMEngine(build_engine("tiny", DECODE_CONFIG, connector))
    connector.on_load_done = engine.wake
    engine.start()

    async def finish(request_id: str, peer: _Peer) -> float:
        started = loop.time()
        kv = {REMOTE_ADDRESS: peer.address, TRANSFER_TOKEN: secrets.token_bytes(16)}
        async for out in engine.generate(PROMPTS[2], DECODE_PARAMS, request_id, kv):
            if out.finished:
                assert len(out.token_ids) == MAX_TOKENS  # recomputed after the failed load
        return loop.time() - started

    loop = asyncio.get_running_loop()
    try:
        first_dead = asyncio.create_task(finish("dead-1", dead))
        await asyncio.wait_for(dead.pulled.wait(), WAIT)  # it holds the dead peer's only slot
        second_dead = asyncio.create_task(finish("dead-2", dead))
        assert await asyncio.wait_for(finish("healthy", healthy), WAIT) < timeout / 2
        assert healthy.num_pulls == 1
        await asyncio.wait_for(first_dead, WAIT)
        # It waited for the slot until the first gave it up, then had what was left.
        assert await asyncio.wait_for(second_dead, WAIT) < timeout * 1.5
    finally:
        await engine.stop()
        connector.shutdown()
        await dead.server.stop(None)
        await healthy.server.stop(None)
