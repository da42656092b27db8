"""Benchmark plots: the figures hold the data they claim (read back through matplotlib's
objects), and they are written as PNG files."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kvservice.client.bench.metrics import RequestRecord, compute_metrics, metrics_to_result_json
from kvservice.client.bench.plots import (
    compare_figure,
    latency_cdf_figure,
    timeline_figure,
    write_compare_plot,
    write_plots,
)

_PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _records() -> list[RequestRecord]:
    records = []
    for i in range(20):
        start = 0.05 * i
        times = [start + 0.1 + 0.01 * i, start + 0.15 + 0.01 * i, start + 0.2 + 0.01 * i]
        records.append(
            RequestRecord(
                f"r{i}",
                prompt_len=32,
                start=start,
                output_len=3,
                token_times=times,
                end=times[-1],
                success=i != 7,
                error="" if i != 7 else "x",
            )
        )
    records.append(
        RequestRecord("single", prompt_len=8, start=0.5, output_len=1, token_times=[0.6], end=0.6, success=True)
    )
    return records


def test_latency_cdfs_plot_each_metric_of_the_successful_requests() -> None:
    records = _records()
    ok = [r for r in records if r.success]
    axes = {ax.get_title(): ax for ax in latency_cdf_figure(records).axes}
    assert set(axes) == {
        "TTFT (time to first token)",
        "TTST (time to second token)",
        "TPOT (time per output token)",
        "E2EL (end-to-end latency)",
    }
    for title, values in (
        ("TTFT (time to first token)", [r.ttft for r in ok]),
        ("TTST (time to second token)", [r.ttst for r in ok if r.ttst is not None]),
        ("E2EL (end-to-end latency)", [r.e2el for r in ok]),
    ):
        (line,) = axes[title].get_lines()
        xs, ys = line.get_data()
        np.testing.assert_allclose(xs, sorted(v * 1000 for v in values))  # milliseconds, sorted
        np.testing.assert_allclose(ys, np.arange(1, len(values) + 1) / len(values))  # a CDF ends at 1
    # The one-token request has no second token: 20 of 21 requests reach TTST, the failed one none.
    assert len(axes["TTST (time to second token)"].get_lines()[0].get_xdata()) == len(ok) - 1


def test_timeline_has_one_bar_per_request_red_when_failed() -> None:
    records = _records()
    (ax,) = timeline_figure(records).axes
    bars = ax.patches
    assert len(bars) == len(records)
    t0 = min(r.start for r in records)
    for bar, record in zip(bars, records):
        assert bar.get_x() == pytest.approx(record.start - t0)
        assert bar.get_width() == pytest.approx(record.end - record.start)
    red = [i for i, bar in enumerate(bars) if bar.get_facecolor()[0] > 0.8 and bar.get_facecolor()[2] < 0.3]
    assert red == [7]  # the failed request


def test_compare_figure_bars_are_the_result_values() -> None:
    records = _records()
    results = {
        name: metrics_to_result_json(compute_metrics(records, duration, None), records, {})
        for name, duration in (("colocated", 2.0), ("disaggregated", 1.5))
    }
    axes = {ax.get_title(): ax for ax in compare_figure(results).axes}
    throughput = [bar.get_height() for bar in axes["Output throughput (tok/s)"].patches]
    assert throughput == pytest.approx(
        [results["colocated"]["output_throughput"], results["disaggregated"]["output_throughput"]]
    )
    ttft = [bar.get_height() for bar in axes["TTFT (ms)"].patches]  # mean bars, then p99 bars
    assert ttft == pytest.approx(
        [results[n][f"{stat}_ttft_ms"] for stat in ("mean", "p99") for n in ("colocated", "disaggregated")]
    )
    with pytest.raises(ValueError, match="deployment"):
        compare_figure({})


def test_files_are_written_as_png(tmp_path: Path) -> None:
    paths = write_plots(_records(), tmp_path / "plots")
    assert [p.name for p in paths] == ["latency_cdf.png", "request_timeline.png"]
    paths.append(write_compare_plot({"one": {}}, tmp_path))
    for path in paths:
        assert path.read_bytes()[:8] == _PNG_MAGIC
    # No successful request at all still draws (the panels say "no samples").
    failed = [RequestRecord("f", prompt_len=4, start=0.0, end=0.3, error="unavailable")]
    assert all(p.read_bytes()[:8] == _PNG_MAGIC for p in write_plots(failed, tmp_path / "failed"))
