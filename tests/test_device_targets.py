"""scripts/device_targets.py: every device-check figure beside its target, PASS or FAIL, and a
full run that misses a target exits non-zero."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys
import types
from typing import Any

import pytest
from conftest import REPO, load_repo_module


@pytest.fixture(scope="module")
def targets() -> types.ModuleType:
    return load_repo_module("scripts/device_targets.py", "device_targets")


def full_report(**figures: float) -> dict[str, Any]:
    steps = {"pd_transfer", "bench_transfer", "bench_spec", "bench_engine"}
    return {
        "quick": False,
        "num_failed_steps": 0,
        "steps": {name: {"ok": True} for name in steps},
        "figures": {name.replace("__", "."): value for name, value in figures.items()},
    }


MET = {
    "pd_transfer__num_mismatched_requests": 0.0,
    "pd_transfer__kv_bytes_pulled": 4096.0,
    "bench_transfer__ratio": 0.62,
    "bench_transfer__grpc_gbps": 3.1,
    "bench_transfer__num_verified_bytes": 1e9,
    "bench_spec__deferred_over_eager": 0.8,
    "bench_engine__float32.b16.decode_ratio": 1.6,
    "bench_engine__bfloat16.b16.decode_ratio": 1.5,
    "bench_engine__float32.b1.decode_ratio": 0.9,
}


def test_every_figure_carries_its_target_and_verdict(targets: types.ModuleType) -> None:
    verdicts = targets.judge(full_report(**MET))
    assert set(verdicts) == {name.replace("__", ".") for name in MET}
    assert verdicts["bench_transfer.ratio"] == {
        "value": 0.62,
        "target": ">= 0.6 (KV tensor to tensor, gRPC vs raw TCP)",
        "pass": True,
    }
    assert verdicts["bench_spec.deferred_over_eager"]["target"].startswith("<= 0.85 (")
    assert all(v["pass"] for v in verdicts.values() if v["target"] is not None)
    # Context figures (a rate beside its ratio, batch 1) have no target of their own.
    assert verdicts["bench_transfer.grpc_gbps"]["pass"] is None
    assert verdicts["bench_engine.float32.b1.decode_ratio"] == {"value": 0.9, "target": None, "pass": None}


def test_a_missed_bound_fails(targets: types.ModuleType) -> None:
    verdicts = targets.judge(
        full_report(**{**MET, "bench_transfer__ratio": 0.59, "pd_transfer__num_mismatched_requests": 1.0})
    )
    assert verdicts["bench_transfer.ratio"]["pass"] is False
    assert verdicts["pd_transfer.num_mismatched_requests"]["pass"] is False
    assert verdicts["bench_spec.deferred_over_eager"]["pass"] is True


def test_a_targeted_figure_a_step_did_not_report_fails_as_not_measured(targets: types.ModuleType) -> None:
    report = full_report(**{k: v for k, v in MET.items() if k != "bench_engine__bfloat16.b16.decode_ratio"})
    assert targets.judge(report)["bench_engine.bfloat16.b16.decode_ratio"] == {
        "value": None,
        "target": ">= 1.5 (decode tok/s vs transformers, batch 16)",
        "pass": False,
    }
    del report["steps"]["bench_engine"]  # --only: the step never ran, nothing to judge
    assert "bench_engine.bfloat16.b16.decode_ratio" not in targets.judge(report)


def run_script(tmp_path: pathlib.Path, report: dict[str, Any]) -> tuple[int, dict[str, Any], str]:
    raw, out = tmp_path / "raw.json", tmp_path / "judged.json"
    raw.write_text(json.dumps(report))
    done = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "device_targets.py"), str(raw), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    return done.returncode, json.loads(out.read_text()), done.stderr


def test_a_full_run_that_misses_a_target_exits_1_and_shows_the_table(tmp_path: pathlib.Path) -> None:
    code, judged, table = run_script(tmp_path, full_report(**{**MET, "bench_transfer__ratio": 0.4}))
    assert code == 1
    assert judged["num_failed_targets"] == 1 and judged["verdicts"]["bench_transfer.ratio"]["pass"] is False
    row = next(line for line in table.splitlines() if line.startswith("bench_transfer.ratio "))
    assert row.split()[1] == "0.4" and ">= 0.6 (KV tensor" in row and row.endswith("FAIL")
    code, judged, _ = run_script(tmp_path, full_report(**MET))
    assert code == 0 and judged["num_failed_targets"] == 0


def test_a_quick_run_shows_verdicts_but_only_failed_steps_fail_it(tmp_path: pathlib.Path) -> None:
    report = {**full_report(**{**MET, "bench_spec__deferred_over_eager": 1.1}), "quick": True}
    code, judged, table = run_script(tmp_path, report)
    assert code == 0 and judged["num_failed_targets"] == 1
    assert "--quick: sizes too small to judge" in table
    code, _, _ = run_script(tmp_path, {**report, "num_failed_steps": 1})
    assert code == 1
