"""`kvservice bench offload`'s summary (TTFT by turn, p99, the answers compared across runs, the
tiers' and peer pulls' counters) and its interleaved driver."""

from __future__ import annotations

import argparse
import asyncio
import time
from typing import Any, cast

import pytest

from kvservice.client.bench.metrics import RequestRecord
from kvservice.client.bench.offload import _p99, _summary, _workload, run_interleaved
from kvservice.client.bench.workload import SampledRequest
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


def test_peer_pulls_are_summed_over_the_workers() -> None:
    stats = pb.StatsResponse()
    for from_decode, from_prefill, failed in ((5, 0, 1), (0, 3, 0)):
        offload = pb.KVOffloadStats(
            num_peer_blocks_from_decode=from_decode,
            num_peer_blocks_from_prefill=from_prefill,
            num_peer_pulls_failed=failed,
        )
        stats.workers.add().stats.kv_offload.CopyFrom(offload)
    summary = _summary([_record(0, 0.1, [1])], 10.0, 0, stats)
    assert (summary["peer_blocks_from_decode"], summary["peer_blocks_from_prefill"]) == (5, 3)
    assert summary["peer_pulls_failed"] == 1


class _EchoBackend:
    """Answers every request with its prompt's length as the one output token; keeps what it was sent."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, list[int]]] = []
        self.in_flight = 0
        self.most_in_flight = 0

    async def send(self, request: SampledRequest, request_id: str, timeout: float | None) -> RequestRecord:
        assert request.prompt_token_ids is not None
        self.sent.append((request_id, list(request.prompt_token_ids)))
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        await asyncio.sleep(0)  # let the others start: the bound is what holds them back
        self.in_flight -= 1
        now = time.perf_counter()
        answer = [len(request.prompt_token_ids)]
        return RequestRecord(request_id, 0, now, 1, [now], now, True, output_token_ids=answer)


async def test_interleaved_turns_go_round_by_round_and_build_on_the_answers() -> None:
    args = argparse.Namespace(num_conversations=3, turns=3, input_len=4, output_len=1, first_input_len=10)
    workload = _workload(args)
    assert [len(c.turns[0].prompt_token_ids or []) for c in workload] == [10, 10, 10]
    backend = _EchoBackend()
    metrics, records = await run_interleaved(cast(Any, backend), workload, max_concurrency=2)
    assert metrics.completed == 9 and backend.most_in_flight == 2
    turns = [int(request_id.rsplit("turn", 1)[1]) for request_id, _ in backend.sent]
    assert turns == [0, 0, 0, 1, 1, 1, 2, 2, 2]  # every conversation's turn t before any turn t + 1
    for request_id, prompt in backend.sent:
        if request_id.endswith("turn1"):
            assert len(prompt) == 10 + 1 + 4  # the first message, its answer, the next message
            assert prompt[10] == 10  # the answer to the first message (its length, from the echo)
    assert sorted(r.turn for r in records) == [0, 0, 0, 1, 1, 1, 2, 2, 2]
