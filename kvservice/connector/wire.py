"""KV chunk frames of the PullKV stream, built and parsed by hand around the raw payload.

A frame is the bytes of a protobuf `KVChunk`:

    0x0a varint(len(h)) h 0x12 varint(len(p)) p     # h = serialized KVChunkHeader, p = payload
    0x1a varint(len(d)) d                           # d = serialized KVTransferDone

Only the small header and done messages go through protobuf. The payload, the raw bytes of
a contiguous [2, num_blocks, block_size, num_kv_heads, head_dim] tensor, is joined into the
frame with one copy on the sender and read as a zero-copy view on the receiver, which
validates every field before anything touches its cache. This module only encodes, decodes
and decides: it writes nowhere.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch
from google.protobuf.message import DecodeError, Message

try:  # same CRC-32 as zlib.crc32, ~10x faster (SIMD); optional
    from zlib_ng.zlib_ng import crc32 as _crc32
except ImportError:
    from zlib import crc32 as _crc32

from kvservice.model.kv_cache import KVCacheLayout
from kvservice.v1 import kvservice_pb2 as pb

_Message = TypeVar("_Message", bound=Message)

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "int8": torch.int8,  # --kv-cache-dtype int8: each row's codes, then its float32 scale (kv_dtype.py)
}
_DTYPE_NAMES: dict[torch.dtype, str] = {dtype: name for name, dtype in _DTYPES.items()}

# Tags of KVChunk's fields, all length-delimited (wire type 2): (field << 3) | 2.
_TAG_HEADER = b"\x0a"
_TAG_PAYLOAD = b"\x12"
_TAG_DONE = b"\x1a"
_FIELD_NAMES = {1: "header", 2: "payload", 3: "done"}
_MAX_ERROR_REPR = 64


class KVChunkError(ValueError):
    """A frame or chunk from a peer is malformed or does not fit this transfer."""


def dtype_name(dtype: torch.dtype) -> str:
    """The wire name of a KV dtype ("float32", "bfloat16", "float16", "int8")."""
    try:
        return _DTYPE_NAMES[dtype]
    except KeyError:
        raise ValueError(f"unsupported KV dtype {dtype}; supported: {sorted(_DTYPES)}") from None


def dtype_from_name(name: str) -> torch.dtype:
    """The torch dtype for a wire name; unknown names raise KVChunkError."""
    try:
        return _DTYPES[name]
    except KeyError:
        raise KVChunkError(f"dtype: unsupported {name[:_MAX_ERROR_REPR]!r}; supported: {sorted(_DTYPES)}") from None


@dataclass(frozen=True, slots=True)
class DecodedFrame:
    """One parsed frame: exactly one of `header`/`done`; `payload` views the frame's bytes."""

    header: pb.KVChunkHeader | None
    done: pb.KVTransferDone | None
    payload: memoryview

    @property
    def is_done(self) -> bool:
        return self.done is not None


# ---------------------------------------------------------------- encoding


def checksum(data: memoryview | bytes, value: int = 0) -> int:
    """The CRC-32 a chunk header carries for `data` (zlib's polynomial), continuing `value`."""
    return _crc32(data, value)


def _varint(value: int) -> bytes:
    if value < 0:
        raise ValueError(f"varint of a negative value {value}")
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """A zero-copy byte view of a contiguous CPU tensor, ready for `encode_chunk`."""
    if not tensor.is_contiguous() or tensor.device.type != "cpu":
        raise ValueError("tensor_bytes needs a contiguous CPU tensor (stage it first)")
    # uint8 first: numpy has no bfloat16.
    return memoryview(tensor.detach().reshape(-1).view(torch.uint8).numpy())


def encode_chunk(
    *,
    request_id: str,
    layer: int,
    first_block: int,
    num_blocks: int,
    dtype: str,
    shape: Sequence[int],
    payload: memoryview | bytes,
    crc32: int | None = None,
    shared_memory_position: int | None = None,
) -> bytes:
    """A KVChunk frame (header + payload); the payload is copied exactly once.

    `crc32` defaults to the payload's CRC-32 (zlib's); pass 0 where the receiver skips the check.
    `shared_memory_position`: the payload was written to the pull's shared-memory ring
    there; the frame carries only the header, which still describes (size, CRC-32) those bytes.
    """
    in_shared_memory = shared_memory_position is not None
    num_bytes = memoryview(payload).nbytes
    header = pb.KVChunkHeader(
        request_id=request_id,
        layer=layer,
        first_block=first_block,
        num_blocks=num_blocks,
        dtype=dtype,
        shape=shape,
        num_bytes=num_bytes,
        crc32=_crc32(payload) if crc32 is None else crc32,
        in_shared_memory=in_shared_memory,
        shared_memory_position=shared_memory_position or 0,
    ).SerializeToString()
    if num_bytes == 0 or in_shared_memory:  # proto3 omits an empty bytes field: keep byte-identical to protobuf
        return b"".join(_field(_TAG_HEADER, header))
    return b"".join((*_field(_TAG_HEADER, header), *_field(_TAG_PAYLOAD, payload, num_bytes)))


def encode_done(
    *,
    request_id: str,
    first_token_id: int,
    num_chunks: int,
    num_bytes: int,
    num_tokens: int,
    has_draft_kv: bool = False,
) -> bytes:
    """The last frame of a transfer: a KVChunk carrying KVTransferDone and no payload."""
    done = pb.KVTransferDone(
        request_id=request_id,
        first_token_id=first_token_id,
        num_chunks=num_chunks,
        num_bytes=num_bytes,
        num_tokens=num_tokens,
        has_draft_kv=has_draft_kv,
    ).SerializeToString()
    return b"".join(_field(_TAG_DONE, done))


def _field(
    tag: bytes, value: bytes | memoryview, num_bytes: int | None = None
) -> tuple[bytes, bytes, bytes | memoryview]:
    """A length-delimited field's three parts: tag, length, value (joined once by the caller)."""
    return tag, _varint(len(value) if num_bytes is None else num_bytes), value


# ---------------------------------------------------------------- decoding


def _read_varint(buf: memoryview, pos: int) -> tuple[int, int]:
    """(value, position after it); at most 10 bytes and 64 bits, as protobuf allows."""
    result = 0
    for shift in range(0, 70, 7):
        if pos >= len(buf):
            raise KVChunkError("frame: truncated varint")
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            if result >> 64:
                raise KVChunkError("frame: varint exceeds 64 bits")
            return result, pos
    raise KVChunkError("frame: varint longer than 10 bytes")


def _skip_field(buf: memoryview, pos: int, wire_type: int, field: int) -> int:
    """Skip an unknown field (forward compatibility); groups and bad wire types are errors."""
    if wire_type == 0:
        return _read_varint(buf, pos)[1]
    if wire_type == 2:
        length, pos = _read_varint(buf, pos)
        end = pos + length
    elif wire_type == 1:
        end = pos + 8
    elif wire_type == 5:
        end = pos + 4
    else:
        raise KVChunkError(f"frame: field {field} has unsupported wire type {wire_type}")
    if end > len(buf):
        raise KVChunkError(f"frame: field {field} runs past the end of the frame")
    return end


def decode_frame(frame: bytes | memoryview) -> DecodedFrame:
    """Parse a KVChunk frame; the payload stays a view of `frame` (no copy).

    Stricter than protobuf where a peer could only mean harm: a repeated known field, both
    header and done, or a done frame with a payload are errors rather than last-wins.
    """
    buf = memoryview(frame).cast("B")
    parts: dict[int, memoryview] = {}
    pos = 0
    while pos < len(buf):
        key, pos = _read_varint(buf, pos)
        field, wire_type = key >> 3, key & 7
        if field == 0:
            raise KVChunkError("frame: field number 0")
        if field not in _FIELD_NAMES:
            pos = _skip_field(buf, pos, wire_type, field)
            continue
        name = _FIELD_NAMES[field]
        if wire_type != 2:
            raise KVChunkError(f"frame: {name} has wire type {wire_type}, expected 2")
        if field in parts:
            raise KVChunkError(f"frame: {name} appears twice")
        length, pos = _read_varint(buf, pos)
        if pos + length > len(buf):
            raise KVChunkError(f"frame: {name} of {length} bytes runs past the end of the frame")
        parts[field] = buf[pos : pos + length]
        pos += length

    payload = parts.get(2, buf[0:0])
    if (1 in parts) == (3 in parts):
        raise KVChunkError("frame: needs exactly one of header and done")
    if 1 in parts:
        return DecodedFrame(_parse(pb.KVChunkHeader, parts[1], "header"), None, payload)
    done = _parse(pb.KVTransferDone, parts[3], "done")
    if payload.nbytes:
        raise KVChunkError("frame: done carries a payload")
    return DecodedFrame(None, done, payload)


def _parse(message_type: type[_Message], data: memoryview, name: str) -> _Message:
    """One embedded message of a frame; protobuf's DecodeError becomes a KVChunkError naming it."""
    try:
        return message_type.FromString(data)
    except DecodeError as exc:
        raise KVChunkError(f"frame: unparseable {name}: {exc}") from None


# ---------------------------------------------------------------- validation


def validate_chunk(
    header: pb.KVChunkHeader,
    payload: memoryview | bytes,
    layout: KVCacheLayout,
    request_id: str,
    num_blocks_in_transfer: int,
    *,
    check_crc32: bool = True,
) -> None:
    """Raise KVChunkError, naming the field, unless the chunk fits this transfer exactly.

    After this passes, the payload holds exactly [2, num_blocks, block_size, num_kv_heads,
    head_dim] elements of `layout.dtype` for blocks [first_block, first_block + num_blocks)
    of a layer that exists.
    """
    _check_destination(header, layout, request_id, num_blocks_in_transfer)
    _check_contents(header, payload, layout, check_crc32)


def _check_destination(
    header: pb.KVChunkHeader, layout: KVCacheLayout, request_id: str, num_blocks_in_transfer: int
) -> None:
    """Where the chunk lands: this request, a layer that exists, at least one block, all in the transfer."""
    if header.request_id != request_id:
        raise KVChunkError(f"header.request_id: got {header.request_id[:_MAX_ERROR_REPR]!r}, expected {request_id!r}")
    if header.layer >= layout.num_layers:
        raise KVChunkError(f"header.layer: {header.layer} outside [0, {layout.num_layers})")
    if header.num_blocks == 0:
        raise KVChunkError("header.num_blocks: 0 (a chunk carries at least one block)")
    end_block = header.first_block + header.num_blocks
    if end_block > num_blocks_in_transfer:
        raise KVChunkError(
            f"header.first_block/num_blocks: blocks [{header.first_block}, {end_block}) "
            f"outside [0, {num_blocks_in_transfer})"
        )


def _check_contents(
    header: pb.KVChunkHeader, payload: memoryview | bytes, layout: KVCacheLayout, check_crc32: bool
) -> None:
    """What the chunk holds: the layout's dtype and shape for its blocks, exactly their bytes, intact."""
    expected_dtype = dtype_name(layout.dtype)
    if header.dtype != expected_dtype:
        raise KVChunkError(f"header.dtype: got {header.dtype[:_MAX_ERROR_REPR]!r}, expected {expected_dtype!r}")
    expected_shape = layout.blocks_shape(header.num_blocks)
    if tuple(header.shape) != expected_shape:
        raise KVChunkError(f"header.shape: got {list(header.shape)[:8]}, expected {list(expected_shape)}")
    expected_bytes = header.num_blocks * layout.bytes_per_block_per_layer
    if header.num_bytes != expected_bytes:
        raise KVChunkError(f"header.num_bytes: got {header.num_bytes}, expected {expected_bytes}")
    num_payload_bytes = memoryview(payload).nbytes
    if num_payload_bytes != expected_bytes:
        raise KVChunkError(f"payload: {num_payload_bytes} bytes, expected {expected_bytes}")
    if check_crc32:
        crc = _crc32(payload)
        if crc != header.crc32:
            raise KVChunkError(f"header.crc32: payload has {crc:#010x}, header says {header.crc32:#010x}")


def payload_view(payload: memoryview | bytes, layout: KVCacheLayout, num_blocks: int) -> torch.Tensor:
    """A zero-copy [2, num_blocks, block_size, num_kv_heads, head_dim] tensor over the payload.

    Frames arrive as immutable `bytes`, which torch warns it cannot mark read-only. The view
    is only ever read (copied into the cache), so that one warning is silenced here; never
    write through the returned tensor.
    """
    expected_bytes = num_blocks * layout.bytes_per_block_per_layer
    num_payload_bytes = memoryview(payload).nbytes
    if num_blocks <= 0 or num_payload_bytes != expected_bytes:
        raise KVChunkError(
            f"payload: {num_payload_bytes} bytes cannot hold {num_blocks} blocks ({expected_bytes} bytes)"
        )
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)
        count = expected_bytes // layout.dtype.itemsize
        flat = torch.frombuffer(payload, dtype=layout.dtype, count=count)
    return flat.view(layout.blocks_shape(num_blocks))
