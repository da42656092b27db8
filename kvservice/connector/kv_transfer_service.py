"""The `KVTransfer.PullKV` service on prefill workers: streams staged KV as it is published.

Registered as a generic handler with identity serializers: frames leave as the raw
bytes built by `wire.encode_chunk` (the header through protobuf, the payload joined
with one copy out of the staging buffer), which are still valid `KVChunk` messages.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
import numpy as np

from kvservice.connector import wire
from kvservice.connector.shared_memory import OpenSegments, RingWriter, SharedSegment
from kvservice.connector.transfer_errors import TransferDenied, TransferInvalid, TransferNotFound
from kvservice.connector.transfer_registry import StagedTransfer, TransferRegistry, TransferState
from kvservice.core.outputs import KVTransferCounters
from kvservice.core.request import check_request_id
from kvservice.model.kv_cache import KVCacheLayout
from kvservice.v1 import kvservice_pb2 as pb

logger = logging.getLogger(__name__)

PULL_KV_METHOD = "/kvservice.v1.KVTransfer/PullKV"
# Test hook, never for production: with KVSERVICE_FAULT_CORRUPT_CHUNK_EVERY=N in a prefill
# worker's environment, one byte of every Nth chunk's payload is flipped after its checksum
# is computed, so the decode side must reject it (tests/test_faults.py).
FAULT_CORRUPT_CHUNK_EVERY = "KVSERVICE_FAULT_CORRUPT_CHUNK_EVERY"


class KVTransferService:
    def __init__(self, registry: TransferRegistry, registration_timeout: float = 30.0) -> None:
        self.registry = registry
        self.registration_timeout = registration_timeout
        self.stats = KVTransferCounters()
        layout = registry.layout
        self._dtype = wire.dtype_name(layout.dtype)
        self._corrupt_every = int(os.environ.get(FAULT_CORRUPT_CHUNK_EVERY, "0"))
        self._segments = OpenSegments()  # pullers' segments, kept mapped: a puller reuses them

    def close(self) -> None:
        """Unmap the pullers' segments (once the server has stopped: no pull is running)."""
        self._segments.close()

    def handler(self) -> grpc.GenericRpcHandler:
        return grpc.method_handlers_generic_handler(
            "kvservice.v1.KVTransfer",
            {
                "PullKV": grpc.unary_stream_rpc_method_handler(
                    self.pull_kv, request_deserializer=pb.PullKVRequest.FromString, response_serializer=None
                )
            },
        )

    async def pull_kv(self, request: pb.PullKVRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        try:
            check_request_id(request.request_id)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        layout = self.registry.layout
        mismatch = _layout_mismatch(request, layout, self._dtype)
        if mismatch:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, mismatch)
        try:
            transfer = await self.registry.wait_registered(
                request.request_id, request.transfer_token, self.registration_timeout
            )
            changed = self.registry.start_pull(transfer, request.transfer_token, request.first_block)
        except TransferInvalid as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except TransferNotFound as e:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(e))
        except TransferDenied as e:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, str(e))
        start = time.perf_counter()
        is_sent = is_delivered = False
        sent = _Sent()
        segment = self._open_segment(request, transfer)
        try:
            async for frame in self._frames(transfer, changed, sent, segment):
                yield frame
            is_sent = True
        finally:
            # Ended before the done frame goes out (it needs nothing staged): the staging is
            # freed now, and a release or abort that arrives while the done frame is on its
            # way finds a delivered transfer, not one to fail under a finished pull.
            is_delivered = self.registry.end_pull(transfer, changed) and is_sent
            self.stats.num_transfers += 1
            self.stats.total_seconds += time.perf_counter() - start
            if not is_delivered:
                self.stats.num_failed_transfers += 1
        if not is_delivered:
            await context.abort(grpc.StatusCode.ABORTED, transfer.error or "transfer failed")
        assert transfer.first_token_id is not None
        yield wire.encode_done(
            request_id=transfer.request_id,
            first_token_id=transfer.first_token_id,
            num_chunks=sent.num_chunks,
            num_bytes=sent.num_bytes,
            num_tokens=transfer.num_tokens,
        )

    def _open_segment(self, request: pb.PullKVRequest, transfer: StagedTransfer) -> SharedSegment | None:
        """The puller's shared-memory segment, if it offered one and it opens here; else None
        (the bytes stream over gRPC)."""
        if not request.shared_memory:
            return None
        try:
            return self._segments.open(request.shared_memory)
        except OSError as e:  # SharedMemoryUnavailable among them
            logger.info(
                "request %s: KV goes over the gRPC stream: the puller's shared memory does not open here (%s)",
                transfer.request_id,
                e,
            )
            return None

    async def _frames(
        self, transfer: StagedTransfer, changed: asyncio.Event, sent: _Sent, segment: SharedSegment | None
    ) -> AsyncIterator[bytes]:
        """The chunks the puller needs (those ending past its first block) as they are
        published, counted in `sent`; ends once all are sent and the transfer is complete,
        or when it failed. With a `segment`, each chunk's bytes go into its ring (when they
        fit) and its frame carries only the header."""
        ring = RingWriter(segment) if segment is not None else None
        num_seen = 0
        layout = self.registry.layout
        buffer = transfer.buffer.tensor
        while True:
            changed.clear()
            chunks, state = self.registry.snapshot(transfer, num_seen)
            num_seen += len(chunks)
            for chunk in chunks:
                skip = transfer.first_block - chunk.first_block  # blocks the puller caches
                if skip >= chunk.num_blocks:
                    continue
                payload = memoryview(buffer[chunk.offset : chunk.offset + chunk.num_bytes].numpy())
                if skip > 0:
                    # Staged before the pull said where it starts: send only the rest (K and V of it).
                    payload = memoryview(
                        np.ascontiguousarray(np.asarray(payload).reshape(2, chunk.num_blocks, -1)[:, skip:])
                    ).cast("B")
                num_blocks = chunk.num_blocks - max(skip, 0)
                first_block = chunk.first_block + max(skip, 0)
                position = None
                if ring is not None and ring.fits(len(payload)):
                    position = await ring.write(np.frombuffer(payload, dtype=np.uint8))
                frame = wire.encode_chunk(
                    request_id=transfer.request_id,
                    layer=chunk.layer,
                    first_block=first_block,
                    num_blocks=num_blocks,
                    dtype=self._dtype,
                    shape=layout.blocks_shape(num_blocks),
                    payload=payload,
                    crc32=chunk.crc32 if skip <= 0 else None,  # a re-packed payload has its own
                    shared_memory_position=position,
                )
                if self._corrupt_every > 0 and (self.stats.num_chunks + 1) % self._corrupt_every == 0:
                    if ring is not None and position is not None:
                        ring.segment.ring_region(position + len(payload) - 1, 1)[0] ^= 0xFF
                    else:
                        frame = _flip_last_byte(frame)  # the payload ends the frame
                yield frame
                sent.num_chunks += 1
                sent.num_bytes += len(payload)
                self.stats.num_chunks += 1
                self.stats.num_bytes += len(payload)
                if position is not None:
                    self.stats.num_shared_memory_bytes += len(payload)
            if state is TransferState.FAILED or (state is TransferState.COMPLETE and not chunks):
                return
            if not chunks:
                # Wake on the next publish, or renew the lease while the prefill runs.
                try:
                    await asyncio.wait_for(changed.wait(), self.registry.lease_seconds / 3)
                except TimeoutError:
                    pass


@dataclass(slots=True)
class _Sent:
    """What one pull sent: the done frame reports it."""

    num_chunks: int = 0
    num_bytes: int = 0


def _flip_last_byte(frame: bytes) -> bytes:
    """The fault hook's corruption: the frame with its last (payload) byte inverted."""
    return frame[:-1] + bytes([frame[-1] ^ 0xFF])


def _layout_mismatch(request: pb.PullKVRequest, layout: KVCacheLayout, dtype: str) -> str | None:
    theirs = (request.num_layers, request.block_size, request.num_kv_heads, request.head_dim, request.dtype)
    ours = (layout.num_layers, layout.block_size, layout.num_kv_heads, layout.head_dim, dtype)
    if theirs != ours:
        return (
            "KV layout mismatch (num_layers, block_size, num_kv_heads, head_dim, dtype): "
            f"puller {theirs}, prefill worker {ours}"
        )
    return None
