"""The decode side's pull against a fake prefill server: well-formed streams land in the
right blocks; every malformed chunk header, payload or first token is refused before it
touches the cache (DESIGN.md: receivers validate everything a peer sends)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

import grpc
import pytest
import torch
from pd_pair import BLOCK_SIZE, LAYOUT, PROMPTS, WAIT, bits, drive_decode, pd_pair

from kvservice.connector import wire
from kvservice.connector.kv_puller import LoadSpec, pull_kv
from kvservice.kv_cache import KVCacheLayout, allocate_kv_caches
from kvservice.kv_cache_manager import cdiv
from kvservice.model_loader import TINY_CONFIG
from kvservice.outputs import KVTransferCounters
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
    return wire.encode_done(request_id=request_id, first_token_id=FIRST_TOKEN, num_chunks=num_chunks, num_bytes=0, num_tokens=7)


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
            request_id=rid, layer=layer, first_block=0, num_blocks=num_blocks, dtype="float32",
            shape=LAYOUT.blocks_shape(num_blocks), payload=payload,
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


async def test_first_token_outside_the_vocabulary_is_a_failed_load(fake_prefill: str, reference: list[list[int]]) -> None:
    """A peer's done frame names a token the model does not have: the decode engine must treat
    the load as failed (and recompute), never feed the id to the model or to the client."""
    async with pd_pair() as pair:
        pair.add_decode("out-of-vocab-first-token", PROMPTS[1], fake_prefill, b"token")
        out = (await drive_decode(pair))["out-of-vocab-first-token"]
        assert all(0 <= t < TINY_CONFIG.vocab_size for t in out.token_ids), out.token_ids
        assert out.error is None and out.token_ids == reference[1]
        pair.assert_everything_free()
