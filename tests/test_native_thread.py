"""Threads carry their names into the OS, where `top -H`, `perf` and scripts/sched_trace.py see them."""

from __future__ import annotations

import pathlib
import sys
import threading

import pytest
import torch
from conftest import require_cpu_kernels

from kvservice.runtime.native_thread import name_native_thread

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="thread names in /proc are Linux's")


def _native_names() -> list[str]:
    return [(task / "comm").read_text().strip() for task in pathlib.Path("/proc/self/task").iterdir()]


def _named_in(name: str | None, python_name: str = "engine-step") -> str:
    """The OS's name of a thread after it called name_native_thread(name)."""
    seen: list[str] = []

    def run() -> None:
        name_native_thread(name)
        seen.append(pathlib.Path(f"/proc/self/task/{threading.get_native_id()}/comm").read_text().strip())

    thread = threading.Thread(target=run, name=python_name)
    thread.start()
    thread.join()
    return seen[0]


def test_a_thread_takes_its_python_name_or_the_one_given() -> None:
    assert _named_in(None) == "engine-step"
    assert _named_in("kv-transfer") == "kv-transfer"


def test_a_long_name_is_cut_to_what_the_kernel_keeps() -> None:
    assert _named_in("a-name-longer-than-fifteen-bytes") == "a-name-longer-t"


def test_the_kernel_pool_workers_are_named() -> None:
    require_cpu_kernels()
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        torch.ops.kvservice.silu_mul(torch.ones(4096, 512))  # rows enough for both threads: the pool starts its worker
    finally:
        torch.set_num_threads(threads)
    assert "kvs-pool" in _native_names()
