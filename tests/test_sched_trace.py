"""scripts/sched_trace.py's accounting, on a hand-made trace whose answer is known."""

from __future__ import annotations

import pytest
from conftest import load_repo_module

sched_trace = load_repo_module("scripts/sched_trace.py", "sched_trace")

STEP, POOL, LOOP = 101, 102, 103  # one decode worker (pid 100): its two compute threads and its event loop
_FUTEX = "\t        7f00 __futex_abstimed_wait_common (/usr/lib/x86_64-linux-gnu/libc.so.6)\n"
_EPOLL = "\t        7f10 epoll_wait (/usr/lib/x86_64-linux-gnu/libc.so.6)\n"
_KERNEL = "\tffffffff82248208 __schedule ([kernel.kallsyms])\n"


def _switch(time: float, cpu: int, prev: tuple[str, int], state: str, nxt: tuple[str, int], frames: str = "") -> str:
    (prev_comm, prev_tid), (next_comm, next_tid) = prev, nxt
    pid = 100 if prev_tid else 0
    return (
        f"{prev_comm:>16} {pid}/{prev_tid} [{cpu:03d}] {time:.6f}: sched:sched_switch: "
        f"prev_comm={prev_comm} prev_pid={prev_tid} prev_prio=120 prev_state={state} ==> "
        f"next_comm={next_comm} next_pid={next_tid} next_prio=120\n{_KERNEL}{frames}\n"
    )


IDLE, STEP_T, POOL_T, LOOP_T = ("swapper/0", 0), ("engine-step", STEP), ("kvs-pool", POOL), ("python", LOOP)
TRACE = "".join(
    (
        _switch(1.000, 0, IDLE, "R", STEP_T),  # the step thread runs on CPU 0
        _switch(1.001, 1, POOL_T, "S", IDLE, _FUTEX),  # its pool worker sleeps: CPU 1 idles, the step computes alone
        _switch(1.003, 0, STEP_T, "R", LOOP_T),  # the event loop preempts the step thread
        _switch(1.004, 0, LOOP_T, "S", STEP_T, _EPOLL),  # and gives CPU 0 back
        _switch(1.006, 0, STEP_T, "S", IDLE, _FUTEX),  # the step thread waits: both CPUs idle
        _switch(1.010, 1, IDLE, "R", POOL_T),  # the pool worker runs on CPU 1
        _switch(1.011, 0, IDLE, "R", STEP_T),
    )
)


def test_parse_reads_each_switch_and_the_frame_that_blocked() -> None:
    switches, names, pids = sched_trace.parse(TRACE)
    assert [(s.cpu, s.prev, s.prev_state, s.next) for s in switches[:3]] == [
        (0, 0, "R", STEP),
        (1, POOL, "S", 0),
        (0, STEP, "R", LOOP),
    ]
    assert switches[1].user_frame == "__futex_abstimed_wait_common"
    assert names[STEP] == "engine-step" and names[POOL] == "kvs-pool" and pids[STEP] == 100


def test_account_splits_on_cpu_off_cpu_and_idle_time() -> None:
    switches, _, _ = sched_trace.parse(TRACE)
    totals = sched_trace.account(switches, {STEP, POOL})
    assert totals.window == pytest.approx(0.011) and totals.num_cpus == 2
    assert totals.on_cpu[STEP] == pytest.approx(0.003 + 0.002) and totals.on_cpu[LOOP] == pytest.approx(0.001)
    assert totals.off_cpu[(STEP, "preempted")] == pytest.approx(0.001)
    assert totals.off_cpu[(STEP, "futex (GIL, pool idle)")] == pytest.approx(0.005)
    assert totals.off_cpu[(POOL, "futex (GIL, pool idle)")] == pytest.approx(0.009)
    assert totals.idle["compute running on the other CPU"] == pytest.approx(0.002 + 0.002 + 0.001)
    assert totals.idle["a compute thread preempted"] == pytest.approx(0.001)
    assert totals.idle["no compute thread runnable"] == pytest.approx(0.004 + 0.004)
