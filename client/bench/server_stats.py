"""What the servers counted during a run, from their `Stats` before and after it: the KV the
decode workers received and the prompt tokens the workers' prefix caches found.

A proxy's `Stats` lists its workers (`workers[]`, each with its role); a worker's own `Stats`
is one source. Counters only grow, so a run's figures are `after.since(before)`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from kvservice.v1 import kvservice_pb2 as pb


def _sources(stats: pb.StatsResponse) -> list[pb.StatsResponse]:
    """A proxy's workers, or the one server that answered."""
    return [w.stats for w in stats.workers] if stats.workers else [stats]


@dataclass(frozen=True, slots=True)
class KVTransferTotals:
    """Decode-side (`kv_receiving`) counters; `has_receiver` is False for colocated servers."""

    has_receiver: bool
    num_transfers: int = 0
    num_failed_transfers: int = 0
    num_bytes: int = 0
    total_seconds: float = 0.0

    @classmethod
    def from_stats(cls, stats: pb.StatsResponse) -> KVTransferTotals:
        """A decode worker's own counters, or (for a proxy) the sum over its decode workers."""
        receivers = [s.kv_receiving for s in _sources(stats) if s.role == "decode"]
        return cls(
            has_receiver=bool(receivers),
            num_transfers=sum(r.num_transfers for r in receivers),
            num_failed_transfers=sum(r.num_failed_transfers for r in receivers),
            num_bytes=sum(r.num_bytes for r in receivers),
            total_seconds=sum((r.total_seconds for r in receivers), 0.0),
        )

    def since(self, before: KVTransferTotals) -> KVTransferTotals:
        return KVTransferTotals(
            has_receiver=self.has_receiver,
            num_transfers=self.num_transfers - before.num_transfers,
            num_failed_transfers=self.num_failed_transfers - before.num_failed_transfers,
            num_bytes=self.num_bytes - before.num_bytes,
            total_seconds=self.total_seconds - before.total_seconds,
        )

    def to_result_json(self) -> dict[str, Any]:
        """GB/s is bytes over summed transfer seconds; None where nothing was transferred.

        A pull's seconds run from its start to its last chunk, and pulls start while
        the prefill still computes: GB/s here is what the requests saw, not link speed.
        """
        has_time = self.num_transfers > 0 and self.total_seconds > 0
        return {
            "kv_transfer_bytes": self.num_bytes,
            "kv_transfer_count": self.num_transfers,
            "kv_transfer_failures": self.num_failed_transfers,
            "kv_transfer_seconds": self.total_seconds,
            "kv_transfer_gbps": self.num_bytes / self.total_seconds / 1e9 if has_time else None,
            "kv_transfer_mean_ms": self.total_seconds / self.num_transfers * 1000 if has_time else None,
            "kv_transfer_has_receiver": self.has_receiver,
        }


@dataclass(frozen=True, slots=True)
class PrefixCacheTotals:
    """Prompt tokens looked up in prefix caches (`queries`) and found there (`hits`)."""

    queries: int = 0
    hits: int = 0

    @classmethod
    def summed(cls, sources: Iterable[pb.StatsResponse]) -> PrefixCacheTotals:
        counters = [s.prefix_cache for s in sources]
        return cls(queries=sum(c.queries for c in counters), hits=sum(c.hits for c in counters))

    def since(self, before: PrefixCacheTotals) -> PrefixCacheTotals:
        return PrefixCacheTotals(queries=self.queries - before.queries, hits=self.hits - before.hits)

    @property
    def hit_rate(self) -> float | None:
        """hits / queries; None when nothing was looked up (caching off, or a server that does not count)."""
        return self.hits / self.queries if self.queries > 0 else None


@dataclass(frozen=True, slots=True)
class ServerCounters:
    """Everything a run reads from `Stats`: KV received by decode workers, and prefix-cache
    lookups of every worker and of the prefill workers alone (where the prompt is computed)."""

    kv_transfer: KVTransferTotals
    prefix_cache: PrefixCacheTotals
    prefill_prefix_cache: PrefixCacheTotals

    @classmethod
    def from_stats(cls, stats: pb.StatsResponse) -> ServerCounters:
        sources = _sources(stats)
        return cls(
            kv_transfer=KVTransferTotals.from_stats(stats),
            prefix_cache=PrefixCacheTotals.summed(sources),
            prefill_prefix_cache=PrefixCacheTotals.summed(s for s in sources if s.role == "prefill"),
        )

    def since(self, before: ServerCounters) -> ServerCounters:
        return ServerCounters(
            kv_transfer=self.kv_transfer.since(before.kv_transfer),
            prefix_cache=self.prefix_cache.since(before.prefix_cache),
            prefill_prefix_cache=self.prefill_prefix_cache.since(before.prefill_prefix_cache),
        )

    def to_result_json(self, num_completed: int) -> dict[str, Any]:
        """The KV transfer figures, the hit rates (tokens), and the KV bytes decode workers
        received per completed request (None when none completed)."""
        received = self.kv_transfer.num_bytes
        return {
            **self.kv_transfer.to_result_json(),
            "kv_bytes_received_per_request": received / num_completed if num_completed > 0 else None,
            "prefix_cache_queries": self.prefix_cache.queries,
            "prefix_cache_hits": self.prefix_cache.hits,
            "prefix_cache_hit_rate": self.prefix_cache.hit_rate,
            "prefill_prefix_cache_queries": self.prefill_prefix_cache.queries,
            "prefill_prefix_cache_hits": self.prefill_prefix_cache.hits,
            "prefill_prefix_cache_hit_rate": self.prefill_prefix_cache.hit_rate,
        }


def _percent(rate: float | None) -> str:
    return "n/a (no lookups counted)" if rate is None else f"{rate * 100:.1f}%"


def server_report_lines(extra: dict[str, Any]) -> list[tuple[str, object]]:
    """Rows for `format_report` from `ServerCounters.to_result_json` keys (or `kv_transfer_note`)."""
    if extra.get("kv_transfer_note"):
        return [("KV transfers:", extra["kv_transfer_note"])]
    lines: list[tuple[str, object]] = [
        ("Prefix cache hit rate (tokens):", _percent(extra["prefix_cache_hit_rate"])),
    ]
    if not extra.get("kv_transfer_has_receiver"):
        return [*lines, ("KV transfers:", "none (no decode worker)")]
    lines.append(("Prefill prefix cache hit rate:", _percent(extra["prefill_prefix_cache_hit_rate"])))
    lines.append(("KV transfers (failed):", f"{extra['kv_transfer_count']} ({extra['kv_transfer_failures']})"))
    lines.append(("KV bytes transferred (MiB):", extra["kv_transfer_bytes"] / (1 << 20)))
    per_request = extra["kv_bytes_received_per_request"]
    if per_request is not None:
        lines.append(("KV received per request (KiB):", per_request / 1024))
    if extra["kv_transfer_gbps"] is not None:
        lines.append(("KV transfer throughput (GB/s):", f"{extra['kv_transfer_gbps']:.3f}"))
        lines.append(("Mean KV transfer time (ms):", extra["kv_transfer_mean_ms"]))
    return lines
