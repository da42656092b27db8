"""The OS's name for the calling thread, so per-thread tools (`top -H`, `perf`, /proc/PID/task)
tell a worker's threads apart: Python 3.11 names its threads only for itself, and every one
shows as "python" there. `scripts/sched_trace.py` reads these names."""

from __future__ import annotations

import ctypes
import functools
import sys
import threading

_PR_SET_NAME = 15  # prctl(2): name the calling thread
_MAX_NAME_BYTES = 15  # the kernel keeps 16 bytes, the terminating NUL included


def name_native_thread(name: str | None = None) -> None:
    """Give the calling thread `name` (default: its Python name), cut to 15 bytes; Linux only,
    and a no-op where prctl is missing (best effort: a name is for people, not for the code)."""
    if not sys.platform.startswith("linux"):
        return
    encoded = (name if name is not None else threading.current_thread().name).encode("utf-8", "replace")[
        :_MAX_NAME_BYTES
    ]
    try:
        _process_symbols().prctl(_PR_SET_NAME, ctypes.c_char_p(encoded), 0, 0, 0)
    except (OSError, AttributeError):
        return


@functools.cache
def _process_symbols() -> ctypes.CDLL:
    """The symbols already loaded in this process, libc's among them (no library search: on
    Linux, ctypes.util.find_library runs ldconfig in a subprocess)."""
    return ctypes.CDLL(None, use_errno=True)
