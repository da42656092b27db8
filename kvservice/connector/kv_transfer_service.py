"""The `KVTransfer.PullKV` service on prefill workers: streams staged KV as it is published.

Registered as a generic handler with identity serializers: frames leave as the raw
bytes built by `wire.encode_chunk` (the header through protobuf, the payload joined
with one copy out of the staging buffer), which are still valid `KVChunk` messages.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
import numpy as np

from kvservice.connector import wire
from kvservice.connector.shared_memory import OpenSegments, RingWriter, SharedSegment
from kvservice.connector.transfer_errors import TransferDenied, TransferInvalid, TransferNotFound
from kvservice.connector.transfer_registry import StagedChunk, StagedTransfer, TransferRegistry, TransferState
from kvservice.core.outputs import KVTransferCounters
from kvservice.core.request import check_request_id
from kvservice.model.kv_cache import KVCacheLayout
from kvservice.v1 import kvservice_pb2 as pb

logger = logging.getLogger(__name__)

PULL_KV_METHOD = "/kvservice.v1.KVTransfer/PullKV"


class KVTransferService:
    def __init__(self, registry: TransferRegistry, registration_timeout: float = 30.0) -> None:
        self.registry = registry
        self.registration_timeout = registration_timeout
        self.stats = KVTransferCounters()
        layout = registry.layout
        self._dtype = wire.dtype_name(layout.dtype)
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
        # The draft's layers go only to a puller that runs the same draft (checked above).
        sends_draft = bool(request.num_draft_layers and layout.num_draft_layers)
        num_layers_sent = layout.num_layers if sends_draft else layout.num_target_layers
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
            async for frame in self._frames(transfer, changed, sent, segment, num_layers_sent):
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
            has_draft_kv=sends_draft,
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
        self,
        transfer: StagedTransfer,
        changed: asyncio.Event,
        sent: _Sent,
        segment: SharedSegment | None,
        num_layers: int,
    ) -> AsyncIterator[bytes]:
        """The chunks the puller needs (of its `num_layers` layers, those ending past its first
        block) as they are published, counted in `sent`; ends once all are sent and the transfer is complete,
        or when it failed. With a `segment`, each chunk's bytes go into its ring (when they
        fit) and its frame carries only the header."""
        ring = RingWriter(segment) if segment is not None else None
        num_seen = 0
        while True:
            changed.clear()
            chunks, state = self.registry.snapshot(transfer, num_seen)
            num_seen += len(chunks)
            for chunk in chunks:
                if chunk.layer >= num_layers:
                    continue  # a draft's layer, for a puller without that draft
                outgoing = await self.encode_chunk(transfer, chunk, ring)
                if outgoing is None:
                    continue
                yield outgoing.frame
                self._count(sent, outgoing)
            if state is TransferState.FAILED or (state is TransferState.COMPLETE and not chunks):
                return
            if not chunks:
                # Wake on the next publish, or renew the lease while the prefill runs.
                try:
                    await asyncio.wait_for(changed.wait(), self.registry.lease_seconds / 3)
                except TimeoutError:
                    pass

    async def encode_chunk(
        self, transfer: StagedTransfer, chunk: StagedChunk, ring: RingWriter | None
    ) -> OutgoingChunk | None:
        """`chunk` as the frame this pull sends, its bytes written into `ring` first when
        they fit there; None when the puller caches all of its blocks. The one place a
        staged chunk becomes a frame: a subclass that alters what goes out overrides it."""
        skip = transfer.first_block - chunk.first_block  # blocks the puller caches
        if skip >= chunk.num_blocks:
            return None
        payload = _unsent_payload(transfer, chunk, skip)
        num_blocks = chunk.num_blocks - max(skip, 0)
        position = None
        if ring is not None and ring.fits(len(payload)):
            position = await ring.write(np.frombuffer(payload, dtype=np.uint8))
        frame = wire.encode_chunk(
            request_id=transfer.request_id,
            layer=chunk.layer,
            first_block=chunk.first_block + max(skip, 0),
            num_blocks=num_blocks,
            dtype=self._dtype,
            shape=self.registry.layout.blocks_shape(num_blocks),
            payload=payload,
            crc32=chunk.crc32 if skip <= 0 else None,  # a re-packed payload has its own
            shared_memory_position=position,
        )
        return OutgoingChunk(frame, len(payload), position)

    def _count(self, sent: _Sent, outgoing: OutgoingChunk) -> None:
        """A chunk went out: this pull's and the service's counters."""
        sent.num_chunks += 1
        sent.num_bytes += outgoing.num_bytes
        self.stats.num_chunks += 1
        self.stats.num_bytes += outgoing.num_bytes
        if outgoing.shared_memory_position is not None:
            self.stats.num_shared_memory_bytes += outgoing.num_bytes


@dataclass(frozen=True, slots=True)
class OutgoingChunk:
    """One chunk's frame, and the payload it describes: `num_bytes` of it, in the ring at
    `shared_memory_position` or (None) at the end of `frame`."""

    frame: bytes
    num_bytes: int
    shared_memory_position: int | None


@dataclass(slots=True)
class _Sent:
    """What one pull sent: the done frame reports it."""

    num_chunks: int = 0
    num_bytes: int = 0


def _unsent_payload(transfer: StagedTransfer, chunk: StagedChunk, skip: int) -> memoryview:
    """The bytes of `chunk` the puller does not cache: all of them, or (`skip` > 0) K and V
    of its blocks past the first `skip`, re-packed contiguously."""
    buffer = transfer.buffer.tensor
    payload = memoryview(buffer[chunk.offset : chunk.offset + chunk.num_bytes].numpy())
    if skip <= 0:
        return payload
    # Staged before the pull said where it starts: send only the rest.
    kv = np.asarray(payload).reshape(2, chunk.num_blocks, -1)  # [K/V, num_blocks, block bytes]
    return memoryview(np.ascontiguousarray(kv[:, skip:])).cast("B")


def _layout_mismatch(request: pb.PullKVRequest, layout: KVCacheLayout, dtype: str) -> str | None:
    """Why a pull cannot be served from this layout: the target's geometry differs, or both
    ends run a speculative draft and not the same one. None if it can."""
    if request.dtype != dtype:
        return (
            f"KV cache dtype mismatch: the decode worker's KV is {request.dtype[:64]!r}, this prefill worker's "
            f"{dtype!r}; give both the same --kv-cache-dtype (and --dtype)"
        )
    num_target_layers = request.num_layers - min(request.num_draft_layers, request.num_layers)
    theirs = (num_target_layers, request.block_size, request.num_kv_heads, request.head_dim, request.dtype)
    ours = (layout.num_target_layers, layout.block_size, layout.num_kv_heads, layout.head_dim, dtype)
    if theirs != ours:
        return (
            "KV layout mismatch (num_layers, block_size, num_kv_heads, head_dim, dtype): "
            f"puller {theirs}, prefill worker {ours}"
        )
    their_draft = (request.num_draft_layers, request.draft_fingerprint)
    our_draft = (layout.num_draft_layers, layout.draft_fingerprint)
    if request.num_draft_layers and layout.num_draft_layers and their_draft != our_draft:
        return (
            f"speculative draft mismatch: the decode worker runs {request.draft_fingerprint!r} "
            f"({request.num_draft_layers} layers), this prefill worker {layout.draft_fingerprint!r} "
            f"({layout.num_draft_layers} layers); give both the same --draft-model"
        )
    return None
