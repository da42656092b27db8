"""`bench serve` against a real 1P1D pair, and `bench compare`'s table and core plan."""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path

import pytest
from conftest import local_cluster

from kvservice.client.bench import serve as bench_serve
from kvservice.client.bench.compare import format_compare_table, plan_cores
from kvservice.client.bench.metrics import KVTransferTotals, kv_transfer_report_lines
from kvservice.v1 import kvservice_pb2 as pb

_PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
_LATENCIES = ("ttft", "tpot", "itl", "e2el", "ttst")


def _serve_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench_serve.add_arguments(parser)
    return parser.parse_args(list(argv))


@pytest.mark.slow
async def test_bench_serve_on_a_prefill_decode_pair(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    result_file, plot_dir = tmp_path / "result.json", tmp_path / "plots"
    async with local_cluster("tiny", num_prefill=1, num_decode=1) as cluster:
        args = _serve_args(
            "--target", cluster.address, "--num-prompts", "8", "--input-len", "40", "--output-len", "8",
            "--request-rate", "20", "--goodput", "e2el:60000", "--disable-tqdm",
            "--save-result", str(result_file), "--plot", str(plot_dir),
        )
        # main() owns its event loop (asyncio.run), so it runs in a thread here.
        assert await asyncio.to_thread(bench_serve.main, args) == 0

    result = json.loads(result_file.read_text())
    for key in ("completed", "failed", "duration", "request_throughput", "request_goodput",
                "output_throughput", "total_token_throughput", "total_input_tokens", "total_output_tokens"):
        assert key in result, key
    for name in _LATENCIES:
        for stat in ("mean", "median", "std", "p90", "p99"):
            assert f"{stat}_{name}_ms" in result, f"{stat}_{name}_ms"

    assert result["completed"] == 8 and result["failed"] == 0
    assert result["errors"] == [""] * 8
    assert result["total_input_tokens"] == 8 * 40 and result["total_output_tokens"] == 8 * 8
    assert result["request_goodput"] == pytest.approx(result["request_throughput"])
    for name in ("ttft", "e2el"):
        assert result[f"p99_{name}_ms"] >= result[f"median_{name}_ms"] > 0
    assert 0 < result["mean_ttft_ms"] < result["mean_ttst_ms"] < result["mean_e2el_ms"]
    assert [len(r["token_times"]) for r in result["requests"]] == [8] * 8

    assert result["kv_transfer_has_receiver"] is True
    assert result["kv_transfer_count"] == 8 and result["kv_transfer_failures"] == 0
    assert result["kv_transfer_bytes"] > 0
    assert result["kv_transfer_gbps"] > 0 and result["kv_transfer_mean_ms"] > 0

    report = capsys.readouterr().out
    assert "Serving Benchmark Result" in report
    assert "KV transfers (failed):                   8 (0)" in report
    for name in ("latency_cdf.png", "request_timeline.png"):
        assert (plot_dir / name).read_bytes()[:8] == _PNG_MAGIC


def test_kv_transfer_totals_sum_the_proxys_decode_workers() -> None:
    def worker(role: str, num_transfers: int, num_bytes: int, seconds: float) -> pb.WorkerStats:
        received = pb.KVTransferStats(num_transfers=num_transfers, num_bytes=num_bytes, total_seconds=seconds)
        return pb.WorkerStats(address=role, stats=pb.StatsResponse(role=role, kv_receiving=received))

    # The proxy's own aggregate is ignored: the workers are the source of truth.
    proxy = pb.StatsResponse(role="proxy", kv_receiving=pb.KVTransferStats(num_bytes=1),
                             workers=[worker("prefill", 0, 0, 0.0), worker("decode", 3, 3_000_000, 0.5), worker("decode", 1, 1_000_000, 0.5)])
    totals = KVTransferTotals.from_stats(proxy)
    assert totals == KVTransferTotals(True, num_transfers=4, num_bytes=4_000_000, total_seconds=1.0)
    figures = totals.since(KVTransferTotals(True, 1, 0, 1_000_000, 0.25)).to_result_json()
    assert figures["kv_transfer_count"] == 3 and figures["kv_transfer_bytes"] == 3_000_000
    assert figures["kv_transfer_gbps"] == pytest.approx(3_000_000 / 0.75 / 1e9)
    assert figures["kv_transfer_mean_ms"] == pytest.approx(250.0)

    colocated = KVTransferTotals.from_stats(pb.StatsResponse(role="both")).to_result_json()
    assert colocated["kv_transfer_has_receiver"] is False and colocated["kv_transfer_bytes"] == 0
    assert colocated["kv_transfer_gbps"] is None and colocated["kv_transfer_mean_ms"] is None
    assert kv_transfer_report_lines(colocated) == [("KV transfers:", "none (no decode worker)")]


@pytest.mark.parametrize("value", ["ttft", "latency:5", "ttft:fast", "tpot:-1", "e2el:inf"])
def test_goodput_flag_rejects_bad_slos(value: str) -> None:
    with pytest.raises(SystemExit):
        _serve_args("--target", "x:1", "--goodput", value)


def _result(ttft: float, tpot: float, throughput: float, gbps: float | None) -> dict[str, object]:
    result: dict[str, object] = {"completed": 32, "failed": 0, "request_throughput": throughput,
                                 "output_throughput": throughput * 64, "kv_transfer_gbps": gbps,
                                 "kv_transfer_mean_ms": None if gbps is None else 12.5}
    for name, mean in (("ttft", ttft), ("ttst", ttft + tpot), ("tpot", tpot), ("itl", tpot), ("e2el", ttft + 63 * tpot)):
        result[f"mean_{name}_ms"], result[f"p99_{name}_ms"] = mean, 2 * mean
    result["p99_itl_ms"] = 0.0  # a zero baseline has no ratio
    return result


def test_compare_table_puts_deployments_side_by_side_with_ratios() -> None:
    table = format_compare_table({"colocated": _result(100.0, 20.0, 4.0, None), "disaggregated": _result(110.0, 8.0, 3.8, 1.25)})
    lines = table.splitlines()
    assert lines[1].split() == ["Metric", "colocated", "disaggregated", "disagg/coloc"]
    rows = {line[:28].strip(): line[28:].split() for line in lines[3:-1]}
    assert rows["Mean TTFT (ms)"] == ["100.00", "110.00", "1.10x"]
    assert rows["P99 TPOT (ms)"] == ["40.00", "16.00", "0.40x"]
    assert rows["Mean TTST (ms)"] == ["120.00", "118.00", "0.98x"]
    assert rows["Request throughput (req/s)"] == ["4.00", "3.80", "0.95x"]
    assert rows["P99 ITL (ms)"] == ["0.00", "0.00", "n/a"]
    assert rows["Successful / failed requests"] == ["32", "/", "0", "32", "/", "0"]
    assert rows["KV transfer (GB/s, mean ms)"] == ["none", "1.250,", "12.5"]
    assert len({len(line) for line in lines[1:-1]}) <= 2  # aligned columns (rules may differ)


def test_plan_cores_pins_prefill_and_decode_apart_and_falls_back_on_one_core() -> None:
    plan = plan_cores({3, 1, 2})
    assert (plan.colocated, plan.prefill, plan.decode, plan.note) == ((1, 2), (1,), (2,), "")
    single = plan_cores({5})
    assert single.colocated == single.prefill == single.decode == (5,)
    assert "only core 5" in single.note
