"""The kernels' build lock: a build killed midway no longer makes every later start wait forever."""

from __future__ import annotations

import pathlib
import subprocess
import sys

from kvservice.model.cpu_kernels import one_builder

TRY_LOCK = """
import fcntl, sys
with open(sys.argv[1], "a") as f:
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        sys.exit(3)
"""


def other_process_can_lock(path: pathlib.Path) -> bool:
    done = subprocess.run([sys.executable, "-c", TRY_LOCK, str(path)], timeout=60)
    assert done.returncode in (0, 3)
    return done.returncode == 0


def test_a_killed_builds_lock_file_is_removed_and_the_build_held(tmp_path: pathlib.Path) -> None:
    build_dir = tmp_path / "kvservice_cpu_kernels_x"
    build_dir.mkdir()
    (build_dir / "lock").touch()  # what torch's builder leaves when it is killed mid-build
    with one_builder(build_dir):
        assert not (build_dir / "lock").exists()
        assert not other_process_can_lock(build_dir / "kvservice-build.lock")  # a second start waits
    assert other_process_can_lock(build_dir / "kvservice-build.lock")


def test_a_missing_build_directory_is_created(tmp_path: pathlib.Path) -> None:
    build_dir = tmp_path / "a" / "b"
    with one_builder(build_dir):
        assert build_dir.is_dir()


def test_a_cache_it_cannot_write_still_loads(tmp_path: pathlib.Path) -> None:
    """No lock file can be made (a read-only cache, or here a path under a file): the build goes
    on without the lock, so a cache built elsewhere still loads."""
    (tmp_path / "file").touch()
    entered = False
    with one_builder(tmp_path / "file" / "build"):
        entered = True
    assert entered
