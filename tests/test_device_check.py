"""scripts/device_check.sh works before a GPU session needs it: on CPU, quick sizes, every
step passes and every figure is a number; a failing step is recorded and the others still run.
"""

from __future__ import annotations

import json
import math
import pathlib
import subprocess
import types

import pytest
from conftest import REPO, load_repo_module

EXPECTED_FIGURES = [
    "pd_transfer.num_mismatched_requests",
    "pd_transfer.kv_bytes_pulled",
    "bench_transfer.ratio",
    "bench_transfer.grpc_gbps",
    "bench_transfer.tcp_gbps",
    "bench_transfer.plain_grpc_gbps",
    "bench_transfer.shm_gbps",
    "bench_spec.deferred_over_eager",
    "bench_engine.float32.b1.decode_ratio",
    "bench_engine.float32.b2.decode_ratio",
    "bench_engine.float32.b2.prefill_ratio",
]


def _load_script() -> types.ModuleType:
    return load_repo_module("scripts/device_check.py", "device_check")


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_quick_cpu_run_reports_every_figure_as_a_number(tmp_path: pathlib.Path) -> None:
    out = tmp_path / "figures.json"
    result = subprocess.run(
        [
            str(REPO / "scripts" / "device_check.sh"),
            "--device",
            "cpu",
            "--quick",
            "--out",
            str(out),
            "--time-limit",
            "140",
        ],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    report = json.loads(out.read_text())
    assert {name: step.get("error") for name, step in report["steps"].items()} == dict.fromkeys(
        ["pd_transfer", "bench_transfer", "bench_spec", "bench_engine"]
    ), result.stderr[-2000:]
    assert result.returncode == 0
    assert report["device"] == "cpu" and report["num_failed_steps"] == 0
    figures = report["figures"]
    assert set(EXPECTED_FIGURES) <= set(figures)
    bad = {k: v for k, v in figures.items() if not isinstance(v, float) or not math.isfinite(v)}
    assert not bad
    assert figures["pd_transfer.num_mismatched_requests"] == 0 and figures["pd_transfer.kv_bytes_pulled"] > 0


def test_a_failing_step_is_recorded_and_the_next_still_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    script = _load_script()

    def broken(device: str, quick: bool, timeout_s: float) -> dict[str, float]:
        raise RuntimeError("no GPU here")

    def fine(device: str, quick: bool, timeout_s: float) -> dict[str, float]:
        return {"ratio": 1.5}

    monkeypatch.setattr(script, "STEPS", [script.Step("broken", broken, 0.5), script.Step("fine", fine, 0.5)])
    report = script.run_checks("cpu", quick=True, time_limit_s=60)
    assert report["steps"]["broken"]["ok"] is False and "no GPU here" in report["steps"]["broken"]["error"]
    assert report["steps"]["fine"]["ok"] is True
    assert report["figures"] == {"fine.ratio": 1.5} and report["num_failed_steps"] == 1


def test_steps_past_the_time_limit_are_skipped_not_started() -> None:
    script = _load_script()
    calls: list[str] = []

    def slow(device: str, quick: bool, timeout_s: float) -> dict[str, float]:
        calls.append("slow")
        raise TimeoutError

    script.STEPS = [script.Step("first", slow, 1.0), script.Step("second", slow, 1.0)]
    report = script.run_checks("cpu", quick=True, time_limit_s=4)
    assert calls == []  # under 5 s left for each: nothing starts
    assert all("skipped" in step["error"] for step in report["steps"].values())
