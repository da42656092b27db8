"""scripts/device_deps.py: the wheels the device machine gets cover every import kvservice's
servers need, and the device installs only those its python3 lacks or has too old."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys
import tomllib
import types

import pytest
from conftest import REPO, load_repo_module


@pytest.fixture(scope="module")
def deps() -> types.ModuleType:
    return load_repo_module("scripts/device_deps.py", "device_deps")


def test_the_pins_cover_every_runtime_dependency_but_torch_and_theirs(deps: types.ModuleType) -> None:
    pinned = {deps.canonical(pin.split("==")[0]) for pin in deps.pins()}
    declared = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    names = {deps.canonical(re.split(r"[<>=!~;\[ ]", d, maxsplit=1)[0]) for d in declared}
    assert names - {"torch"} <= pinned
    assert "torch" not in pinned
    # What the servers import and the old hand-written list lacked; their own dependencies;
    # setuptools, which builds kvservice on the device.
    assert {"llguidance", "aiohttp", "prometheus-client", "multidict", "setuptools"} <= pinned


def test_the_device_installs_what_it_lacks_or_has_too_old(
    deps: types.ModuleType, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("llguidance-1.9.1", "protobuf-9.0.0", "not_on_this_python-1.0"):
        (tmp_path / f"{name}-py3-none-any.whl").touch()
    installed = {"llguidance": "1.9.1", "protobuf": "4.25.0"}  # protobuf: older than the stubs need
    monkeypatch.setattr(deps, "installed_version", installed.get)
    assert [w.name for w in deps.select(tmp_path)] == [
        "not_on_this_python-1.0-py3-none-any.whl",
        "protobuf-9.0.0-py3-none-any.whl",
    ]


def test_every_kvservice_module_imports() -> None:
    """What the device check runs before its first step; here, in this venv, it passes."""
    done = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "device_deps.py"), "check"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "every kvservice module imports" in done.stderr
