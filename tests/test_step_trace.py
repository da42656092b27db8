"""KVSERVICE_STEP_TRACE: an engine records each step's phases (and its lease's turns) and writes
them when its process exits; scripts/step_trace.py reads them back into where the time went."""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys

import pytest
from conftest import load_repo_module

from kvservice.config import EngineConfig
from kvservice.core.sampling_params import SamplingParams
from kvservice.engine.engine_builder import build_engine
from kvservice.engine.step_trace import TRACE_DIR_ENV, StepTrace


def test_off_unless_the_variable_names_a_directory(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(TRACE_DIR_ENV, raising=False)
    assert StepTrace.from_env() is None
    assert build_engine("tiny", EngineConfig(num_blocks=16, max_model_len=64)).core.step_trace is None


def test_an_engine_records_every_step_that_computed_in_order(
    monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path
) -> None:
    monkeypatch.setenv(TRACE_DIR_ENV, str(tmp_path))
    engine = build_engine("tiny", EngineConfig(num_blocks=32, max_model_len=64))
    trace = engine.core.step_trace
    assert trace is not None and trace.path.parent == tmp_path
    for prompt in ([1, 2, 3, 4], [5, 6]):
        engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    assert [step[5:] for step in trace.steps] == [(6, 2), (2, 2), (2, 2)]  # both prompts, then two decode steps
    for started, scheduled, computing, computed, ended, *_ in trace.steps:
        assert started <= scheduled <= computing <= computed <= ended
    assert all(a[4] <= b[0] for a, b in zip(trace.steps, trace.steps[1:]))
    trace.write()
    written = json.loads(trace.path.read_text())
    assert written["lease_role"] is None and written["turns"] == [] and len(written["steps"]) == 3


def test_a_traced_process_writes_its_file_when_it_exits(tmp_path: pathlib.Path) -> None:
    code = (
        "from kvservice.config import EngineConfig\n"
        "from kvservice.core.sampling_params import SamplingParams\n"
        "from kvservice.engine.engine_builder import build_engine\n"
        "engine = build_engine('tiny', EngineConfig(num_blocks=16, max_model_len=64))\n"
        "engine.add_request([1, 2, 3], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))\n"
        "while engine.has_unfinished_requests():\n"
        "    engine.step()\n"
    )
    subprocess.run(
        [sys.executable, "-c", code], check=True, env={**os.environ, TRACE_DIR_ENV: str(tmp_path)}, timeout=120
    )
    (path,) = tmp_path.glob("steps-*.json")
    assert len(json.loads(path.read_text())["steps"]) == 2


def test_the_report_splits_the_window_by_step_phase_and_by_turn() -> None:
    script = load_repo_module("scripts/step_trace.py", "step_trace_script")
    # A decode worker: steps of 4 ms (1 to schedule, 1 waiting, 2 computing) every 10 ms, each in
    # a turn; a prefill worker holding the turn 5 ms of the 6 between them: 1 ms a cycle unheld.
    decode_steps = [(t, t + 0.001, t + 0.002, t + 0.004, t + 0.004, 16, 16) for t in (i * 0.010 for i in range(100))]
    decode_turns = [(s[1], s[2], s[3]) for s in decode_steps]
    prefill_turns = [(s[3], s[3], s[3] + 0.005) for s in decode_steps]
    traces = [
        {"pid": 1, "lease_role": "first", "steps": decode_steps, "turns": decode_turns},
        {"pid": 2, "lease_role": "yielding", "steps": [], "turns": prefill_turns},
    ]
    text = script.report(traces, 0.1)
    assert "pid 1 (lease: first): 79 steps" in text or "pid 1 (lease: first): 80 steps" in text
    assert "ms a step: schedule 1.00, wait for turn 1.00, compute 2.00, outputs 0.00" in text
    assert "held" in text and "(20%)" in text and "(50%)" in text
    unheld = re.search(r"no process held the turn for [0-9.]+ s \(([0-9.]+)%\)", text)
    assert unheld is not None and 29 <= float(unheld.group(1)) <= 31, text  # 30%, but for the window's edges
    assert script.covered([(0.0, 2.0), (1.0, 3.0), (5.0, 6.0)]) == 4.0  # [0, 3] and [5, 6]
