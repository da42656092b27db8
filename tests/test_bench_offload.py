"""`kvservice bench offload`'s summary: TTFT by turn, p99, and the answers compared across runs."""

from __future__ import annotations

import pytest

from kvservice.client.bench.metrics import RequestRecord
from kvservice.client.bench.offload import _p99, _summary
from kvservice.v1 import kvservice_pb2 as pb


def _record(turn: int, ttft_s: float, tokens: list[int]) -> RequestRecord:
    return RequestRecord("r", 8, start=1.0, token_times=[1.0 + ttft_s], turn=turn, output_token_ids=tokens)


def test_the_summary_groups_ttft_by_turn_and_keeps_the_answers() -> None:
    stats = pb.StatsResponse(
        kv_offload=pb.KVOffloadStats(num_hit_blocks=4, num_blocks_written=6, num_bytes_read=100),
        prefix_cache=pb.PrefixCacheStats(hits=1, queries=4),
    )
    records = [_record(0, 0.1, [1]), _record(0, 0.3, [2]), _record(1, 0.05, [3])]
    summary = _summary(records, 50.0, 0, stats)
    assert summary["mean_ttft_ms"] == {0: pytest.approx(200.0), 1: pytest.approx(50.0)}
    assert summary["p99_ttft_ms"][0] == pytest.approx(300.0)
    assert summary["tier_hit_blocks"] == 4 and summary["prefix_cache_hit_rate"] == 0.25
    assert summary["tokens"] == [(1,), (2,), (3,)]


def test_p99_of_a_hundred_values_is_the_99th() -> None:
    assert _p99([float(v) for v in range(100, 0, -1)]) == 100.0
    assert _p99([float(v) for v in range(1, 201)]) == 199.0


def test_behind_a_proxy_the_summary_adds_up_its_workers_tiers() -> None:
    stats = pb.StatsResponse(prefix_cache=pb.PrefixCacheStats(hits=2, queries=4))
    for hits, written, read in ((1, 2, 30), (4, 0, 70)):
        offload = pb.KVOffloadStats(num_hit_blocks=hits, num_blocks_written=written, num_bytes_read=read)
        stats.workers.add().stats.kv_offload.CopyFrom(offload)
    summary = _summary([_record(0, 0.1, [1])], 10.0, 0, stats)
    assert (summary["tier_hit_blocks"], summary["tier_blocks_written"], summary["tier_bytes_read"]) == (5, 2, 100)
