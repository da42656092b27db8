"""Per-request timings of a serving benchmark and the metrics computed from them.

The semantics follow vLLM's `bench serve` so figures are comparable across tools:
latencies are reported in milliseconds, only successful requests contribute to
latency statistics and token counts, percentiles use numpy's linear interpolation,
and an empty set of samples reports 0 rather than NaN. On top of vLLM's metrics we
report TTST (time to second token): in a disaggregated deployment the first token
comes from the prefill worker and the second from the decode worker, so TTST is the
figure that shows whether the KV transfer hid behind prefill.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

_MS_PER_S = 1000.0
GOODPUT_METRICS = ("ttft", "ttst", "tpot", "e2el")


@dataclass(slots=True)
class RequestRecord:
    """What the client observed for one request; times are `perf_counter` seconds.

    `token_times` holds one arrival time per generated token: tokens that arrive in
    one streamed chunk share that chunk's time (their inter-token gap is 0).
    """

    request_id: str
    prompt_len: int
    start: float
    output_len: int = 0
    token_times: list[float] = field(default_factory=list)
    end: float = 0.0
    success: bool = False
    error: str = ""
    text: str = ""  # the streamed text, where the backend sends text
    output_token_ids: list[int] = field(default_factory=list)  # where the backend streams ids (gRPC)
    turn: int = 0  # 0: a conversation's first request (every request of a single-turn workload)

    @property
    def ttft(self) -> float | None:
        """Seconds from sending to the first token; None if no token arrived."""
        return self.token_times[0] - self.start if self.token_times else None

    @property
    def ttst(self) -> float | None:
        """Seconds from sending to the second token; None with fewer than 2 tokens."""
        return self.token_times[1] - self.start if len(self.token_times) >= 2 else None

    @property
    def e2el(self) -> float:
        """End-to-end latency in seconds."""
        return self.end - self.start

    @property
    def tpot(self) -> float | None:
        """Mean seconds per output token after the first; None below 2 tokens."""
        if self.output_len < 2 or len(self.token_times) < 2:
            return None
        return (self.token_times[-1] - self.token_times[0]) / (self.output_len - 1)

    @property
    def itls(self) -> list[float]:
        """Gaps in seconds between consecutive token arrivals."""
        times = self.token_times
        return [b - a for a, b in zip(times, times[1:])]


@dataclass(frozen=True, slots=True)
class LatencyStats:
    """Summary of one latency metric, in milliseconds."""

    mean_ms: float
    median_ms: float
    std_ms: float
    p90_ms: float
    p99_ms: float

    @classmethod
    def from_seconds(cls, values: Sequence[float]) -> LatencyStats:
        """Summarise samples given in seconds; no samples gives all zeros (as vLLM)."""
        if not values:
            return cls(0.0, 0.0, 0.0, 0.0, 0.0)
        ms = np.asarray(values, dtype=np.float64) * _MS_PER_S
        p90, p99 = np.percentile(ms, [90, 99])
        return cls(
            mean_ms=float(np.mean(ms)),
            median_ms=float(np.median(ms)),
            std_ms=float(np.std(ms)),
            p90_ms=float(p90),
            p99_ms=float(p99),
        )


@dataclass(frozen=True, slots=True)
class BenchmarkMetrics:
    """Aggregate results of one benchmark run; throughputs are per second of duration."""

    completed: int
    failed: int
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float
    request_goodput: float | None  # None when no SLOs were given
    output_throughput: float
    total_token_throughput: float
    ttft: LatencyStats
    ttst: LatencyStats
    tpot: LatencyStats
    itl: LatencyStats
    e2el: LatencyStats
    # Multi-turn workloads only (None otherwise): later turns resend a history a prefix cache may hold.
    ttft_first_turn: LatencyStats | None = None
    ttft_later_turns: LatencyStats | None = None


def validate_goodput_slos(slos: dict[str, float]) -> None:
    """Reject unknown SLO names and negative or non-finite limits (ms)."""
    for name, limit_ms in slos.items():
        if name not in GOODPUT_METRICS:
            raise ValueError(f"goodput_slos: unknown metric {name!r}; expected one of {GOODPUT_METRICS}")
        if not math.isfinite(limit_ms) or limit_ms < 0:
            raise ValueError(f"goodput_slos[{name!r}] must be a finite value >= 0 ms, got {limit_ms}")


def _meets_slos(record: RequestRecord, slos: dict[str, float]) -> bool:
    # As vLLM: a request with a single token has TPOT 0 for goodput; likewise it has
    # no second token, so a TTST limit cannot be missed. No first token at all misses.
    observed_s: dict[str, float | None] = {
        "ttft": record.ttft,
        "ttst": record.ttst if record.ttst is not None else 0.0,
        "tpot": record.tpot if record.tpot is not None else 0.0,
        "e2el": record.e2el,
    }
    for name, limit_ms in slos.items():
        value_s = observed_s[name]
        if value_s is None or value_s * _MS_PER_S > limit_ms:
            return False
    return True


def compute_metrics(
    records: Sequence[RequestRecord],
    duration_s: float,
    goodput_slos: dict[str, float] | None = None,
) -> BenchmarkMetrics:
    """Aggregate per-request records into vLLM `bench serve` metrics (plus TTST).

    `goodput_slos` maps metric names ("ttft", "ttst", "tpot", "e2el") to limits in
    ms; goodput counts completed requests meeting every limit, per second.
    """
    if not duration_s > 0:
        raise ValueError(f"duration_s must be > 0, got {duration_s}")
    if goodput_slos:
        validate_goodput_slos(goodput_slos)
    ok = [r for r in records if r.success]
    ttfts = [t for r in ok if (t := r.ttft) is not None]
    ttsts = [t for r in ok if (t := r.ttst) is not None]
    tpots = [t for r in ok if (t := r.tpot) is not None]
    itls = [gap for r in ok for gap in r.itls]
    total_input = sum(r.prompt_len for r in ok)
    total_output = sum(r.output_len for r in ok)
    is_multi_turn = any(r.turn > 0 for r in records)

    def turn_ttfts(is_first: bool) -> LatencyStats | None:
        return (
            LatencyStats.from_seconds([t for r in ok if (r.turn == 0) == is_first and (t := r.ttft) is not None])
            if is_multi_turn
            else None
        )

    goodput = None
    if goodput_slos:
        goodput = sum(_meets_slos(r, goodput_slos) for r in ok) / duration_s
    return BenchmarkMetrics(
        completed=len(ok),
        failed=len(records) - len(ok),
        duration_s=duration_s,
        total_input_tokens=total_input,
        total_output_tokens=total_output,
        request_throughput=len(ok) / duration_s,
        request_goodput=goodput,
        output_throughput=total_output / duration_s,
        total_token_throughput=(total_input + total_output) / duration_s,
        ttft=LatencyStats.from_seconds(ttfts),
        ttst=LatencyStats.from_seconds(ttsts),
        tpot=LatencyStats.from_seconds(tpots),
        itl=LatencyStats.from_seconds(itls),
        e2el=LatencyStats.from_seconds([r.e2el for r in ok]),
        ttft_first_turn=turn_ttfts(is_first=True),
        ttft_later_turns=turn_ttfts(is_first=False),
    )


_LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el", "ttst")
_TURN_METRICS = ("ttft_first_turn", "ttft_later_turns")


def metrics_to_result_json(
    metrics: BenchmarkMetrics, records: Sequence[RequestRecord], extra: dict[str, Any]
) -> dict[str, Any]:
    """The result file, with vLLM's key names so existing tooling can read it.

    Per-request lists are in send order and in seconds (as vLLM); a failed request
    reports output length 0, as vLLM does. `extra` (run settings, KV-transfer
    figures) is merged in last.
    """
    result: dict[str, Any] = {
        "duration": metrics.duration_s,
        "completed": metrics.completed,
        "failed": metrics.failed,
        "total_input_tokens": metrics.total_input_tokens,
        "total_output_tokens": metrics.total_output_tokens,
        "request_throughput": metrics.request_throughput,
        "request_goodput": metrics.request_goodput,
        "output_throughput": metrics.output_throughput,
        "total_token_throughput": metrics.total_token_throughput,
    }
    for name in _LATENCY_METRICS:
        stats: LatencyStats = getattr(metrics, name)
        result[f"mean_{name}_ms"] = stats.mean_ms
        result[f"median_{name}_ms"] = stats.median_ms
        result[f"std_{name}_ms"] = stats.std_ms
        result[f"p90_{name}_ms"] = stats.p90_ms
        result[f"p99_{name}_ms"] = stats.p99_ms
    for name in _TURN_METRICS:
        turn_stats: LatencyStats | None = getattr(metrics, name)
        if turn_stats is not None:
            result[f"mean_{name}_ms"] = turn_stats.mean_ms
            result[f"p99_{name}_ms"] = turn_stats.p99_ms
    result["input_lens"] = [r.prompt_len for r in records]
    result["output_lens"] = [r.output_len if r.success else 0 for r in records]
    result["ttfts"] = [r.ttft if r.ttft is not None else 0.0 for r in records]
    result["ttsts"] = [r.ttst for r in records]
    result["itls"] = [r.itls for r in records]
    result["errors"] = [r.error for r in records]
    result.update(extra)
    return result


_BANNER_WIDTH = 50
_SECTIONS = (
    ("ttft", "TTFT", "Time to First Token"),
    ("ttst", "TTST", "Time to Second Token"),
    ("tpot", "TPOT", "Time per Output Token (excl. 1st token)"),
    ("itl", "ITL", "Inter-token Latency"),
    ("e2el", "E2EL", "End-to-end Latency"),
)


def _row(label: str, value: object) -> str:
    if isinstance(value, float):
        return f"{label:<40} {value:<10.2f}"
    return f"{label:<40} {value!s:<10}"


def format_report(metrics: BenchmarkMetrics, extra_lines: Sequence[tuple[str, str]] = ()) -> str:
    """The text report in vLLM's layout; `extra_lines` follow the throughput rows."""
    lines = [
        f"{' Serving Benchmark Result ':=^{_BANNER_WIDTH}}",
        _row("Successful requests:", metrics.completed),
        _row("Failed requests:", metrics.failed),
        _row("Benchmark duration (s):", metrics.duration_s),
        _row("Total input tokens:", metrics.total_input_tokens),
        _row("Total generated tokens:", metrics.total_output_tokens),
        _row("Request throughput (req/s):", metrics.request_throughput),
    ]
    if metrics.request_goodput is not None:
        lines.append(_row("Request goodput (req/s):", metrics.request_goodput))
    lines.append(_row("Output token throughput (tok/s):", metrics.output_throughput))
    lines.append(_row("Total Token throughput (tok/s):", metrics.total_token_throughput))
    lines.extend(_row(label, value) for label, value in extra_lines)
    for name, short, header in _SECTIONS:
        stats: LatencyStats = getattr(metrics, name)
        lines.append(f"{header:-^{_BANNER_WIDTH}}")
        lines.append(_row(f"Mean {short} (ms):", stats.mean_ms))
        lines.append(_row(f"Median {short} (ms):", stats.median_ms))
        lines.append(_row(f"P90 {short} (ms):", stats.p90_ms))
        lines.append(_row(f"P99 {short} (ms):", stats.p99_ms))
        if name == "ttft" and metrics.ttft_first_turn is not None and metrics.ttft_later_turns is not None:
            for turns, turn_stats in (
                ("first turns", metrics.ttft_first_turn),
                ("later turns", metrics.ttft_later_turns),
            ):
                lines.append(_row(f"Mean TTFT, {turns} (ms):", turn_stats.mean_ms))
                lines.append(_row(f"P99 TTFT, {turns} (ms):", turn_stats.p99_ms))
    lines.append("=" * _BANNER_WIDTH)
    return "\n".join(lines)
