"""The prefill worker's connector: stages each layer's new KV blocks for decode workers to pull.

Scheduler side: a request whose `kv_transfer_params` carry a transfer token is a
saving request; each step's metadata says which of its blocks became final (full, or
the prompt's last, partial block) and must be staged: prefix-cache hits included, but
none before the first block the decode worker asked for if its pull came first. Worker side: `save_kv_layer`
copies those blocks of that layer into the transfer's staging buffer and publishes
them, so a pull streams layer L while later layers still compute. The copies are
asynchronous: on CUDA on a side stream into pinned memory, on CPU on a copy thread
(the forward goes on meanwhile, on the other core); each chunk is published once its
copy is done, and `wait_for_save` waits for all of them.
When the request finishes, its blocks are freed only after `finished_sending` reports it.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from kvservice.connector import wire
from kvservice.connector.base import TRANSFER_TOKEN, KVConnectorBase
from kvservice.connector.transfer_registry import (
    StagedChunk,
    StagedTransfer,
    TransferRegistry,
)
from kvservice.core.kv_cache_manager import cdiv
from kvservice.core.outputs import (
    KVConnectorMetadata,
    KVConnectorStats,
    SchedulerOutput,
    StagingStats,
)
from kvservice.core.request import Request, RequestStatus
from kvservice.model.attention import AttentionMetadata
from kvservice.model.kv_cache import KVCacheLayout
from kvservice.runtime.native_thread import name_native_thread

DEFAULT_CHUNK_BYTES = 2 << 20  # 2-4 MiB messages stream fastest over gRPC


@dataclass(frozen=True, slots=True)
class SaveSpec:
    """Stage blocks [first_block, first_block + len(block_ids)) of a request's prompt."""

    request_id: str
    first_block: int
    block_ids: list[int]


@dataclass(slots=True)
class PrefillConnectorMetadata(KVConnectorMetadata):
    saves: list[SaveSpec] = field(default_factory=list)


class _CopyDone(Protocol):
    """What a pending copy is waited on with: a torch.cuda.Event, or a thread's future."""

    def query(self) -> bool: ...

    def synchronize(self) -> None: ...

    def crc32(self) -> int | None:
        """The staged bytes' CRC-32 if the copy computed it (after `synchronize`)."""
        ...


class _FutureDone:
    def __init__(self, future: concurrent.futures.Future[int]) -> None:
        self._future = future

    def query(self) -> bool:
        return self._future.done()

    def synchronize(self) -> None:
        self._future.result()

    def crc32(self) -> int | None:
        return self._future.result()


class _EventDone:
    """A CUDA copy: the sender computes the CRC-32 from the pinned buffer."""

    def __init__(self, event: torch.cuda.Event) -> None:
        self._event = event

    def query(self) -> bool:
        return bool(self._event.query())

    def synchronize(self) -> None:
        self._event.synchronize()

    def crc32(self) -> int | None:
        return None


@dataclass(slots=True)
class _PendingCopy:
    done: _CopyDone
    transfer: StagedTransfer
    chunk: StagedChunk


class PrefillKVConnector(KVConnectorBase):
    def __init__(self, registry: TransferRegistry, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> None:
        super().__init__()
        self.registry = registry
        self.layout: KVCacheLayout = registry.layout
        self.blocks_per_chunk = max(1, chunk_bytes // self.layout.bytes_per_block_per_layer)
        # Scheduler side: blocks staged so far per saving request.
        self._num_staged_blocks: dict[str, int] = {}
        # Worker side.
        self._step_transfers: dict[str, StagedTransfer] = {}
        self._pending_copies: list[_PendingCopy] = []
        self._pending_complete: dict[str, int] = {}
        self._finished_saving: set[str] = set()  # finished, not yet in finished_req_ids
        self._finished_reported: set[str] = set()  # in finished_req_ids, awaiting copies
        self._copy_stream: Any = None
        self._copy_thread: concurrent.futures.ThreadPoolExecutor | None = None

    @property
    def moves_draft_kv(self) -> bool:
        return self.layout.num_draft_layers > 0

    def register_kv_caches(self, kv_caches: list[torch.Tensor], layout: KVCacheLayout) -> None:
        assert layout == self.layout, f"engine KV layout {layout} differs from the staging layout {self.layout}"
        if kv_caches[0].is_cuda:
            self._copy_stream = torch.cuda.Stream(device=kv_caches[0].device)
        else:
            self._copy_thread = concurrent.futures.ThreadPoolExecutor(
                1, thread_name_prefix="kv-stage", initializer=name_native_thread
            )

    # ------------------------------------------------------------ scheduler side

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        return 0, False  # a prefill worker computes everything itself

    def update_state_after_alloc(self, request: Request, block_ids: list[int], num_external_tokens: int) -> None:
        pass

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> PrefillConnectorMetadata:
        meta = PrefillConnectorMetadata()
        bs = self.layout.block_size
        for item in scheduler_output.scheduled:
            request = item.request
            if not _is_saving(request):
                continue
            staged = self._num_staged_blocks.get(request.request_id)
            if staged is None:
                # A pull that already started names the first block it needs: stage from there.
                staged = self.registry.first_block_to_stage(request.request_id)
            end = min(request.num_computed_tokens + item.num_new_tokens, request.num_prompt_tokens)
            # Full blocks are final; the last, partial block is final once the prompt is done.
            upto = cdiv(end, bs) if end == request.num_prompt_tokens else end // bs
            if upto > staged:
                meta.saves.append(SaveSpec(request.request_id, staged, item.block_ids[staged:upto]))
                self._num_staged_blocks[request.request_id] = upto
        return meta

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        if not _is_saving(request):
            return False, None
        self._num_staged_blocks.pop(request.request_id, None)
        if (
            request.status in (RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_ERROR)
            or not request.output_token_ids
        ):
            self.registry.fail(request.request_id, "the prefill request was aborted")
        elif any(p.transfer.request_id == request.request_id for p in self._pending_copies):
            self._pending_complete[request.request_id] = request.output_token_ids[0]
        else:
            self.registry.complete(request.request_id, request.output_token_ids[0])
        # Free the device blocks only once get_finished says no copy reads them.
        self._finished_saving.add(request.request_id)
        return True, request.kv_transfer_params

    # ------------------------------------------------------------ worker side

    def bind_connector_metadata(self, metadata: KVConnectorMetadata) -> None:
        assert isinstance(metadata, PrefillConnectorMetadata)
        super().bind_connector_metadata(metadata)
        for spec in metadata.saves:
            if spec.request_id not in self._step_transfers:
                transfer = self.registry.pin(spec.request_id)
                if transfer is not None:
                    self._step_transfers[spec.request_id] = transfer

    def start_load_kv(self, forward_context: Any) -> None:
        pass  # nothing to load on a prefill worker

    def save_kv_layer(self, layer: int, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata) -> None:
        meta = self.connector_metadata
        assert isinstance(meta, PrefillConnectorMetadata)
        if not meta.saves:
            return
        if self._copy_stream is not None:
            self._copy_stream.wait_stream(torch.cuda.current_stream(kv_layer.device))
        self._publish_ready_copies(block=False)
        for spec in meta.saves:
            transfer = self._step_transfers.get(spec.request_id)
            if transfer is None:
                continue  # the transfer failed or expired: nobody will pull it
            for start in range(0, len(spec.block_ids), self.blocks_per_chunk):
                ids = spec.block_ids[start : start + self.blocks_per_chunk]
                chunk, dst = self.registry.chunk_buffer(transfer, layer, spec.first_block + start, len(ids))
                index = torch.tensor(ids, dtype=torch.long, device=kv_layer.device)
                if self._copy_stream is not None:
                    self._copy_async(kv_layer, index, dst, transfer, chunk)
                elif self._copy_thread is not None:
                    future = self._copy_thread.submit(_stage_copy, kv_layer, index, dst)
                    self._pending_copies.append(_PendingCopy(_FutureDone(future), transfer, chunk))
                else:  # no caches registered (tests driving the connector by hand): copy now
                    torch.index_select(kv_layer, 1, index, out=dst)
                    self.registry.publish(transfer, chunk)

    def _copy_async(
        self,
        kv_layer: torch.Tensor,
        index: torch.Tensor,
        dst: torch.Tensor,
        transfer: StagedTransfer,
        chunk: StagedChunk,
    ) -> None:
        """CUDA: gather on the side stream, copy to pinned host memory without blocking, record an event."""
        with torch.cuda.stream(self._copy_stream):
            gathered = kv_layer.index_select(1, index)
            dst.copy_(gathered, non_blocking=True)
            # The gathered tensor must outlive the copy: tie it to the side stream.
            gathered.record_stream(self._copy_stream)
            event = torch.cuda.Event()
            event.record(self._copy_stream)
        self._pending_copies.append(_PendingCopy(_EventDone(event), transfer, chunk))

    def _publish_ready_copies(self, block: bool) -> None:
        while self._pending_copies:
            head = self._pending_copies[0]
            if block:
                head.done.synchronize()
            elif not head.done.query():
                return
            self._pending_copies.pop(0)
            crc32 = head.done.crc32()
            self.registry.publish(
                head.transfer, head.chunk if crc32 is None else dataclasses.replace(head.chunk, crc32=crc32)
            )
        for request_id, token_id in self._pending_complete.items():
            self.registry.complete(request_id, token_id)
        self._pending_complete.clear()

    def wait_for_save(self) -> None:
        self._publish_ready_copies(block=True)

    def clear_connector_metadata(self) -> None:
        # Copies into a buffer must land before it is unpinned (and perhaps released).
        self._publish_ready_copies(block=True)
        for transfer in self._step_transfers.values():
            self.registry.unpin(transfer)
        self._step_transfers.clear()
        super().clear_connector_metadata()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        self._finished_reported |= self._finished_saving & finished_req_ids
        self._finished_saving -= finished_req_ids
        if self._pending_copies:
            return set(), set()  # a deferred save still reads device blocks
        done, self._finished_reported = self._finished_reported, set()
        return done, set()

    def get_kv_connector_stats(self) -> dict[str, Any] | None:
        pool = self.registry.pool
        return {"staging_bytes_in_use": pool.bytes_in_use, "staging_bytes_capacity": pool.capacity_bytes}

    def make_stats(self) -> KVConnectorStats:
        pool = self.registry.pool
        return KVConnectorStats(
            staging=StagingStats(pool.bytes_in_use, pool.capacity_bytes, self.registry.num_transfers)
        )

    def shutdown(self) -> None:
        self._publish_ready_copies(block=True)
        if self._copy_thread is not None:
            self._copy_thread.shutdown()


def _stage_copy(kv_layer: torch.Tensor, index: torch.Tensor, dst: torch.Tensor) -> int:
    """Gather blocks into the staging buffer with numpy (a torch op here would start an
    OpenMP team of its own and oversubscribe the cores the forward is using); the staged
    bytes' CRC-32, computed while they are still in cache, so the sender need not read
    them twice."""
    with torch.inference_mode():  # per thread; the views are inference tensors
        src = kv_layer.view(torch.uint8).numpy()
        out = dst.view(torch.uint8).numpy()
    np.take(src, index.numpy(), axis=1, out=out)
    return wire.checksum(memoryview(out).cast("B"))


def _is_saving(request: Request) -> bool:
    return bool(request.kv_transfer_params and TRANSFER_TOKEN in request.kv_transfer_params)
