"""The C++ kernels' build key, the compute path a worker reports, and no silent fallback: a
build that fails stops the tests unless KVSERVICE_ALLOW_TORCH_FALLBACK=1 says it is expected."""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys

import pytest
import torch
from conftest import REPO, require_cpu_kernels

from kvservice.model import cpu_kernels
from kvservice.model.cpu_kernels import (
    ALLOW_FALLBACK_ENV,
    CSRC,
    KERNELS_ENV,
    build_key,
    compile_flags,
    compute_path,
    extension_name,
    kernel_files,
    machine_isa,
)


def copy_of_the_sources(into: pathlib.Path) -> pathlib.Path:
    shutil.copytree(CSRC, into, ignore=shutil.ignore_patterns("__pycache__"))
    return into


def key_of(csrc: pathlib.Path, isa: str = "AVX512") -> str:
    return build_key(kernel_files(csrc), compile_flags(isa), isa)


def test_two_checkouts_with_the_same_sources_share_one_build(tmp_path: pathlib.Path) -> None:
    one = copy_of_the_sources(tmp_path / "checkout-a" / "csrc")
    other = copy_of_the_sources(tmp_path / "elsewhere" / "checkout-b" / "csrc")
    assert key_of(one) == key_of(other) == key_of(CSRC)
    assert extension_name("AVX512", key_of(one)) == extension_name("AVX512", key_of(CSRC))


@pytest.mark.parametrize("edited", ["greedy_head.cpp", "ops.h"])
def test_a_change_in_a_source_or_a_header_is_another_build(tmp_path: pathlib.Path, edited: str) -> None:
    csrc = copy_of_the_sources(tmp_path / "csrc")
    before = key_of(csrc)
    with open(csrc / edited, "a") as f:
        f.write("\n// one more line\n")
    assert key_of(csrc) != before


def test_a_new_header_is_another_build(tmp_path: pathlib.Path) -> None:
    csrc = copy_of_the_sources(tmp_path / "csrc")
    before = key_of(csrc)
    (csrc / "extra.h").write_text("#pragma once\n")
    assert key_of(csrc) != before


def test_the_flags_and_the_isa_are_part_of_the_key() -> None:
    files = kernel_files()
    avx512 = build_key(files, compile_flags("AVX512"), "AVX512")
    assert build_key(files, compile_flags("AVX2"), "AVX2") != avx512
    assert build_key(files, [*compile_flags("AVX512"), "-g"], "AVX512") != avx512
    assert extension_name("AVX2", avx512) != extension_name("AVX512", avx512)


def test_the_compute_path_names_the_loaded_build_and_its_isa() -> None:
    require_cpu_kernels()
    assert compute_path("cpu") == f"cpu-kernels ({machine_isa()})"
    assert compute_path(torch.device("cpu")) == compute_path()


def test_the_compute_path_says_why_pytorch_computes(monkeypatch: pytest.MonkeyPatch) -> None:
    assert compute_path("cuda") == "pytorch (device cuda: the C++ kernels are CPU only)"
    monkeypatch.setattr(cpu_kernels, "_is_loaded", False)
    monkeypatch.delenv(KERNELS_ENV, raising=False)
    monkeypatch.setattr(cpu_kernels, "_build_error", "ninja: command not found")
    assert compute_path() == "pytorch fallback (kernel build failed: ninja: command not found)"
    monkeypatch.setenv(KERNELS_ENV, "torch")
    assert compute_path() == f"pytorch ({KERNELS_ENV}=torch)"


def test_a_kernel_test_fails_without_the_kernels_unless_the_fallback_is_allowed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(cpu_kernels, "_tried", True)
    monkeypatch.setattr(cpu_kernels, "_is_loaded", False)
    monkeypatch.setattr(cpu_kernels, "_build_error", "no compiler")
    monkeypatch.delenv(KERNELS_ENV, raising=False)
    monkeypatch.delenv(ALLOW_FALLBACK_ENV, raising=False)
    with pytest.raises(pytest.fail.Exception, match=f"kernel build failed: no compiler.*{ALLOW_FALLBACK_ENV}=1"):
        require_cpu_kernels()
    monkeypatch.setenv(ALLOW_FALLBACK_ENV, "1")
    with pytest.raises(pytest.skip.Exception, match=f"{ALLOW_FALLBACK_ENV}=1"):
        require_cpu_kernels()


def broken_build_env(tmp_path: pathlib.Path, **extra: str) -> dict[str, str]:
    """The environment of a process whose kernel build fails at once: torch's extension cache
    lies under a plain file, so no build directory can be made (and nothing compiles)."""
    (tmp_path / "file").touch()
    env = {k: v for k, v in os.environ.items() if k not in (ALLOW_FALLBACK_ENV, KERNELS_ENV)}
    return {**env, "TORCH_EXTENSIONS_DIR": str(tmp_path / "file" / "cache"), **extra}


def run(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=240, check=False
    )


def test_make_tests_kernel_step_fails_when_the_build_fails(tmp_path: pathlib.Path) -> None:
    """`python -m kvservice.model.cpu_kernels`, the step `make test` runs first."""
    failed = run(broken_build_env(tmp_path), "-m", "kvservice.model.cpu_kernels")
    assert failed.returncode == 1, failed.stdout + failed.stderr
    assert "pytorch fallback (kernel build failed" in failed.stdout
    assert f"{ALLOW_FALLBACK_ENV}=1" in failed.stderr
    allowed = run(broken_build_env(tmp_path, **{ALLOW_FALLBACK_ENV: "1"}), "-m", "kvservice.model.cpu_kernels")
    assert allowed.returncode == 0, allowed.stdout + allowed.stderr
    assert f"as {ALLOW_FALLBACK_ENV}=1 allows" in allowed.stdout
    on_purpose = run(broken_build_env(tmp_path, **{KERNELS_ENV: "torch"}), "-m", "kvservice.model.cpu_kernels")
    assert on_purpose.returncode == 0, on_purpose.stdout + on_purpose.stderr
    assert f"CPU compute path: pytorch ({KERNELS_ENV}=torch)" in on_purpose.stdout


def test_a_test_session_stops_before_any_test_when_the_build_fails(tmp_path: pathlib.Path) -> None:
    """Without the opt-out no test runs, the kernel tests' skips included; with it they skip
    naming it."""
    kernel_test = "tests/test_model.py::test_silu_mul_refuses_an_odd_width"
    pytest_args = ("-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", kernel_test)
    stopped = run(broken_build_env(tmp_path), *pytest_args)
    output = stopped.stdout + stopped.stderr
    assert stopped.returncode == pytest.ExitCode.TESTS_FAILED, output
    assert "the C++ CPU kernels did not build here" in output and f"{ALLOW_FALLBACK_ENV}=1" in output
    assert "skipped" not in output and "passed" not in output
    skipped = run(broken_build_env(tmp_path, **{ALLOW_FALLBACK_ENV: "1"}), *pytest_args)
    output = skipped.stdout + skipped.stderr
    assert skipped.returncode == pytest.ExitCode.OK, output
    assert "1 skipped" in output and f"{ALLOW_FALLBACK_ENV}=1: the C++ CPU kernels are unavailable" in output
