"""Benchmark metrics against hand-computed values from synthetic timings."""

from __future__ import annotations

import json

import pytest

from kvservice.client.bench.metrics import (
    BenchmarkMetrics,
    RequestRecord,
    compute_metrics,
    format_report,
    metrics_to_result_json,
)


def _records() -> list[RequestRecord]:
    return [
        # a: 3 tokens, one per chunk.
        RequestRecord("a", prompt_len=10, start=0.0, output_len=3, token_times=[0.1, 0.3, 0.6], end=0.6, success=True),
        # b: 4 tokens, the first two in one chunk (shared time).
        RequestRecord(
            "b", prompt_len=20, start=1.0, output_len=4, token_times=[1.2, 1.2, 1.5, 1.6], end=1.7, success=True
        ),
        # c: a single token.
        RequestRecord("c", prompt_len=5, start=2.0, output_len=1, token_times=[2.4], end=2.4, success=True),
        # d: failed after one token; must not count anywhere but `failed`.
        RequestRecord(
            "d", prompt_len=7, start=3.0, output_len=1, token_times=[3.01], end=3.6, success=False, error="boom"
        ),
    ]


def test_record_properties() -> None:
    a, b, c, _ = _records()
    assert a.ttft == pytest.approx(0.1)
    assert a.ttst == pytest.approx(0.3)
    assert a.e2el == pytest.approx(0.6)
    assert a.tpot == pytest.approx(0.25)  # (0.6 - 0.1) / (3 - 1)
    assert a.itls == pytest.approx([0.2, 0.3])
    assert b.ttst == pytest.approx(0.2)  # second token arrived with the first
    assert b.tpot == pytest.approx(0.4 / 3)  # (1.6 - 1.2) / (4 - 1)
    assert b.itls == pytest.approx([0.0, 0.3, 0.1])
    assert c.ttst is None and c.tpot is None and c.itls == []
    empty = RequestRecord("e", prompt_len=3, start=5.0)
    assert empty.ttft is None and empty.ttst is None and empty.tpot is None


def test_counts_and_throughputs() -> None:
    m = compute_metrics(_records(), duration_s=4.0, goodput_slos=None)
    assert (m.completed, m.failed) == (3, 1)
    assert m.total_input_tokens == 35  # 10 + 20 + 5; d failed
    assert m.total_output_tokens == 8  # 3 + 4 + 1
    assert m.request_throughput == pytest.approx(0.75)  # 3 / 4
    assert m.output_throughput == pytest.approx(2.0)  # 8 / 4
    assert m.total_token_throughput == pytest.approx(10.75)  # 43 / 4
    assert m.request_goodput is None


def test_latency_statistics() -> None:
    m = compute_metrics(_records(), duration_s=4.0, goodput_slos=None)
    # TTFT ms [100, 200, 400]: mean 233.33; std sqrt((133.3^2+33.3^2+166.7^2)/3)=124.72;
    # p90 at rank 1.8 -> 200 + 0.8*200 = 360; p99 at rank 1.98 -> 396.
    assert m.ttft.mean_ms == pytest.approx(233.3333, abs=1e-3)
    assert m.ttft.median_ms == pytest.approx(200.0)
    assert m.ttft.std_ms == pytest.approx(124.7219, abs=1e-3)
    assert m.ttft.p90_ms == pytest.approx(360.0)
    assert m.ttft.p99_ms == pytest.approx(396.0)
    # TTST ms [300, 200] (c has one token): mean 250, std 50, p90 200+0.9*100, p99 200+0.99*100.
    assert (m.ttst.mean_ms, m.ttst.median_ms, m.ttst.std_ms) == pytest.approx((250.0, 250.0, 50.0))
    assert (m.ttst.p90_ms, m.ttst.p99_ms) == pytest.approx((290.0, 299.0))
    # TPOT ms [250, 133.33]: mean 191.67, std 58.33, p90 133.33+0.9*116.67, p99 +0.99*116.67.
    assert m.tpot.mean_ms == pytest.approx(191.6667, abs=1e-3)
    assert m.tpot.median_ms == pytest.approx(191.6667, abs=1e-3)
    assert m.tpot.std_ms == pytest.approx(58.3333, abs=1e-3)
    assert m.tpot.p90_ms == pytest.approx(238.3333, abs=1e-3)
    assert m.tpot.p99_ms == pytest.approx(248.8333, abs=1e-3)
    # ITL pooled ms [200, 300, 0, 300, 100]: mean 180; variance (180²+80²+20²+120²+120²)/5
    # = 13600 -> std 116.62; sorted [0,100,200,300,300]: p90 rank 3.6 -> 300.
    assert m.itl.mean_ms == pytest.approx(180.0)
    assert m.itl.median_ms == pytest.approx(200.0)
    assert m.itl.std_ms == pytest.approx(116.6190, abs=1e-3)
    assert (m.itl.p90_ms, m.itl.p99_ms) == pytest.approx((300.0, 300.0))
    # E2EL ms [600, 700, 400]: mean 566.67, std 124.72, p90 600+0.8*100, p99 600+0.98*100.
    assert m.e2el.mean_ms == pytest.approx(566.6667, abs=1e-3)
    assert m.e2el.median_ms == pytest.approx(600.0)
    assert m.e2el.std_ms == pytest.approx(124.7219, abs=1e-3)
    assert (m.e2el.p90_ms, m.e2el.p99_ms) == pytest.approx((680.0, 698.0))


@pytest.mark.parametrize(
    ("slos", "good"),
    [
        ({"ttft": 250.0, "tpot": 200.0}, 1),  # a: tpot 250 > 200; c: ttft 400 > 250; b meets both
        ({"tpot": 200.0}, 2),  # b, and c whose single token counts as tpot 0 (vLLM)
        ({"ttst": 250.0}, 2),  # b (200), and c with no second token to be late
        ({"e2el": 600.0}, 2),  # a (600, limit inclusive) and c (400); d failed never counts
        ({"ttft": 1.0}, 0),
    ],
)
def test_goodput(slos: dict[str, float], good: int) -> None:
    m = compute_metrics(_records(), duration_s=4.0, goodput_slos=slos)
    assert m.request_goodput == pytest.approx(good / 4.0)


def test_goodput_rejects_unknown_metric_and_negative_limit() -> None:
    with pytest.raises(ValueError, match="latency"):
        compute_metrics(_records(), 4.0, {"latency": 1.0})
    with pytest.raises(ValueError, match="ttft"):
        compute_metrics(_records(), 4.0, {"ttft": -1.0})
    with pytest.raises(ValueError, match="duration_s"):
        compute_metrics(_records(), 0.0, None)


@pytest.mark.parametrize("records", [[], [_records()[3]]], ids=["no-records", "all-failed"])
def test_empty_sets_give_zero(records: list[RequestRecord]) -> None:
    m = compute_metrics(records, duration_s=2.0, goodput_slos={"ttft": 100.0})
    assert m.completed == 0 and m.failed == len(records)
    assert m.request_throughput == 0.0 and m.output_throughput == 0.0
    assert m.request_goodput == 0.0
    for stats in (m.ttft, m.ttst, m.tpot, m.itl, m.e2el):
        summary = (stats.mean_ms, stats.median_ms, stats.std_ms, stats.p90_ms, stats.p99_ms)
        assert summary == (0.0, 0.0, 0.0, 0.0, 0.0)


def _metrics(slos: dict[str, float] | None = None) -> BenchmarkMetrics:
    return compute_metrics(_records(), duration_s=4.0, goodput_slos=slos)


def test_result_json_has_vllm_keys_and_is_serialisable() -> None:
    records = _records()
    result = metrics_to_result_json(_metrics({"tpot": 200.0}), records, {"kv_transfer_gbps": 1.5})
    json.dumps(result)  # must be plain JSON (no numpy scalars)
    assert result["completed"] == 3 and result["failed"] == 1 and result["duration"] == 4.0
    assert result["request_goodput"] == pytest.approx(0.5)
    for name in ("ttft", "tpot", "itl", "e2el", "ttst"):
        for stat in ("mean", "median", "std", "p90", "p99"):
            assert isinstance(result[f"{stat}_{name}_ms"], float)
    assert result["p90_ttft_ms"] == pytest.approx(360.0)
    assert result["input_lens"] == [10, 20, 5, 7]
    assert result["output_lens"] == [3, 4, 1, 0]  # failed -> 0, as vLLM
    assert result["ttfts"] == pytest.approx([0.1, 0.2, 0.4, 0.01])
    assert result["ttsts"][0] == pytest.approx(0.3) and result["ttsts"][2] is None
    assert result["itls"][1] == pytest.approx([0.0, 0.3, 0.1])
    assert result["errors"] == ["", "", "", "boom"]
    assert result["kv_transfer_gbps"] == 1.5


def test_report_layout() -> None:
    # {"ttft": 250}: a (100 ms) and b (200 ms) meet it, c (400 ms) does not -> 2 / 4 s.
    text = format_report(_metrics({"ttft": 250.0}), [("KV transfer (GB/s):", "1.50")])
    lines = [line.rstrip() for line in text.splitlines()]
    assert lines[0] == "============ Serving Benchmark Result ============"
    assert lines[-1] == "=" * 50
    for expected in (
        "Successful requests:                     3",
        "Failed requests:                         1",
        "Request goodput (req/s):                 0.50",
        "KV transfer (GB/s):                      1.50",
        "---------------Time to First Token----------------",
        "Mean TTFT (ms):                          233.33",
        "P90 TTFT (ms):                           360.00",
        "---------------Time to Second Token---------------",
        "Mean TTST (ms):                          250.00",
        "-----Time per Output Token (excl. 1st token)------",
        "P99 ITL (ms):                            300.00",
        "Mean E2EL (ms):                          566.67",
    ):
        assert expected in lines
    assert "goodput" not in format_report(_metrics(), [])


def test_multi_turn_ttft_splits_first_turns_from_later_ones() -> None:
    def turn(turn: int, ttft: float, success: bool = True) -> RequestRecord:
        return RequestRecord(
            f"r{turn}-{ttft}",
            prompt_len=4,
            start=0.0,
            output_len=1,
            token_times=[ttft],
            end=ttft,
            success=success,
            turn=turn,
        )

    records = [turn(0, 0.4), turn(1, 0.1), turn(0, 0.6), turn(1, 0.2), turn(2, 0.3), turn(2, 9.0, success=False)]
    metrics = compute_metrics(records, duration_s=1.0)
    result = metrics_to_result_json(metrics, records, {})
    assert result["mean_ttft_first_turn_ms"] == pytest.approx(500.0)
    assert result["p99_ttft_first_turn_ms"] == pytest.approx(598.0)  # linear interpolation of 400, 600
    assert result["mean_ttft_later_turns_ms"] == pytest.approx(200.0)  # the failed turn does not count
    assert result["p99_ttft_later_turns_ms"] == pytest.approx(298.0)
    report = format_report(metrics)
    assert "Mean TTFT, first turns (ms):" in report and "P99 TTFT, later turns (ms):" in report

    single_turn = compute_metrics(_records(), duration_s=1.0)
    assert single_turn.ttft_first_turn is None and single_turn.ttft_later_turns is None
    assert "mean_ttft_first_turn_ms" not in metrics_to_result_json(single_turn, _records(), {})
    assert "first turns" not in format_report(single_turn)
