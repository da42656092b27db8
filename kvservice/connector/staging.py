"""Host staging memory for KV on its way out of a prefill worker: one bounded arena.

The arena is allocated (and touched) once at start-up; transfers reserve contiguous
byte ranges from it, first fit, and give them back when the decode side has pulled
them or their lease ran out. Reuse beats fresh allocation: a fresh large buffer costs
more in page faults than the copy into it. On CUDA the arena is pinned, so the
device-to-host copies can run asynchronously on a side stream.
"""

from __future__ import annotations

import bisect
import threading
from dataclasses import dataclass

import torch

from kvservice.core.kv_cache_manager import cdiv

_ALIGN = 256


@dataclass(frozen=True, slots=True)
class StagingBuffer:
    offset: int
    num_bytes: int
    tensor: torch.Tensor  # uint8 view of the arena range


class StagingPool:
    """Thread-safe first-fit allocator over one preallocated arena; never grows."""

    def __init__(self, capacity_bytes: int, pin_memory: bool = False) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"staging capacity must be > 0, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self._arena = torch.zeros(capacity_bytes, dtype=torch.uint8, pin_memory=pin_memory)
        self._lock = threading.Lock()
        # Free ranges as sorted, non-adjacent (offset, length) pairs.
        self._free_offsets: list[int] = [0]
        self._free_lengths: list[int] = [capacity_bytes]
        self._bytes_in_use = 0

    @property
    def bytes_in_use(self) -> int:
        return self._bytes_in_use

    def reserve(self, num_bytes: int) -> StagingBuffer | None:
        """A buffer of at least `num_bytes`, or None if no free range is large enough."""
        size = max(_ALIGN, cdiv(num_bytes, _ALIGN) * _ALIGN)
        with self._lock:
            for i, length in enumerate(self._free_lengths):
                if length >= size:
                    offset = self._free_offsets[i]
                    if length == size:
                        del self._free_offsets[i], self._free_lengths[i]
                    else:
                        self._free_offsets[i] += size
                        self._free_lengths[i] -= size
                    self._bytes_in_use += size
                    return StagingBuffer(offset, size, self._arena[offset : offset + size])
        return None

    def release(self, buffer: StagingBuffer) -> None:
        with self._lock:
            self._bytes_in_use -= buffer.num_bytes
            assert self._bytes_in_use >= 0, "staging buffer released twice"
            i = bisect.bisect_left(self._free_offsets, buffer.offset)
            self._free_offsets.insert(i, buffer.offset)
            self._free_lengths.insert(i, buffer.num_bytes)
            # Coalesce with the next, then the previous range.
            if (
                i + 1 < len(self._free_offsets)
                and self._free_offsets[i] + self._free_lengths[i] == self._free_offsets[i + 1]
            ):
                self._free_lengths[i] += self._free_lengths.pop(i + 1)
                self._free_offsets.pop(i + 1)
            if i > 0 and self._free_offsets[i - 1] + self._free_lengths[i - 1] == self._free_offsets[i]:
                self._free_lengths[i - 1] += self._free_lengths.pop(i)
                self._free_offsets.pop(i)

    def fits(self, num_bytes: int) -> bool:
        """Whether a reservation of this size could ever succeed (it is within capacity)."""
        return num_bytes <= self.capacity_bytes
