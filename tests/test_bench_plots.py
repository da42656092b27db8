"""Benchmark plots are written as real, non-trivial PNG files."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvservice.client.bench.metrics import (
    RequestRecord,
    compute_metrics,
    metrics_to_result_json,
)
from kvservice.client.bench.plots import write_compare_plot, write_plots

_PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _assert_png(path: Path) -> None:
    assert path.is_file()
    data = path.read_bytes()
    assert data[:8] == _PNG_MAGIC
    assert len(data) > 10_000  # axes, labels and data, not an empty canvas


def _records() -> list[RequestRecord]:
    records = []
    for i in range(20):
        start = 0.05 * i
        times = [start + 0.1 + 0.01 * i, start + 0.15 + 0.01 * i, start + 0.2 + 0.01 * i]
        records.append(
            RequestRecord(f"r{i}", prompt_len=32, start=start, output_len=3, token_times=times,
                          end=times[-1], success=i != 7, error="" if i != 7 else "x")
        )
    records.append(RequestRecord("single", prompt_len=8, start=0.5, output_len=1,
                                 token_times=[0.6], end=0.6, success=True))
    return records


def test_write_plots(tmp_path: Path) -> None:
    paths = write_plots(_records(), tmp_path / "plots")
    assert [p.name for p in paths] == ["latency_cdf.png", "request_timeline.png"]
    for path in paths:
        _assert_png(path)


def test_write_plots_with_no_successes(tmp_path: Path) -> None:
    failed = [RequestRecord("f", prompt_len=4, start=0.0, end=0.3, error="unavailable")]
    for path in write_plots(failed, tmp_path):
        _assert_png(path)
    for path in write_plots([], tmp_path / "empty"):
        assert path.read_bytes()[:8] == _PNG_MAGIC


def test_write_compare_plot(tmp_path: Path) -> None:
    records = _records()
    results = {
        name: metrics_to_result_json(compute_metrics(records, duration, None), records, {})
        for name, duration in (("colocated", 2.0), ("disaggregated", 1.5))
    }
    _assert_png(write_compare_plot(results, tmp_path))
    with pytest.raises(ValueError, match="deployment"):
        write_compare_plot({}, tmp_path)
