"""Where a worker that shares its cores with other workers (a core lease) runs its threads.

Workers on a core lease take turns: the holder's compute threads (the engine's step thread
and the C++ pool's workers) use every core, and the serving threads (the event loop, gRPC's
threads, KV transfer) of every process on the host run in between. Two things cost 1P1D on 2
cores (`scripts/sched_trace.py`, 5 s at concurrency 16) about 0.3 s of idle CPU:
- a serving thread woken on a compute thread's CPU preempts it, and the compute thread on
  the other CPU then waits at the parallel region's end with its CPU idle;
- this VM's kernel builds no scheduler domains, so a runnable thread queued behind another
  is not pulled to an idle CPU (two compute threads on one CPU trade it while the other idles).

So, as the engine's threads start (`SharedCorePlacement`): each compute thread is pinned to a CPU
of its own (the step thread to the first the process may use, the pool's workers to the next
ones), and every other thread runs at SCHED_IDLE: only on a CPU no compute thread wants, which
the serving work fits in (~0.5 CPU-s of the ~0.6 s idle in that trace). Threads those make
inherit the class; a thread a compute thread starts later calls `serve_from_idle_time`.
Measured, alternating with the default placement: 372.9, 371.9, 363.7, 362.7 against 356.1,
349.0, 360.5, 354.4 output tok/s. Linux only; a policy the OS refuses is logged, not fatal.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from dataclasses import dataclass

logger = logging.getLogger(__name__)

STEP_THREAD_NAME, POOL_THREAD_NAME = "engine-step", "kvs-pool"  # as AsyncLLMEngine and the C++ pool name them
_is_placed = False


@dataclass(frozen=True, slots=True)
class Placement:
    """What `place_threads` did: compute threads by thread id -> CPU, and the idle-class ones."""

    compute_cpus: dict[int, int]
    idle_thread_ids: list[int]


def place_threads(cpus: list[int] | None = None) -> Placement | None:
    """From the engine's step thread: pin it and the C++ pool's workers a CPU each, and put the
    process's other threads at SCHED_IDLE (see the module's docstring); threads that inherited
    the step thread's name (OpenMP's, rarely busy) stay as they are. None where the OS has no
    such calls. `cpus`: those the process may use (default: the main thread's, which stays unpinned;
    the calling thread's own set is one CPU once placed)."""
    global _is_placed
    if not sys.platform.startswith("linux") or not hasattr(os, "SCHED_IDLE"):
        return None
    cpus = cpus if cpus is not None else sorted(os.sched_getaffinity(os.getpid()))
    threads = sorted(_threads().items())  # (tid, name), oldest first
    compute = [threading.get_native_id(), *(tid for tid, name in threads if name == POOL_THREAD_NAME)]
    placement = Placement({tid: cpus[i % len(cpus)] for i, tid in enumerate(compute)}, [])
    for tid, cpu in placement.compute_cpus.items():
        _apply(lambda t=tid, c=cpu: os.sched_setaffinity(t, {c}), f"pin thread {tid} to CPU {cpu}")
    for tid, name in threads:
        if tid in placement.compute_cpus or name == STEP_THREAD_NAME:
            continue
        if _apply(lambda t=tid: _set_idle(t), f"SCHED_IDLE for thread {tid}"):
            placement.idle_thread_ids.append(tid)
    _is_placed = True
    logger.info("threads placed: compute %s, %d others at SCHED_IDLE", placement.compute_cpus, len(placement.idle_thread_ids))
    return placement


class SharedCorePlacement:
    """Keeps `place_threads`'s placement as threads come: `update` from the step thread after
    each step that computed. The C++ pool starts its workers as jobs first need them, from the
    step thread, whose CPU they inherit; new threads are placed once they appear."""

    def __init__(self) -> None:
        self._placed: set[str] = set()  # thread ids placed so far
        self._cpus = sorted(os.sched_getaffinity(0)) if sys.platform.startswith("linux") else []  # before any pinning
        self.last: Placement | None = None

    def update(self) -> None:
        if not sys.platform.startswith("linux"):
            return
        threads = set(os.listdir("/proc/self/task"))
        if not threads <= self._placed:  # a new thread (others may have ended meanwhile)
            self._placed = threads
            self.last = place_threads(self._cpus)


def serve_from_idle_time() -> None:
    """The calling thread serves (it does no compute): SCHED_IDLE, if this process placed its threads."""
    if _is_placed:
        _apply(lambda: _set_idle(0), "SCHED_IDLE for a serving thread")


def _set_idle(tid: int) -> None:
    os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))


def _apply(action: object, what: str) -> bool:
    try:
        action()  # type: ignore[operator]
    except OSError as e:  # a thread that ended meanwhile, or a policy this OS refuses
        logger.debug("could not %s: %s", what, e)
        return False
    return True


def _threads() -> dict[int, str]:
    """This process's threads: id -> the OS's name."""
    names: dict[int, str] = {}
    for entry in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{entry}/comm") as comm:
                names[int(entry)] = comm.read().strip()
        except OSError:
            continue  # ended meanwhile
    return names
