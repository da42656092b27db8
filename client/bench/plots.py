"""PNG charts of a benchmark run: latency CDFs, a per-request timeline, and comparisons.

Figures are built with `matplotlib.figure.Figure` and rendered by the Agg canvas, so
no pyplot global state and no display are involved: safe in servers and tests.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from kvservice.client.bench.metrics import RequestRecord

_MS_PER_S = 1000.0
_DPI = 100


def _save(fig: Figure, path: Path) -> Path:
    FigureCanvasAgg(fig)
    fig.savefig(path, format="png", dpi=_DPI)
    return path


def _plot_cdf(ax: Axes, title: str, values_s: Sequence[float]) -> None:
    ax.set_title(title)
    ax.set_xlabel("ms")
    ax.set_ylabel("fraction of requests")
    ax.grid(True, alpha=0.3)
    ax.ticklabel_format(axis="x", useOffset=False)
    if not values_s:
        ax.text(0.5, 0.5, "no samples", ha="center", va="center", transform=ax.transAxes)
        return
    ms = np.sort(np.asarray(values_s, dtype=np.float64) * _MS_PER_S)
    fraction = np.arange(1, len(ms) + 1) / len(ms)
    ax.step(ms, fraction, where="post")
    ax.set_ylim(0.0, 1.02)


def latency_cdf_figure(records: Sequence[RequestRecord]) -> Figure:
    """Four CDF panels (TTFT, TTST, TPOT, E2EL) over the successful requests."""
    ok = [r for r in records if r.success]
    fig = Figure(figsize=(10, 7), layout="constrained")
    axes = fig.subplots(2, 2)
    series = (
        ("TTFT (time to first token)", [r.ttft for r in ok]),
        ("TTST (time to second token)", [r.ttst for r in ok]),
        ("TPOT (time per output token)", [r.tpot for r in ok]),
        ("E2EL (end-to-end latency)", [r.e2el for r in ok]),
    )
    for ax, (title, values) in zip(axes.flat, series):
        _plot_cdf(ax, title, [v for v in values if v is not None])
    fig.suptitle(f"Latency CDFs ({len(ok)} successful requests)")
    return fig


def timeline_figure(records: Sequence[RequestRecord]) -> Figure:
    """One bar per request (send..end) with its first and second token marked."""
    height = min(40.0, 2.0 + 0.12 * len(records))
    fig = Figure(figsize=(10, height), layout="constrained")
    ax = fig.subplots()
    t0 = min((r.start for r in records), default=0.0)
    rows = np.arange(len(records))
    # One call per artist kind: thousands of requests stay fast to draw.
    ax.barh(
        rows,
        [r.end - r.start for r in records],
        left=[r.start - t0 for r in records],
        height=0.6,
        color=["tab:blue" if r.success else "tab:red" for r in records],
        alpha=0.5,
    )
    for index, marker, color, size in ((0, "|", "black", 64), (1, "x", "tab:green", 25)):
        hits = [(row, r.token_times[index] - t0) for row, r in enumerate(records) if len(r.token_times) > index]
        if hits:
            ys, xs = zip(*hits)
            ax.scatter(xs, ys, marker=marker, color=color, s=size, zorder=3)
    ax.set_xlabel("seconds since the first request was sent")
    ax.set_ylabel("request (send order)")
    ax.set_title("Request timeline: bar = send..end, | = first token, x = second token, red = failed")
    ax.invert_yaxis()
    ax.grid(True, axis="x", alpha=0.3)
    return fig


def write_plots(records: Sequence[RequestRecord], out_dir: str | Path) -> list[Path]:
    """Write `latency_cdf.png` and `request_timeline.png` into `out_dir`; return their paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    return [
        _save(latency_cdf_figure(records), out / "latency_cdf.png"),
        _save(timeline_figure(records), out / "request_timeline.png"),
    ]


# (result-json key prefix, panel title); mean and p99 bars are drawn for each.
_COMPARE_LATENCIES = (("ttft", "TTFT (ms)"), ("ttst", "TTST (ms)"), ("tpot", "TPOT (ms)"))


def _grouped_bars(ax: Axes, names: list[str], groups: dict[str, list[float]], title: str) -> None:
    x = np.arange(len(names))
    width = 0.8 / len(groups)
    for i, (label, values) in enumerate(groups.items()):
        bars = ax.bar(x + (i - (len(groups) - 1) / 2) * width, values, width, label=label)
        ax.bar_label(bars, fmt="%.1f", fontsize=7)
    ax.set_xticks(x, names)
    ax.set_title(title)
    ax.legend(fontsize=8)
    ax.grid(True, axis="y", alpha=0.3)


def write_compare_plot(results: dict[str, dict[str, Any]], out_dir: str | Path) -> Path:
    """`compare_figure(results)` as `compare.png` in `out_dir`."""
    figure = compare_figure(results)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    return _save(figure, out / "compare.png")


def compare_figure(results: dict[str, dict[str, Any]]) -> Figure:
    """Bar charts of mean/p99 TTFT, TTST, TPOT and throughput per named deployment.

    `results` maps a deployment name (e.g. "colocated", "disaggregated") to its
    result JSON (`metrics_to_result_json`); missing keys are drawn as 0.
    """
    if not results:
        raise ValueError("results must name at least one deployment")
    names = list(results)
    fig = Figure(figsize=(14, 4), layout="constrained")
    axes = fig.subplots(1, len(_COMPARE_LATENCIES) + 1)
    for ax, (key, title) in zip(axes, _COMPARE_LATENCIES):
        groups = {stat: [float(results[n].get(f"{stat}_{key}_ms") or 0.0) for n in names] for stat in ("mean", "p99")}
        _grouped_bars(ax, names, groups, title)
    throughput = {"output tok/s": [float(results[n].get("output_throughput") or 0.0) for n in names]}
    _grouped_bars(axes[-1], names, throughput, "Output throughput (tok/s)")
    fig.suptitle(" vs ".join(names))
    return fig
