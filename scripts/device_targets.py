"""Each figure of a device check beside its target, pass or fail.

    python scripts/device_targets.py RAW.json [--out PATH]

reads what scripts/device_check.py wrote and adds `verdicts`: per figure its value, its target
(">= 0.6x raw TCP") and `pass` (true, false, or null for a figure that is context for another
and has no target of its own), and `num_failed_targets`. A targeted figure that a step ran for
but did not report fails as "not measured". It prints the table on stderr and writes the JSON to
--out, else $OUT/device_check.json when $OUT is set, else stdout. Exit status: 1 when a step
failed or, in a full run, a target was missed; a `--quick` run's sizes are too small to judge,
so its verdicts are shown but do not fail it.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class Target:
    """A bound on one figure: `at_least` or `at_most` (or both)."""

    figure: str  # "step.name", as in the report's `figures`
    what: str
    at_least: float | None = None
    at_most: float | None = None

    def __post_init__(self) -> None:
        if self.at_least is None and self.at_most is None:
            raise ValueError(f"{self.figure}: a target needs a bound")

    @property
    def step(self) -> str:
        return self.figure.split(".", 1)[0]

    def describe(self) -> str:
        bounds = []
        if self.at_least is not None:
            bounds.append(f">= {self.at_least:g}")
        if self.at_most is not None:
            bounds.append(f"<= {self.at_most:g}")
        return f"{' and '.join(bounds)} ({self.what})"

    def is_met(self, value: float) -> bool:
        return (self.at_least is None or value >= self.at_least) and (self.at_most is None or value <= self.at_most)


TARGETS = [
    Target("pd_transfer.num_mismatched_requests", "1P1D greedy tokens equal colocated ones", at_most=0),
    Target("pd_transfer.kv_bytes_pulled", "the prompts' KV went over PullKV", at_least=1),
    Target("bench_transfer.ratio", "KV tensor to tensor, gRPC vs raw TCP", at_least=0.6),
    Target("bench_transfer.num_verified_bytes", "the received KV checked byte for byte", at_least=1),
    Target("bench_spec.deferred_over_eager", "prefill step + draft pass, deferred vs eager finalize", at_most=0.85),
    *(
        Target(f"bench_engine.{dtype}.b16.decode_ratio", "decode tok/s vs transformers, batch 16", at_least=1.5)
        for dtype in ("float32", "bfloat16")
    ),
]


def judge(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Every figure's verdict, then each targeted figure that a step ran for but did not report."""
    targets = {t.figure: t for t in TARGETS}
    verdicts: dict[str, dict[str, Any]] = {}
    for name, value in report["figures"].items():
        target = targets.get(name)
        verdicts[name] = {
            "value": value,
            "target": target.describe() if target else None,
            "pass": target.is_met(value) if target else None,
        }
    for target in TARGETS:
        if target.figure not in verdicts and target.step in report["steps"] and not report.get("quick"):
            verdicts[target.figure] = {"value": None, "target": target.describe(), "pass": False}
    return verdicts


def table(verdicts: dict[str, dict[str, Any]]) -> str:
    rows = [("figure", "value", "target", "verdict")]
    for name, v in verdicts.items():
        value = "not measured" if v["value"] is None else f"{v['value']:.4g}"
        verdict = {True: "PASS", False: "FAIL", None: "no target"}[v["pass"]]
        rows.append((name, value, v["target"] or "-", verdict))
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    return "\n".join(f"{a:<{widths[0]}}  {b:>{widths[1]}}  {c:<{widths[2]}}  {d}" for a, b, c, d in rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("raw", type=pathlib.Path, help="the JSON scripts/device_check.py wrote")
    parser.add_argument(
        "--out", type=pathlib.Path, default=None, help="the JSON's path (default: $OUT/device_check.json, else stdout)"
    )
    args = parser.parse_args()
    report = json.loads(args.raw.read_text())
    verdicts = judge(report)
    report["verdicts"] = verdicts
    report["num_failed_targets"] = sum(v["pass"] is False for v in verdicts.values())
    quick = bool(report.get("quick"))
    print(table(verdicts), file=sys.stderr)
    print(
        f"{report['num_failed_targets']} target(s) missed, {report['num_failed_steps']} step(s) failed"
        + (" (--quick: sizes too small to judge; the targets do not fail this run)" if quick else ""),
        file=sys.stderr,
    )
    text = json.dumps(report, indent=2)
    out = args.out or (pathlib.Path(os.environ["OUT"]) / "device_check.json" if os.environ.get("OUT") else None)
    if out is None:
        print(text)
    else:
        out.write_text(text + "\n")
        print(f"wrote {out}", file=sys.stderr)
    has_failed = report["num_failed_steps"] > 0 or (report["num_failed_targets"] > 0 and not quick)
    return 1 if has_failed else 0


if __name__ == "__main__":
    sys.exit(main())
