"""Counters of one direction of KV traffic (sending on prefill workers, receiving on decode
workers): plain numbers, each updated from one event loop only."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from kvservice.v1 import kvservice_pb2 as pb


@dataclass(slots=True)
class TransferStats:
    num_transfers: int = 0
    num_failed_transfers: int = 0
    num_chunks: int = 0
    num_bytes: int = 0
    total_seconds: float = 0.0  # summed over transfers

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_proto(self, into: pb.KVTransferStats) -> None:
        into.num_transfers = self.num_transfers
        into.num_failed_transfers = self.num_failed_transfers
        into.num_chunks = self.num_chunks
        into.num_bytes = self.num_bytes
        into.total_seconds = self.total_seconds
