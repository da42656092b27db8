"""Serving threads a step below compute threads in the CPU scheduler's eyes.

A worker's engine step runs on every core (its step thread and the C++ pool's), and each
parallel region waits for its slowest thread. Its serving threads (the event loop, gRPC's, the KV
transfer's) and the proxy's wake up many times a step and, at equal priority, take a core from a
compute thread at once: the region then waits for that thread, its other core idle (a scheduler
trace of 1P1D at concurrency 16: 0.26 s of 12 CPU-s idle behind a preempted compute thread, the
step threads preempted 0.41 and 0.44 s of 6). At nice 5 (a third of the weight) a serving thread
still gets its CPU when it contends, in shorter turns. bench peers' 1P1D workload, 2 Zen 5
cores, five rounds alternating with every thread at nice 0: 352.5, 341.4, 378.9, 364.0, 332.6
against 348.2, 333.6, 361.3, 366.5, 330.7 tok/s (+1.7%), mean TTFT 1.58 against 1.66 s, p99 ITL
74-83 against 75-80 ms. Nice 15 gave nothing (340.3, 327.8 against 342.3, 331.1). As landed
(workers and proxy lower their own serving threads), three rounds against the commit before:
350.2, 360.0, 350.2 against 349.1, 342.4, 343.1 tok/s.

Linux keeps a nice value per thread and a new thread starts with its creator's: lowering the
event loop's thread covers what it starts later. Raising a nice value needs no privilege.
"""

from __future__ import annotations

import os
import pathlib
import sys
from collections.abc import Iterable

SERVING_NICE = 5
COMPUTE_THREAD_NAMES = frozenset(
    {"engine-step", "kvs-pool"}
)  # as kvservice.runtime.native_thread and the C++ pool name them


def lower_serving_threads(compute_thread_ids: Iterable[int] = (), nice: int = SERVING_NICE) -> int:
    """Give every thread of this process but the compute ones (`compute_thread_ids`, and any named
    in COMPUTE_THREAD_NAMES) at least `nice`, the calling thread included; returns how many
    threads changed. Linux only (elsewhere 0); a thread that is gone, or refuses, is left as it is."""
    if not sys.platform.startswith("linux"):
        return 0
    skip = set(compute_thread_ids)
    changed = 0
    for task in pathlib.Path("/proc/self/task").iterdir():
        tid = int(task.name)
        try:
            if tid in skip or (task / "comm").read_text().strip() in COMPUTE_THREAD_NAMES:
                continue
            if os.getpriority(os.PRIO_PROCESS, tid) < nice:
                os.setpriority(os.PRIO_PROCESS, tid, nice)
                changed += 1
        except OSError:
            continue
    return changed
