"""A KV tier's disk work off the step loop, and a block's layers as one payload.

`OffloadIO` runs a tier's (`kvservice.connector.offload_store.KVTier`) reads and writes on one
background thread behind a bounded queue, so the step loop never waits on a disk; `pack_block`
and `unpack_block` turn one block's per-layer K/V into the bytes a tier stores, and back.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from kvservice.connector.offload_store import KVTier
from kvservice.model.kv_cache import KVCacheLayout

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class _Write:
    block_hash: int
    payload: bytes


@dataclass(frozen=True, slots=True)
class _Read:
    block_hashes: tuple[int, ...]
    future: Future[list[bytes | None]]


class OffloadIO:
    """A tier's reads and writes on one background thread, behind a bounded queue.

    The step loop (one thread) submits; nothing it calls waits on the disk. A write is fire
    and forget; a read returns a future of the payloads (None per missing block). When
    `max_pending` jobs are queued, a write is dropped and a read resolves at once to all
    None (a miss: the blocks are recomputed), both counted: memory stays bounded.
    """

    def __init__(self, tier: KVTier, max_pending: int = 64, name: str = "kv-offload-io") -> None:
        if max_pending < 1:
            raise ValueError(f"max_pending must be >= 1, got {max_pending}")
        self.tier = tier
        self.num_writes_dropped = 0
        self.num_reads_dropped = 0
        self._queue: queue.Queue[_Write | _Read | None] = queue.Queue(maxsize=max_pending)
        self._is_closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit_write(self, block_hash: int, payload: bytes) -> bool:
        """Queue a block's write; False when the queue is full and it was dropped."""
        self._check_open()
        try:
            self._queue.put_nowait(_Write(block_hash, payload))
        except queue.Full:
            self.num_writes_dropped += 1
            return False
        return True

    def submit_read(self, block_hashes: Sequence[int]) -> Future[list[bytes | None]]:
        """Queue a batch of reads; the future holds one payload (or None) per hash, in order."""
        self._check_open()
        future: Future[list[bytes | None]] = Future()
        try:
            self._queue.put_nowait(_Read(tuple(block_hashes), future))
        except queue.Full:
            self.num_reads_dropped += 1
            future.set_result([None] * len(block_hashes))
        return future

    def close(self) -> None:
        """Run every queued job, then stop the thread. Idempotent."""
        if self._is_closed:
            return
        self._is_closed = True
        self._queue.put(None)  # waits while the queue is full: the thread is emptying it
        self._thread.join()

    def _check_open(self) -> None:
        if self._is_closed:
            raise RuntimeError("OffloadIO is closed")

    def _run(self) -> None:
        while (job := self._queue.get()) is not None:
            if isinstance(job, _Write):
                try:
                    self.tier.write(job.block_hash, job.payload)
                except Exception:  # a tier's bug must not stop every later job
                    logger.exception("KV offload write of block %016x failed", job.block_hash)
            elif job.future.set_running_or_notify_cancel():
                try:
                    job.future.set_result([self.tier.read(block_hash) for block_hash in job.block_hashes])
                except Exception as e:
                    job.future.set_exception(e)


# ---------------------------------------------------------------- payloads


def pack_block(layers: list[torch.Tensor]) -> bytes:
    """One block's payload: each layer's [2, block_size, num_kv_heads, head_dim] K and V, layer by layer."""
    if not layers:
        raise ValueError("pack_block needs at least one layer")
    shape, dtype = layers[0].shape, layers[0].dtype
    if len(shape) != 4 or shape[0] != 2:
        raise ValueError(f"a layer's block is [2, block_size, num_kv_heads, head_dim], got {list(shape)}")
    for i, layer in enumerate(layers):
        if layer.shape != shape or layer.dtype != dtype:
            raise ValueError(f"layer {i} is {list(layer.shape)} {layer.dtype}, layer 0 is {list(shape)} {dtype}")
    # [num_layers, 2, block_size, num_kv_heads, head_dim]; uint8 first: numpy has no bfloat16.
    return torch.stack(layers).cpu().view(torch.uint8).numpy().tobytes()


def unpack_block(payload: bytes | memoryview, layout: KVCacheLayout) -> list[torch.Tensor]:
    """The per-layer [2, block_size, num_kv_heads, head_dim] tensors of a payload from `pack_block`."""
    data = memoryview(payload).cast("B")
    if data.nbytes != layout.bytes_per_block:
        raise ValueError(f"a block of this layout is {layout.bytes_per_block} bytes, the payload is {data.nbytes}")
    flat = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(layout.dtype)
    blocks = flat.view(layout.num_layers, *layout.blocks_shape(1)).squeeze(2)
    return list(blocks.unbind(0))
