"""The servers' counters a benchmark reads from `Stats`: KV received by decode workers and
prefix-cache lookups, summed over a proxy's workers and taken as after-minus-before deltas."""

from __future__ import annotations

import pytest

from kvservice.client.bench.server_stats import KVTransferTotals, ServerCounters, server_report_lines
from kvservice.v1 import kvservice_pb2 as pb


def _worker(
    role: str, *, queries: int = 0, hits: int = 0, num_transfers: int = 0, num_bytes: int = 0, seconds: float = 0.0
) -> pb.WorkerStats:
    stats = pb.StatsResponse(
        role=role,
        prefix_cache=pb.PrefixCacheStats(queries=queries, hits=hits),
        kv_receiving=pb.KVTransferStats(num_transfers=num_transfers, num_bytes=num_bytes, total_seconds=seconds),
    )
    return pb.WorkerStats(address=role, stats=stats)


def _proxy(*workers: pb.WorkerStats) -> pb.StatsResponse:
    # The proxy's own aggregate is ignored: its workers are the source of truth.
    return pb.StatsResponse(
        role="proxy",
        prefix_cache=pb.PrefixCacheStats(queries=1, hits=1),
        kv_receiving=pb.KVTransferStats(num_bytes=1),
        workers=list(workers),
    )


def test_kv_transfer_totals_sum_the_proxys_decode_workers() -> None:
    proxy = _proxy(
        _worker("prefill"),
        _worker("decode", num_transfers=3, num_bytes=3_000_000, seconds=0.5),
        _worker("decode", num_transfers=1, num_bytes=1_000_000, seconds=0.5),
    )
    totals = KVTransferTotals.from_stats(proxy)
    assert totals == KVTransferTotals(True, num_transfers=4, num_bytes=4_000_000, total_seconds=1.0)
    figures = totals.since(KVTransferTotals(True, 1, 0, 1_000_000, 0.25)).to_result_json()
    assert figures["kv_transfer_count"] == 3 and figures["kv_transfer_bytes"] == 3_000_000
    assert figures["kv_transfer_gbps"] == pytest.approx(3_000_000 / 0.75 / 1e9)
    assert figures["kv_transfer_mean_ms"] == pytest.approx(250.0)


def test_run_deltas_give_hit_rates_of_all_workers_and_of_prefill_alone() -> None:
    before = ServerCounters.from_stats(
        _proxy(
            _worker("prefill", queries=1_000, hits=100),
            _worker("decode", queries=500, hits=0, num_transfers=2, num_bytes=2048),
            _worker("decode", queries=0, hits=0),
        )
    )
    after = ServerCounters.from_stats(
        _proxy(
            # The run: prefill looked up 3,000 tokens and found 1,500; the decode workers 1,000 / 500 and 1,000 / 0.
            _worker("prefill", queries=4_000, hits=1_600),
            _worker("decode", queries=1_500, hits=500, num_transfers=6, num_bytes=10_240),
            _worker("decode", queries=1_000, hits=0, num_transfers=4, num_bytes=4096),
        )
    )
    figures = after.since(before).to_result_json(num_completed=8)
    assert (figures["prefix_cache_queries"], figures["prefix_cache_hits"]) == (5_000, 2_000)
    assert figures["prefix_cache_hit_rate"] == pytest.approx(0.4)
    assert (figures["prefill_prefix_cache_queries"], figures["prefill_prefix_cache_hits"]) == (3_000, 1_500)
    assert figures["prefill_prefix_cache_hit_rate"] == pytest.approx(0.5)
    assert figures["kv_transfer_bytes"] == 12_288 and figures["kv_transfer_count"] == 8
    assert figures["kv_bytes_received_per_request"] == pytest.approx(12_288 / 8)

    lines = dict(server_report_lines(figures))
    assert lines["Prefix cache hit rate (tokens):"] == "40.0%"
    assert lines["Prefill prefix cache hit rate:"] == "50.0%"
    assert lines["KV received per request (KiB):"] == pytest.approx(1.5)


def test_no_lookups_is_no_hit_rate_rather_than_zero() -> None:
    # Workers without prefix caching (or that do not count yet) report zeros: a rate would be a lie.
    idle = ServerCounters.from_stats(_proxy(_worker("prefill"), _worker("decode")))
    figures = idle.since(idle).to_result_json(num_completed=0)
    assert figures["prefix_cache_hit_rate"] is None and figures["prefill_prefix_cache_hit_rate"] is None
    assert figures["kv_bytes_received_per_request"] is None
    assert dict(server_report_lines(figures))["Prefix cache hit rate (tokens):"] == "n/a (no lookups counted)"


def test_a_colocated_worker_is_its_own_source() -> None:
    colocated = pb.StatsResponse(role="both", prefix_cache=pb.PrefixCacheStats(queries=200, hits=50))
    figures = ServerCounters.from_stats(colocated).to_result_json(num_completed=2)
    assert figures["prefix_cache_hit_rate"] == pytest.approx(0.25)
    assert figures["prefill_prefix_cache_hit_rate"] is None  # no prefill worker
    assert figures["kv_transfer_has_receiver"] is False and figures["kv_transfer_bytes"] == 0
    assert figures["kv_transfer_gbps"] is None and figures["kv_transfer_mean_ms"] is None
    assert server_report_lines(figures) == [
        ("Prefix cache hit rate (tokens):", "25.0%"),
        ("KV transfers:", "none (no decode worker)"),
    ]
