"""`kvservice launch` leaves no orphans: its children die with it, even when it is SIGKILLed,
and a SIGTERM during start-up stops what has already started."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import sys
import time

import pytest

from kvservice.runtime.process_env import WORKER_ENV

pytestmark = [pytest.mark.slow, pytest.mark.asyncio, pytest.mark.timeout(180)]

LAUNCH = [
    sys.executable,
    "-m",
    "kvservice",
    "launch",
    "--model",
    "tiny",
    "--port",
    "0",
    "--grace-period",
    "5",
    "--",
    "--num-threads",
    "1",
    "--num-blocks",
    "32",
]


def _is_alive(pid: int) -> bool:
    """Running (a zombie waiting for init to reap it counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _children_of(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        found.append(int(entry))
            except (FileNotFoundError, ProcessLookupError):
                pass
    return found


async def _wait_gone(pids: list[int], timeout: float) -> list[int]:
    """The pids still alive after `timeout` (polling /proc: they are not our children)."""
    deadline = time.monotonic() + timeout
    while (alive := [p for p in pids if _is_alive(p)]) and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    return alive


def _core_lease_paths(pid: int) -> list[str]:
    """The --core-lease path in a process's command line, if any."""
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        argv = f.read().decode().split("\0")
    return [argv[i + 1] for i, arg in enumerate(argv[:-1]) if arg == "--core-lease"]


def _kill_all(pids: list[int]) -> None:
    for pid in pids:
        if _is_alive(pid):
            os.kill(pid, signal.SIGKILL)


async def test_children_die_with_a_sigkilled_launcher() -> None:
    launcher = await asyncio.create_subprocess_exec(
        *LAUNCH, stdout=asyncio.subprocess.PIPE, env={**os.environ, **WORKER_ENV}
    )
    assert launcher.stdout is not None
    pids: list[int] = []
    try:
        while len(pids) < 3:  # the ready report: one line per child with its pid
            line = (await asyncio.wait_for(launcher.stdout.readline(), 120)).decode()
            assert line, "the launcher exited before it was ready"
            pids += [int(p) for p in re.findall(r"\(pid (\d+)", line)]
        assert all(_is_alive(p) for p in pids)
        leases = {path for pid in pids for path in _core_lease_paths(pid)}
        assert leases, "the prefill and decode workers share a core lease"
        launcher.kill()
        await launcher.wait()
        assert await _wait_gone(pids, 30) == [], "children outlived their launcher"
        assert not any(os.path.exists(path) for path in leases), "the lease file outlived the launcher"
    finally:
        _kill_all(pids)
        if launcher.returncode is None:
            launcher.kill()
            await launcher.wait()


async def test_sigterm_during_start_up_stops_what_started() -> None:
    launcher = await asyncio.create_subprocess_exec(
        *LAUNCH, stdout=asyncio.subprocess.PIPE, env={**os.environ, **WORKER_ENV}
    )
    children: list[int] = []
    try:
        deadline = time.monotonic() + 60
        while not (children := _children_of(launcher.pid)):  # a child has been spawned
            assert time.monotonic() < deadline and launcher.returncode is None
            await asyncio.sleep(0.02)
        launcher.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        assert await asyncio.wait_for(launcher.wait(), 60) != 0  # it never got to serve
        # Not after the rest had started: a tiny cluster takes several seconds to start here.
        assert time.monotonic() - signalled < 4
        assert await _wait_gone(children, 10) == []
    finally:
        _kill_all(children)
        if launcher.returncode is None:
            launcher.kill()
            await launcher.wait()
