"""The offload tier as the engine sees it: evicted blocks saved, missed prefixes loaded back.

`OffloadTier` joins a `KVTier` (`offload_store`: the disk store, or host memory) to this
worker's KV caches. The engine calls it on its step thread only:

- `save(evicted)` right after the scheduler allocated (and so evicted) blocks, before the
  step's forward writes them: each evicted full block's KV (every layer) is packed and queued
  for the tier's I/O thread;
- `contains(block_hash)` when the scheduler looks past a request's prefix-cache hit;
- `start_load(request_id, block_hashes, block_ids)` for the blocks found there: the reads run
  on the I/O thread, and `take_finished()` copies what arrived into the blocks and says how
  many leading blocks of each load are valid (a block the store dropped ends the valid run:
  the rest is recomputed). `cancel` forgets a load whose request ended.

Payloads are validated by the store (checksum, fingerprint) and again here (size).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from kvservice.connector.offload_io import OffloadIO, pack_block, unpack_block
from kvservice.connector.offload_store import KVTier, KVTierStats
from kvservice.core.block_pool import OFFLOAD_TIER, KVCacheEvent
from kvservice.model.kv_cache import KVCacheLayout

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _Load:
    block_ids: list[int]
    future: Future[list[bytes | None]]


class OffloadTier:
    def __init__(self, tier: KVTier, max_pending: int = 64) -> None:
        self.tier = tier
        self.io = OffloadIO(tier, max_pending)
        self._loads: dict[str, _Load] = {}
        self._kv_caches: list[torch.Tensor] = []
        self._layout: KVCacheLayout | None = None
        # Called from the I/O thread when a load completes (the engine's wake-up).
        self.on_load_done: Callable[[], None] | None = None
        self.num_blocks_saved = 0
        self.num_hit_blocks = 0  # blocks of prefixes the cache missed, found here and asked for
        self.num_blocks_loaded = 0
        self.num_blocks_invalid = 0

    def register_kv_caches(self, kv_caches: list[torch.Tensor], layout: KVCacheLayout) -> None:
        self._kv_caches, self._layout = kv_caches, layout

    @property
    def stats(self) -> KVTierStats:
        return self.tier.stats

    @property
    def has_pending_loads(self) -> bool:
        return bool(self._loads)

    def contains(self, block_hash: int) -> bool:
        return self.tier.contains(block_hash)

    def take_events(self) -> list[KVCacheEvent]:
        """The tier's changes since the last call, as KV events (runs of one kind joined)."""
        events: list[KVCacheEvent] = []
        for is_stored, run in itertools.groupby(self.tier.take_changes(), key=lambda change: change[0]):
            kind = "stored" if is_stored else "removed"
            events.append(KVCacheEvent(kind, tuple(block_hash for _, block_hash in run), tier=OFFLOAD_TIER))
        return events

    def snapshot(self) -> list[KVCacheEvent]:
        """Everything the tier holds now, as one `stored` event (none when it holds nothing)."""
        held = tuple(self.tier.block_hashes())
        return [KVCacheEvent("stored", held, tier=OFFLOAD_TIER)] if held else []

    def save(self, evicted: list[tuple[int, int]]) -> None:
        """Queue the evicted blocks' KV (still in place: the step that reuses them has not run)."""
        for block_hash, block_id in evicted:
            payload = pack_block([cache[:, block_id] for cache in self._kv_caches])
            if self.io.submit_write(block_hash, payload):
                self.num_blocks_saved += 1

    def start_load(self, request_id: str, block_hashes: list[int], block_ids: list[int]) -> None:
        future = self.io.submit_read(block_hashes)
        self._loads[request_id] = _Load(list(block_ids), future)
        self.num_hit_blocks += len(block_hashes)
        wake = self.on_load_done
        if wake is not None:
            future.add_done_callback(lambda _: wake())

    def cancel(self, request_id: str) -> None:
        """Forget a load (its request ended): its result will not be copied anywhere."""
        self._loads.pop(request_id, None)

    def take_finished(self) -> dict[str, int]:
        """Per load that completed: its blocks copied in place, and how many leading ones are valid."""
        done = {r: load for r, load in self._loads.items() if load.future.done()}
        finished: dict[str, int] = {}
        for request_id, load in done.items():
            del self._loads[request_id]
            finished[request_id] = self._copy_in(request_id, load)
        return finished

    def close(self) -> None:
        self.io.close()
        close = getattr(self.tier, "close", None)
        if close is not None:
            close()

    def _copy_in(self, request_id: str, load: _Load) -> int:
        assert self._layout is not None
        try:
            payloads = load.future.result()
        except Exception:  # a tier's bug must not fail the request: it recomputes
            logger.exception("request %s: reading its blocks from the KV offload tier failed", request_id)
            return 0
        num_valid = 0
        for block_id, payload in zip(load.block_ids, payloads):
            if payload is None:
                break
            try:
                layers = unpack_block(payload, self._layout)
            except ValueError as e:
                logger.warning("request %s: a block from the KV offload tier is dropped: %s", request_id, e)
                break
            for cache, layer in zip(self._kv_caches, layers):
                cache[:, block_id].copy_(layer)
            num_valid += 1
        self.num_blocks_loaded += num_valid
        self.num_blocks_invalid += len(load.block_ids) - num_valid
        return num_valid
