"""The `bench peers` report: one table of every server's figures, kvservice's ratios to each peer,
and the issue's targets with a pass/fail verdict per kvservice deployment.

Pure functions over result dicts (a `ServerResult` per server, its runs as `result_json` dicts),
so the table and the verdicts are tested without starting anything.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvservice.client.bench.table import cell, ratio, render

KVSERVICE_COLOCATED, KVSERVICE_1P1D, LLAMA_CPP, VLLM = "kvservice-colocated", "kvservice-1p1d", "llama.cpp", "vllm"
SERVERS = (KVSERVICE_COLOCATED, KVSERVICE_1P1D, LLAMA_CPP, VLLM)
KVSERVICE = (KVSERVICE_COLOCATED, KVSERVICE_1P1D)
PEERS = (LLAMA_CPP, VLLM)
# Column headings: short, so the table fits a terminal.
SHORT_NAMES = {KVSERVICE_COLOCATED: "coloc", KVSERVICE_1P1D: "1p1d", LLAMA_CPP: "llama.cpp", VLLM: "vllm"}
SINGLE, LOADED = 1, 16  # the two concurrency levels the issue measures
STARTUP = "startup_s"


@dataclass(frozen=True, slots=True)
class Metric:
    """One row: a result-json `key` at `concurrency` (None: a per-server figure, start-up)."""

    label: str
    key: str
    concurrency: int | None = None


TPOT_SINGLE = Metric(f"Mean TPOT c={SINGLE} (ms)", "mean_tpot_ms", SINGLE)
ITL_P99_LOADED = Metric(f"P99 ITL c={LOADED} (ms)", "p99_itl_ms", LOADED)
THROUGHPUT_LOADED = Metric(f"Output tok/s c={LOADED}", "output_throughput", LOADED)
STARTUP_TIME = Metric("Start-up to ready (s)", STARTUP)
METRICS = (
    Metric(f"Output tok/s c={SINGLE}", "output_throughput", SINGLE),
    Metric(f"Mean TTFT c={SINGLE} (ms)", "mean_ttft_ms", SINGLE),
    TPOT_SINGLE,
    Metric(f"P99 ITL c={SINGLE} (ms)", "p99_itl_ms", SINGLE),
    THROUGHPUT_LOADED,
    Metric(f"Mean TTFT c={LOADED} (ms)", "mean_ttft_ms", LOADED),
    Metric(f"Mean TPOT c={LOADED} (ms)", "mean_tpot_ms", LOADED),
    ITL_P99_LOADED,
    STARTUP_TIME,
)


@dataclass(slots=True)
class ServerResult:
    """What one server did: its command, start-up time, sanity check and one run per concurrency.

    `error` says why it was not timed (did not start, failed its sanity check, a run failed);
    `sanity` holds the sanity check's answers.
    """

    name: str
    command: list[str]
    startup_s: float | None = None
    is_sane: bool = False
    sanity: dict[str, Any] = field(default_factory=dict)
    runs: dict[int, dict[str, Any]] = field(default_factory=dict)
    error: str = ""

    def value(self, metric: Metric) -> float | None:
        """The metric's figure; None where it was not measured (or a run had failures)."""
        if metric.concurrency is None:
            return self.startup_s if metric.key == STARTUP else None
        run = self.runs.get(metric.concurrency)
        if run is None or run.get("failed", 0) or run.get(metric.key) is None:
            return None
        return float(run[metric.key])

    @property
    def status(self) -> str:
        """ok, or the first words of why it was not (fully) timed."""
        return "ok" if not self.error else self.error.split(":")[0]

    def to_json(self) -> dict[str, Any]:
        return {
            "command": self.command,
            "startup_s": self.startup_s,
            "is_sane": self.is_sane,
            "sanity": self.sanity,
            "error": self.error,
            "runs": {str(c): run for c, run in self.runs.items()},
        }


@dataclass(frozen=True, slots=True)
class Target:
    """A goal of the issue on one row: kvservice's figure against `factor` x the better of `peers`
    (lower is better unless `is_higher_better`), or against `limit` when there are no peers."""

    metric: Metric
    text: str
    peers: tuple[str, ...] = ()
    factor: float = 1.0
    is_higher_better: bool = False
    limit: float | None = None
    deployments: tuple[str, ...] = KVSERVICE

    def bound(self, results: dict[str, ServerResult]) -> float | None:
        """The figure kvservice must reach; None when a peer it needs was not measured."""
        if self.limit is not None:
            return self.limit
        values = [results[p].value(self.metric) if p in results else None for p in self.peers]
        if not values or any(v is None for v in values):
            return None
        numbers = [v for v in values if v is not None]
        return self.factor * (max(numbers) if self.is_higher_better else min(numbers))

    def verdict(self, deployment: str, results: dict[str, ServerResult]) -> bool | None:
        """True: met, False: missed, None: not decidable (kvservice or a peer not measured)."""
        bound = self.bound(results)
        value = results[deployment].value(self.metric) if deployment in results else None
        if bound is None or value is None:
            return None
        return value >= bound if self.is_higher_better else value <= bound


TARGETS = (
    Target(TPOT_SINGLE, "<= 1.3x llama.cpp", peers=(LLAMA_CPP,), factor=1.3),
    Target(ITL_P99_LOADED, "<= vllm", peers=(VLLM,)),
    Target(THROUGHPUT_LOADED, ">= 1.3x better peer", peers=PEERS, factor=1.3, is_higher_better=True),
    Target(STARTUP_TIME, "1p1d <= 10 s", limit=10.0, deployments=(KVSERVICE_1P1D,)),
)


def _ratio_cell(value: float | None, baseline: float | None) -> str:
    return "n/a" if value is None or baseline is None else ratio(value, baseline)


def _verdict_cell(target: Target, results: dict[str, ServerResult]) -> str:
    words = {True: "PASS", False: "FAIL", None: "n/a"}
    verdicts = [(d, target.verdict(d, results)) for d in target.deployments if d in results]
    if len(verdicts) == 1:
        return words[verdicts[0][1]]
    return ", ".join(f"{SHORT_NAMES[d]} {words[v]}" for d, v in verdicts)


def target_verdicts(results: dict[str, ServerResult]) -> list[dict[str, Any]]:
    """Every target per kvservice deployment that ran, for the result file."""
    return [
        {
            "metric": t.metric.label,
            "target": t.text,
            "deployment": d,
            "value": results[d].value(t.metric),
            "bound": t.bound(results),
            "passed": t.verdict(d, results),
        }
        for t in TARGETS
        for d in t.deployments
        if d in results
    ]


def format_peers_table(results: dict[str, ServerResult]) -> str:
    """Servers side by side, then kvservice / peer for each pair that ran, then the targets.

    A figure not measured shows as `-`, its ratios as n/a."""
    names = [n for n in SERVERS if n in results]
    ours = [n for n in names if n in KVSERVICE]
    peers = [n for n in names if n in PEERS]
    pairs = [(k, p) for k in ours for p in peers]
    targets = {t.metric: t for t in TARGETS}
    header = (
        "Metric",
        *(SHORT_NAMES[n] for n in names),
        *(f"{SHORT_NAMES[k]}/{SHORT_NAMES[p]}" for k, p in pairs),
        "target",
        "pass/fail",
    )
    blank = [""] * (len(pairs) + 2)
    rows: list[Sequence[str]] = [("Status", *(results[n].status for n in names), *blank)]
    for metric in METRICS:
        values = {n: results[n].value(metric) for n in names}
        ratios = [_ratio_cell(values[k], values[p]) for k, p in pairs]
        target = targets.get(metric)
        rows.append(
            (
                metric.label,
                *("-" if values[n] is None else cell(values[n]) for n in names),
                *ratios,
                target.text if target else "",
                _verdict_cell(target, results) if target else "",
            )
        )
    return render(header, rows)
