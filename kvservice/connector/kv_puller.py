"""One KV pull: stream a transfer's chunks from its prefill worker into local blocks.

Every chunk is validated (request id, layer, block range, dtype, shape, size,
checksum, no block written twice) before it touches the cache; a chunk can only
land in the blocks allocated to its own request. The transfer is complete when
the `done` frame arrives and every layer's every block has been written.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import grpc
import numpy as np
import torch

from kvservice.connector import wire
from kvservice.connector.kv_transfer_service import PULL_KV_METHOD
from kvservice.connector.shared_memory import SegmentPool, SharedSegment
from kvservice.core.outputs import KVTransferCounters
from kvservice.model.kv_cache import KVCacheLayout
from kvservice.v1 import kvservice_pb2 as pb

logger = logging.getLogger(__name__)

_MIN_RUN_BYTES = 32 << 10  # average bytes per run (K and V) below which index_copy_ is as fast


@dataclass(frozen=True, slots=True)
class LoadSpec:
    request_id: str
    remote_address: str
    transfer_token: bytes
    block_ids: list[int]  # the local blocks of the prompt's KV, in order
    num_tokens: int  # prompt tokens
    # Blocks before this one are in the local prefix cache already: not pulled.
    first_block: int = 0
    # False: a prefix source's leading blocks, which come with no first token.
    sends_first_token: bool = True
    source_role: str = "prefill"  # the source's role (a prefix source's stats)


@dataclass(frozen=True, slots=True)
class LoadResult:
    request_id: str
    first_token_id: int | None
    error: str | None = None
    has_draft_kv: bool = False  # the speculative draft's layers came too


async def pull_kv(
    channel: grpc.aio.Channel,
    spec: LoadSpec,
    kv_caches: list[torch.Tensor],
    layout: KVCacheLayout,
    timeout: float,
    stats: KVTransferCounters,
    metadata: tuple[tuple[str, str], ...] | None = None,
    segments: SegmentPool | None = None,
) -> LoadResult:
    """Pull one transfer; failures come back as a LoadResult with `error`, never raised.
    `metadata` goes with the call (the bearer token of a guarded prefill worker).
    `segments`: offer the prefill worker one of them for the bytes (same host only; see
    `shared_memory`); the pull works the same if it cannot use it."""
    num_pulled_blocks = len(spec.block_ids) - spec.first_block
    segment: SharedSegment | None = None
    if segments is not None and num_pulled_blocks > 0:
        try:
            segment = segments.take(spec.remote_address)
        except OSError as e:
            logger.warning(
                "request %s: no shared-memory segment (%s); pulling over the gRPC stream", spec.request_id, e
            )
    is_all_in_ring = False
    try:
        request = pb.PullKVRequest(
            request_id=spec.request_id,
            transfer_token=spec.transfer_token,
            num_layers=layout.num_layers,
            block_size=layout.block_size,
            num_kv_heads=layout.num_kv_heads,
            head_dim=layout.head_dim,
            dtype=wire.dtype_name(layout.dtype),
            first_block=spec.first_block,
            shared_memory=segment.name if segment is not None else "",
            num_draft_layers=layout.num_draft_layers,
            draft_fingerprint=layout.draft_fingerprint,
        )
        call = channel.unary_stream(
            PULL_KV_METHOD, request_serializer=pb.PullKVRequest.SerializeToString, response_deserializer=None
        )(request, timeout=timeout, metadata=metadata)
        result, is_all_in_ring = await _receive(call, spec, kv_caches, layout, stats, segment)
        return result
    finally:
        if segment is not None:
            assert segments is not None
            segments.give_back(spec.remote_address, segment, is_all_in_ring)


async def _receive(
    call: grpc.aio.UnaryStreamCall,
    spec: LoadSpec,
    kv_caches: list[torch.Tensor],
    layout: KVCacheLayout,
    stats: KVTransferCounters,
    segment: SharedSegment | None,
) -> tuple[LoadResult, bool]:
    """Read a PullKV stream into the transfer's blocks (the ring's bytes where a header says so);
    also whether it completed with every chunk through the ring."""
    writer = _BlockWriter(spec, kv_caches, layout, segment)
    start = time.perf_counter()
    error: str | None = None
    first_token_id: int | None = None
    has_draft_kv = False
    try:
        async for frame in call:
            if segment is not None:
                segment.unlink()  # the prefill worker opened it (or gave up) before sending anything
            decoded = wire.decode_frame(frame)
            if decoded.done is not None:
                first_token_id = _check_done(decoded.done, spec, writer.written, writer.num_chunks, layout)
                has_draft_kv = layout.num_draft_layers > 0 and decoded.done.has_draft_kv
                break
            assert decoded.header is not None
            num_bytes = writer.write(decoded.header, decoded.payload)
            stats.num_chunks += 1
            stats.num_bytes += num_bytes
            if decoded.header.in_shared_memory:
                stats.num_shared_memory_bytes += num_bytes
        else:
            error = "the PullKV stream ended without its done frame"
    except grpc.aio.AioRpcError as e:
        error = f"PullKV from {spec.remote_address} failed: {e.code().name}: {e.details()}"
    except wire.KVChunkError as e:
        error = f"rejected a chunk from {spec.remote_address}: {e}"
        call.cancel()
    finally:
        if first_token_id is None and error is None:  # cancelled
            call.cancel()
    elapsed = time.perf_counter() - start
    stats.num_transfers += 1
    stats.total_seconds += elapsed
    if error is not None:
        stats.num_failed_transfers += 1
        return LoadResult(spec.request_id, None, error), False
    return LoadResult(spec.request_id, first_token_id, has_draft_kv=has_draft_kv), (
        writer.num_ring_chunks == writer.num_chunks > 0
    )


class _BlockWriter:
    """Lands one pull's chunks in its local blocks: each is checked against the pull (block
    range, layout, checksum, no block written twice) before it touches the cache."""

    def __init__(
        self, spec: LoadSpec, kv_caches: list[torch.Tensor], layout: KVCacheLayout, segment: SharedSegment | None
    ) -> None:
        self.spec = spec
        self.kv_caches = kv_caches
        self.layout = layout
        self.segment = segment
        self.device = kv_caches[0].device if kv_caches else torch.device("cpu")
        self.block_ids = torch.tensor(spec.block_ids, dtype=torch.long, device=self.device)
        self.run_ends = _run_ends(spec.block_ids)
        self.host_caches = _host_views(kv_caches, spec.block_ids, self.run_ends, layout)
        # written[layer][block]: each block of each layer exactly once (the cached ones count as written).
        num_blocks = len(spec.block_ids)
        self.written = [
            bytearray(b"\x01" * spec.first_block + bytes(num_blocks - spec.first_block))
            for _ in range(layout.num_layers)
        ]
        self.ring_read_end = 0  # the shared-memory ring: where the last chunk read from it ended
        self.num_chunks = 0
        self.num_ring_chunks = 0

    def write(self, header: pb.KVChunkHeader, payload: memoryview) -> int:
        """Check one chunk and copy it into its blocks (from the ring where the header says
        so); its payload's size. KVChunkError if it does not belong there."""
        spec = self.spec
        first, n = header.first_block, header.num_blocks
        if first < spec.first_block:
            raise wire.KVChunkError(
                f"header.first_block: {first}, but the pull asked for blocks from {spec.first_block}"
            )
        if header.in_shared_memory:
            payload = _ring_payload(header, payload, self.segment, self.ring_read_end)
            self.ring_read_end = header.shared_memory_position + len(payload)
        wire.validate_chunk(header, payload, self.layout, spec.request_id, len(spec.block_ids))
        written = self.written[header.layer]
        if any(written[first : first + n]):
            raise wire.KVChunkError(
                f"header.first_block: blocks [{first}, {first + n}) of layer {header.layer} sent twice"
            )
        src = wire.payload_view(payload, self.layout, n)  # [2, n, block_size, kv_heads, head_dim]
        if self.host_caches is not None:
            _copy_runs(self.host_caches[header.layer], src, spec.block_ids, self.run_ends, first, n)
        else:
            index = self.block_ids[first : first + n]
            self.kv_caches[header.layer].index_copy_(1, index, src.to(self.device, non_blocking=True))
        written[first : first + n] = b"\x01" * n
        self.num_chunks += 1
        if header.in_shared_memory:
            assert self.segment is not None
            self.segment.mark_read(self.ring_read_end)  # copied: the prefill worker may reuse that space
            self.num_ring_chunks += 1
        return len(payload)


def _ring_payload(
    header: pb.KVChunkHeader, payload: memoryview, segment: SharedSegment | None, read_end: int
) -> memoryview:
    """A header-only chunk's bytes: `header.num_bytes` from the pull's ring at the position it
    names, which must follow the last chunk read from it (`validate_chunk` then checks size and CRC-32)."""
    if segment is None:
        raise wire.KVChunkError("header.in_shared_memory: this pull offered no shared memory")
    if payload.nbytes:
        raise wire.KVChunkError("header.in_shared_memory: the frame carries a payload too")
    position = header.shared_memory_position
    if position < read_end:
        raise wire.KVChunkError(
            f"header.shared_memory_position: {position}, before the previous chunk's end {read_end}"
        )
    try:
        return memoryview(segment.ring_region(position, header.num_bytes))
    except ValueError as e:
        raise wire.KVChunkError(f"header.shared_memory_position: {e}") from None


def _host_views(
    kv_caches: list[torch.Tensor], block_ids: list[int], run_ends: list[int], layout: KVCacheLayout
) -> list[np.ndarray] | None:
    """[2, num_blocks, B] uint8 views of the caches when chunks should land run by run, else None.

    Each run of consecutive destination blocks as one numpy slice copy is 4-13x faster than
    index_copy_ for 64 KiB blocks. Not for device caches, nor for runs too short to beat
    index_copy_'s fixed cost, nor for out-of-range block ids or a cache of another dtype:
    index_copy_ raises on those as it always did, where byte copies would clip, wrap or
    reinterpret.
    """
    if not kv_caches or not all(
        t.device.type == "cpu" and t.is_contiguous() and t.dtype == layout.dtype for t in kv_caches
    ):
        return None
    if block_ids and not (0 <= min(block_ids) and max(block_ids) < min(t.shape[1] for t in kv_caches)):
        return None
    if len(block_ids) * layout.bytes_per_block_per_layer < _MIN_RUN_BYTES * len(set(run_ends)):
        return None
    return [t.view(torch.uint8).numpy().reshape(2, t.shape[1], -1) for t in kv_caches]


def _run_ends(block_ids: list[int]) -> list[int]:
    """run_ends[i]: where the run of consecutive destination ids containing block i ends."""
    ends = [0] * len(block_ids)
    end = len(block_ids)
    for i in range(len(block_ids) - 1, -1, -1):
        if i + 1 < len(block_ids) and block_ids[i + 1] != block_ids[i] + 1:
            end = i + 1
        ends[i] = end
    return ends


def _copy_runs(
    dst: np.ndarray, src: torch.Tensor, block_ids: list[int], run_ends: list[int], first: int, n: int
) -> None:
    """Blocks [first, first + n) of the transfer into their local blocks, one copy per run.

    dst: [2, num_local_blocks, B] uint8; src: [2, n, block_size, kv_heads, head_dim].
    """
    src_bytes = src.view(torch.uint8).numpy().reshape(2, n, -1)  # [2, n, B], still a view
    i, end = first, first + n
    while i < end:
        j = min(run_ends[i], end)
        local = block_ids[i]
        np.copyto(dst[:, local : local + j - i], src_bytes[:, i - first : j - first])
        i = j


def _check_done(
    done: pb.KVTransferDone, spec: LoadSpec, written: list[bytearray], num_chunks: int, layout: KVCacheLayout
) -> int:
    """The first token, once the done frame agrees with what arrived: every block of every
    layer (the draft's too, unless the prefill worker says it sent none)."""
    if done.request_id != spec.request_id:
        raise wire.KVChunkError(f"done.request_id: got {done.request_id[:64]!r}, expected {spec.request_id!r}")
    if done.num_tokens != spec.num_tokens:
        raise wire.KVChunkError(f"done.num_tokens: got {done.num_tokens}, expected {spec.num_tokens}")
    if done.num_chunks != num_chunks:
        raise wire.KVChunkError(f"done.num_chunks: got {done.num_chunks}, received {num_chunks}")
    num_layers = layout.num_layers if done.has_draft_kv else layout.num_target_layers
    if done.has_draft_kv and not layout.num_draft_layers:
        raise wire.KVChunkError("done.has_draft_kv: this worker asked for no draft layers")
    missing = next((layer for layer, blocks in enumerate(written[:num_layers]) if not all(blocks)), None)
    if missing is not None:
        raise wire.KVChunkError(f"done: layer {missing} is missing blocks")
    return done.first_token_id
