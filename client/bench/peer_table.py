"""The `bench peers` report: one table of every server's figures, kvservice's ratios to each peer,
and the issue's targets with a pass/fail verdict per kvservice deployment.

Pure functions over result dicts (a `ServerResult` per server, its runs as `result_json` dicts)
and the memory-bandwidth limit in ms a token (`memory_bandwidth`, measured by the caller), so the
table and the verdicts are tested without starting anything.
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
BANDWIDTH_LIMIT = "bandwidth limit"  # a target's reference: `memory_bandwidth`'s ms a token


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
    """A goal of the issue on one row: kvservice's figure against `factor` x its reference, lower
    is better unless `is_higher_better`. The reference is the better of the `peers` that were
    measured, the memory-bandwidth limit (`is_of_bandwidth_limit`, ms a token), or a fixed `limit`."""

    metric: Metric
    text: str
    peers: tuple[str, ...] = ()
    factor: float = 1.0
    is_higher_better: bool = False
    is_of_bandwidth_limit: bool = False
    limit: float | None = None

    def reference(
        self, results: dict[str, ServerResult], bandwidth_limit_ms: float | None = None
    ) -> tuple[str, float] | None:
        """What the bound is a multiple of and its figure; None when that was not measured."""
        if self.limit is not None:
            return "fixed", self.limit
        if self.is_of_bandwidth_limit:
            return None if bandwidth_limit_ms is None else (BANDWIDTH_LIMIT, bandwidth_limit_ms)
        measured = {p: v for p in self.peers if p in results and (v := results[p].value(self.metric)) is not None}
        if not measured:
            return None
        best = (max if self.is_higher_better else min)(measured, key=measured.__getitem__)
        return best, measured[best]

    def bound(self, results: dict[str, ServerResult], bandwidth_limit_ms: float | None = None) -> float | None:
        """The figure kvservice must reach; None when its reference was not measured."""
        reference = self.reference(results, bandwidth_limit_ms)
        return None if reference is None else self.factor * reference[1]

    def verdict(
        self, deployment: str, results: dict[str, ServerResult], bandwidth_limit_ms: float | None = None
    ) -> bool | None:
        """True: met, False: missed, None: not decidable (kvservice or its reference not measured)."""
        bound = self.bound(results, bandwidth_limit_ms)
        value = results[deployment].value(self.metric) if deployment in results else None
        if bound is None or value is None:
            return None
        return value >= bound if self.is_higher_better else value <= bound


# Issue #50's targets (speed round 3), each for both kvservice deployments. A target whose
# reference did not run (vLLM not installed, say) is n/a; the better peer is the better of those measured.
TARGETS = (
    Target(TPOT_SINGLE, "<= 0.7x llama.cpp", peers=(LLAMA_CPP,), factor=0.7),
    Target(TPOT_SINGLE, f"<= 3x {BANDWIDTH_LIMIT}", factor=3.0, is_of_bandwidth_limit=True),
    Target(THROUGHPUT_LOADED, ">= 1.5x better peer", peers=PEERS, factor=1.5, is_higher_better=True),
    Target(ITL_P99_LOADED, "<= 0.5x vllm", peers=(VLLM,), factor=0.5),
    Target(STARTUP_TIME, "<= 2 s", limit=2.0),
)


def _ratio_cell(value: float | None, baseline: float | None) -> str:
    return "n/a" if value is None or baseline is None else ratio(value, baseline)


def _verdict_cell(target: Target, results: dict[str, ServerResult], bandwidth_limit_ms: float | None) -> str:
    words = {True: "PASS", False: "FAIL", None: "n/a"}
    verdicts = [(d, target.verdict(d, results, bandwidth_limit_ms)) for d in KVSERVICE if d in results]
    if len(verdicts) == 1:
        return words[verdicts[0][1]]
    return ", ".join(f"{SHORT_NAMES[d]} {words[v]}" for d, v in verdicts)


def target_verdicts(results: dict[str, ServerResult], bandwidth_limit_ms: float | None = None) -> list[dict[str, Any]]:
    """Every target per kvservice deployment that ran, for the result file; `reference` names
    what the bound came from (a peer, the bandwidth limit, a fixed limit), None when not measured."""
    verdicts = []
    for t in TARGETS:
        reference = t.reference(results, bandwidth_limit_ms)
        for d in KVSERVICE:
            if d in results:
                verdicts.append(
                    {
                        "metric": t.metric.label,
                        "target": t.text,
                        "deployment": d,
                        "value": results[d].value(t.metric),
                        "reference": None if reference is None else reference[0],
                        "bound": t.bound(results, bandwidth_limit_ms),
                        "passed": t.verdict(d, results, bandwidth_limit_ms),
                    }
                )
    return verdicts


def format_peers_table(results: dict[str, ServerResult], bandwidth_limit_ms: float | None = None) -> str:
    """Servers side by side, then kvservice / peer for each pair that ran, then the targets: a
    metric's first on its row, any further one on a row of its own below it.

    A figure not measured shows as `-`, its ratios as n/a."""
    names = [n for n in SERVERS if n in results]
    ours = [n for n in names if n in KVSERVICE]
    peers = [n for n in names if n in PEERS]
    pairs = [(k, p) for k in ours for p in peers]
    header = (
        "Metric",
        *(SHORT_NAMES[n] for n in names),
        *(f"{SHORT_NAMES[k]}/{SHORT_NAMES[p]}" for k, p in pairs),
        "target",
        "pass/fail",
    )
    rows: list[Sequence[str]] = [("Status", *(results[n].status for n in names), *[""] * (len(pairs) + 2))]
    for metric in METRICS:
        values = {n: results[n].value(metric) for n in names}
        figures = [
            *("-" if values[n] is None else cell(values[n]) for n in names),
            *(_ratio_cell(values[k], values[p]) for k, p in pairs),
        ]
        targets = [(t.text, _verdict_cell(t, results, bandwidth_limit_ms)) for t in TARGETS if t.metric == metric]
        first, *more = targets or [("", "")]
        rows.append((metric.label, *figures, *first))
        rows.extend(("", *[""] * len(figures), *target) for target in more)
    return render(header, rows)
