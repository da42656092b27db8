"""Tests for kvservice.connector.wire: hand-built KVChunk frames and their validation."""

from __future__ import annotations

import zlib
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from kvservice.connector import wire
from kvservice.connector.wire import KVChunkError
from kvservice.model.kv_cache import KVCacheLayout
from kvservice.v1 import kvservice_pb2 as pb

LAYOUT = KVCacheLayout(num_layers=4, block_size=4, num_kv_heads=2, head_dim=8, dtype=torch.bfloat16)
REQUEST_ID = "req-1"
NUM_BLOCKS_IN_TRANSFER = 10


def _chunk_tensor(num_blocks: int, seed: int = 0, layout: KVCacheLayout = LAYOUT) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(layout.blocks_shape(num_blocks), generator=gen).to(layout.dtype)


def _frame(num_blocks: int = 3, first_block: int = 2, layer: int = 1, **overrides: Any) -> bytes:
    """A valid frame for LAYOUT; `overrides` replace encode_chunk's arguments."""
    tensor = _chunk_tensor(num_blocks)
    kwargs: dict[str, Any] = dict(
        request_id=REQUEST_ID,
        layer=layer,
        first_block=first_block,
        num_blocks=num_blocks,
        dtype=wire.dtype_name(LAYOUT.dtype),
        shape=LAYOUT.blocks_shape(num_blocks),
        payload=wire.tensor_bytes(tensor),
    )
    kwargs.update(overrides)
    return wire.encode_chunk(**kwargs)


def _validate(frame: bytes, **kwargs: Any) -> wire.DecodedFrame:
    decoded = wire.decode_frame(frame)
    assert decoded.header is not None
    wire.validate_chunk(decoded.header, decoded.payload, LAYOUT, REQUEST_ID, NUM_BLOCKS_IN_TRANSFER, **kwargs)
    return decoded


# ---------------------------------------------------------------- layout and dtypes


def test_layout_shapes_and_sizes() -> None:
    layout = KVCacheLayout(num_layers=32, block_size=16, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16)
    assert layout.blocks_shape(5) == (2, 5, 16, 8, 128)
    assert layout.bytes_per_block_per_layer == 2 * 16 * 8 * 128 * 2 == 65536
    assert layout.bytes_per_block == 32 * 65536  # every layer


@pytest.mark.parametrize("field", ["num_layers", "block_size", "num_kv_heads", "head_dim"])
def test_layout_rejects_non_positive(field: str) -> None:
    kwargs: dict[str, Any] = dict(num_layers=1, block_size=1, num_kv_heads=1, head_dim=1, dtype=torch.float32)
    kwargs[field] = 0
    with pytest.raises(ValueError, match=field):
        KVCacheLayout(**kwargs)


def test_layout_rejects_unsupported_dtype() -> None:
    with pytest.raises(ValueError, match="unsupported KV dtype"):
        KVCacheLayout(num_layers=1, block_size=1, num_kv_heads=1, head_dim=1, dtype=torch.int64)


@pytest.mark.parametrize(
    "name,dtype", [("float32", torch.float32), ("bfloat16", torch.bfloat16), ("float16", torch.float16)]
)
def test_dtype_names_round_trip(name: str, dtype: torch.dtype) -> None:
    assert wire.dtype_name(dtype) == name
    assert wire.dtype_from_name(name) is dtype


@pytest.mark.parametrize("name", ["", "int4", "torch.bfloat16", "BFLOAT16", "float64"])
def test_unknown_dtype_names_rejected(name: str) -> None:
    with pytest.raises(KVChunkError, match="dtype"):
        wire.dtype_from_name(name)


# ---------------------------------------------------------------- round trips


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_chunk_round_trip_is_bit_identical(dtype: torch.dtype) -> None:
    layout = KVCacheLayout(num_layers=2, block_size=4, num_kv_heads=2, head_dim=8, dtype=dtype)
    tensor = _chunk_tensor(3, seed=7, layout=layout)
    frame = wire.encode_chunk(
        request_id="r",
        layer=1,
        first_block=4,
        num_blocks=3,
        dtype=wire.dtype_name(layout.dtype),
        shape=layout.blocks_shape(3),
        payload=wire.tensor_bytes(tensor),
    )
    decoded = wire.decode_frame(frame)
    assert decoded.header is not None and not decoded.is_done
    assert (decoded.header.layer, decoded.header.first_block, decoded.header.num_blocks) == (1, 4, 3)
    assert decoded.header.crc32 == zlib.crc32(wire.tensor_bytes(tensor))
    wire.validate_chunk(decoded.header, decoded.payload, layout, "r", 7)
    view = wire.payload_view(decoded.payload, layout, 3)
    assert view.shape == layout.blocks_shape(3) and view.dtype == dtype
    assert torch.equal(view.view(torch.uint8), tensor.view(torch.uint8))


def test_payload_is_a_view_of_the_frame_not_a_copy() -> None:
    frame = _frame()
    decoded = wire.decode_frame(frame)
    assert decoded.payload.obj is frame
    view = wire.payload_view(decoded.payload, LAYOUT, 3)
    # The tensor's data lies inside the bytes object's own buffer: nothing was copied.
    frame_start = np.frombuffer(frame, dtype=np.uint8).ctypes.data
    payload_offset = len(frame) - (3) * LAYOUT.bytes_per_block_per_layer
    assert view.data_ptr() == frame_start + payload_offset


def test_done_round_trip() -> None:
    frame = wire.encode_done(request_id="r", first_token_id=-1, num_chunks=12, num_bytes=1 << 40, num_tokens=2048)
    decoded = wire.decode_frame(frame)
    assert decoded.is_done and decoded.header is None and decoded.payload.nbytes == 0
    assert decoded.done == pb.KVTransferDone(
        request_id="r", first_token_id=-1, num_chunks=12, num_bytes=1 << 40, num_tokens=2048
    )


def test_tensor_bytes_rejects_non_contiguous() -> None:
    with pytest.raises(ValueError, match="contiguous"):
        wire.tensor_bytes(torch.zeros(4, 4).t())


# ---------------------------------------------------------------- protobuf compatibility


def test_hand_frames_parse_with_protobuf() -> None:
    tensor = _chunk_tensor(3)
    frame = _frame()
    message = pb.KVChunk.FromString(frame)
    assert message.WhichOneof("kind") == "header"
    assert message.header == wire.decode_frame(frame).header
    assert message.header.shape == list(LAYOUT.blocks_shape(3))
    assert message.payload == bytes(wire.tensor_bytes(tensor))

    done = wire.encode_done(request_id="r", first_token_id=5, num_chunks=2, num_bytes=9, num_tokens=3)
    message = pb.KVChunk.FromString(done)
    assert message.WhichOneof("kind") == "done" and message.done.first_token_id == 5


def test_hand_frames_are_byte_identical_to_protobuf() -> None:
    frame = _frame()
    decoded = wire.decode_frame(frame)
    reference = pb.KVChunk(header=decoded.header, payload=bytes(decoded.payload))
    assert reference.SerializeToString() == frame
    done = pb.KVTransferDone(request_id="r", first_token_id=5, num_chunks=2, num_bytes=9, num_tokens=3)
    assert pb.KVChunk(done=done).SerializeToString() == wire.encode_done(
        request_id="r", first_token_id=5, num_chunks=2, num_bytes=9, num_tokens=3
    )


def test_protobuf_frames_parse_with_hand_parser() -> None:
    payload = bytes(wire.tensor_bytes(_chunk_tensor(2)))
    header = pb.KVChunkHeader(
        request_id=REQUEST_ID,
        layer=3,
        first_block=8,
        num_blocks=2,
        dtype="bfloat16",
        shape=LAYOUT.blocks_shape(2),
        num_bytes=len(payload),
        crc32=zlib.crc32(payload),
    )
    # Payload before header and an unknown field: protobuf allows both; so must we.
    unknown = b"\x20\x07"  # field 4, varint 7
    frame = pb.KVChunk(payload=payload).SerializeToString() + unknown + pb.KVChunk(header=header).SerializeToString()
    assert pb.KVChunk.FromString(frame).header == header
    decoded = _validate(frame)
    assert decoded.header == header and bytes(decoded.payload) == payload

    done = pb.KVTransferDone(request_id="r", first_token_id=0, num_chunks=1, num_bytes=2, num_tokens=3)
    decoded = wire.decode_frame(pb.KVChunk(done=done).SerializeToString())
    assert decoded.done == done


# ---------------------------------------------------------------- malformed frames


@pytest.mark.parametrize(
    "frame,match",
    [
        (b"", "exactly one of header and done"),
        (b"\x12\x00", "exactly one of header and done"),
        (b"\x0a", "truncated varint"),
        (b"\x0a\x05abc", "runs past the end"),
        (b"\x0a\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01", "longer than 10 bytes"),
        (b"\x0a\xff\xff\xff\xff\xff\xff\xff\xff\xff\x7f", "exceeds 64 bits"),
        (b"\x08\x01", "wire type 0, expected 2"),
        (b"\x00\x01", "field number 0"),
        (b"\x23\x24", "unsupported wire type 3"),
        (b"\x0a\x00\x0a\x00", "header appears twice"),
        (b"\x0a\x00\x1a\x00", "exactly one of header and done"),
        (b"\x1a\x00\x12\x01x", "done carries a payload"),
        (b"\x0a\x02\x08\x80", "unparseable header"),
        (b"\x1a\x02\x0a\xff", "unparseable done"),
    ],
)
def test_malformed_frames_rejected(frame: bytes, match: str) -> None:
    with pytest.raises(KVChunkError, match=match):
        wire.decode_frame(frame)


# ---------------------------------------------------------------- validation


def test_valid_chunk_at_the_edges_passes() -> None:
    _validate(_frame(num_blocks=1, first_block=NUM_BLOCKS_IN_TRANSFER - 1, layer=LAYOUT.num_layers - 1))
    _validate(_frame(num_blocks=NUM_BLOCKS_IN_TRANSFER, first_block=0, layer=0))


@pytest.mark.parametrize(
    "overrides,match",
    [
        (dict(request_id="someone-else"), "header.request_id"),
        (dict(layer=LAYOUT.num_layers), r"header.layer: 4 outside \[0, 4\)"),
        (dict(first_block=8), r"header.first_block/num_blocks: blocks \[8, 11\) outside \[0, 10\)"),
        (dict(first_block=2**32 - 1), "header.first_block/num_blocks"),
        (dict(dtype="float16"), "header.dtype"),
        (dict(dtype="nonsense"), "header.dtype"),
        (dict(shape=(2, 3, 4, 2, 4)), "header.shape"),
        (dict(shape=(2, 3, 4, 2, 8, 1)), "header.shape"),
        (dict(shape=()), "header.shape"),
        (dict(crc32=123), "header.crc32"),
    ],
)
def test_bad_header_fields_rejected(overrides: dict[str, Any], match: str) -> None:
    with pytest.raises(KVChunkError, match=match):
        _validate(_frame(**overrides))


def test_zero_blocks_rejected() -> None:
    frame = _frame(num_blocks=0)
    with pytest.raises(KVChunkError, match="header.num_blocks: 0"):
        _validate(frame)


def test_num_bytes_must_match_shape() -> None:
    decoded = wire.decode_frame(_frame())
    assert decoded.header is not None
    decoded.header.num_bytes += 2
    with pytest.raises(KVChunkError, match="header.num_bytes"):
        wire.validate_chunk(decoded.header, decoded.payload, LAYOUT, REQUEST_ID, NUM_BLOCKS_IN_TRANSFER)


@pytest.mark.parametrize("cut", [1, 2, LAYOUT.bytes_per_block])
def test_short_payload_rejected_even_if_header_agrees(cut: int) -> None:
    decoded = wire.decode_frame(_frame())
    assert decoded.header is not None
    with pytest.raises(KVChunkError, match="payload: .* bytes, expected"):
        wire.validate_chunk(decoded.header, decoded.payload[:-cut], LAYOUT, REQUEST_ID, NUM_BLOCKS_IN_TRANSFER)


def test_payload_longer_than_header_says_rejected() -> None:
    payload = bytes(wire.tensor_bytes(_chunk_tensor(3))) + b"\x00\x00"
    with pytest.raises(KVChunkError, match="header.num_bytes"):
        _validate(_frame(payload=payload))


def test_corrupted_payload_fails_crc_unless_check_is_off() -> None:
    frame = bytearray(_frame())
    frame[-5] ^= 0x01
    with pytest.raises(KVChunkError, match="header.crc32"):
        _validate(bytes(frame))
    _validate(bytes(frame), check_crc32=False)


def test_payload_view_rejects_wrong_size() -> None:
    payload = wire.decode_frame(_frame(num_blocks=3)).payload
    with pytest.raises(KVChunkError, match="cannot hold 2 blocks"):
        wire.payload_view(payload, LAYOUT, 2)
    with pytest.raises(KVChunkError, match="cannot hold 0 blocks"):
        wire.payload_view(payload[:0], LAYOUT, 0)


# ---------------------------------------------------------------- fuzz


def _mutate(frame: bytes, data: st.DataObject) -> bytes:
    kind = data.draw(st.sampled_from(["flip", "truncate", "splice", "random", "append"]))
    buf = bytearray(frame)
    if kind == "flip" and buf:
        for _ in range(data.draw(st.integers(1, 4))):
            index = data.draw(st.integers(0, len(buf) - 1))
            buf[index] = data.draw(st.integers(0, 255))
    elif kind == "truncate":
        buf = buf[: data.draw(st.integers(0, len(buf)))]
    elif kind == "splice":
        index = data.draw(st.integers(0, len(buf)))
        buf[index:index] = data.draw(st.binary(max_size=16))
    elif kind == "random":
        buf = bytearray(data.draw(st.binary(max_size=256)))
    else:
        buf += data.draw(st.binary(max_size=16))
    return bytes(buf)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_fuzzed_frames_validate_or_raise_kv_chunk_error(data: st.DataObject) -> None:
    num_blocks = data.draw(st.integers(0, 4))
    source = data.draw(st.sampled_from(["chunk", "done"]))
    if source == "chunk":
        frame = _frame(
            num_blocks=num_blocks,
            first_block=data.draw(st.integers(0, 12)),
            layer=data.draw(st.integers(0, 5)),
        )
    else:
        frame = wire.encode_done(
            request_id=REQUEST_ID,
            first_token_id=data.draw(st.integers(-(2**31), 2**31 - 1)),
            num_chunks=1,
            num_bytes=2,
            num_tokens=3,
        )
    frame = _mutate(frame, data)
    try:
        decoded = wire.decode_frame(frame)
        if decoded.header is not None:
            wire.validate_chunk(decoded.header, decoded.payload, LAYOUT, REQUEST_ID, NUM_BLOCKS_IN_TRANSFER)
            view = wire.payload_view(decoded.payload, LAYOUT, decoded.header.num_blocks)
            # Whatever validated is exactly what the header promised.
            assert view.shape == LAYOUT.blocks_shape(decoded.header.num_blocks)
            end = decoded.header.first_block + decoded.header.num_blocks
            assert end <= NUM_BLOCKS_IN_TRANSFER and decoded.header.layer < LAYOUT.num_layers
            assert zlib.crc32(decoded.payload) == decoded.header.crc32
            event("chunk validated")
        else:
            event("done decoded")
    except KVChunkError:  # a ValueError; anything else (DecodeError, IndexError) fails
        event("rejected")
