"""Counters of one direction of KV traffic (sending on prefill workers, receiving on decode
workers): plain numbers, each updated from one event loop only."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from kvservice.outputs import KVTransferCounters


@dataclass(slots=True)
class TransferStats:
    num_transfers: int = 0
    num_failed_transfers: int = 0
    num_chunks: int = 0
    num_bytes: int = 0
    total_seconds: float = 0.0  # summed over transfers

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def snapshot(self) -> KVTransferCounters:
        return KVTransferCounters(self.num_transfers, self.num_failed_transfers, self.num_chunks, self.num_bytes, self.total_seconds)
