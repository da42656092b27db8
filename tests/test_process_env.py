"""`exec_with_worker_env`: a benchmark script runs again with the workers' start-up environment
(glibc reads its malloc tunables only when a process starts), once, keeping its arguments and
any of those variables the caller set."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

from kvservice.runtime.process_env import WORKER_ENV

PROBE = """\
import os, sys
print("start", flush=True)
from kvservice.runtime.process_env import exec_with_worker_env
exec_with_worker_env()
print("env", os.environ.get("GLIBC_TUNABLES"), os.environ.get("OMP_WAIT_POLICY"), sys.argv[1:])
"""


def _run(script: pathlib.Path, env: dict[str, str]) -> list[str]:
    done = subprocess.run(
        [sys.executable, str(script), "--flag", "x"], env=env, capture_output=True, text=True, timeout=120, check=True
    )
    return done.stdout.splitlines()


def test_a_script_runs_again_once_with_the_worker_env(tmp_path: pathlib.Path) -> None:
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    bare = {name: value for name, value in os.environ.items() if name not in WORKER_ENV}
    lines = _run(script, {**bare, "OMP_WAIT_POLICY": "ACTIVE"})
    assert lines == ["start", "start", f"env {WORKER_ENV['GLIBC_TUNABLES']} ACTIVE ['--flag', 'x']"]
    assert _run(script, {**bare, **WORKER_ENV}) == [
        "start",
        f"env {WORKER_ENV['GLIBC_TUNABLES']} PASSIVE ['--flag', 'x']",
    ]
