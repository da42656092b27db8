#!/usr/bin/env python3
"""Where the cores' time goes while kvservice serves: compute threads, serving threads, idle.

    .venv/bin/python scripts/sched_trace.py record [--seconds 5] [--delay 0] [-o sched.data]
    .venv/bin/python scripts/sched_trace.py report [sched.data]

`record` saves every context switch on the machine for `--seconds` (`perf record -e
sched:sched_switch`, after `--delay`: start it with a benchmark that loads the servers), and which
kvservice process each pid was. `report` reads them afterwards (perf's decoding takes CPU-seconds:
done during the benchmark, it would slow what is measured) and prints:
- on-CPU seconds per process (its `--role`, or `proxy`, `launch`, `bench`) and thread name: the
  compute threads are `engine-step` and the C++ pool's `kvs-pool` (OpenMP's threads, started from
  the step thread, inherit its name); the rest serve (`python`: the event loop, gRPC's threads,
  `kv-transfer`, `kv-stage_0`);
- each compute thread's off-CPU time by cause: the core lease (`fcntl`), a futex (the GIL, or a
  pool worker with no job), or preempted (runnable, but another thread had its CPU);
- the idle CPU time, by what the compute threads were doing meanwhile: one of them runnable but
  preempted (on this machine's kernel a waiting thread is not pulled to an idle CPU), one running
  alone (single-threaded Python between kernels), or none runnable.

Needs `perf` and the right to trace the scheduler (root, or kernel.perf_event_paranoid <= -1).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import pathlib
import re
import subprocess
import sys
import time
from dataclasses import dataclass

COMPUTE_THREADS = ("engine-step", "kvs-pool")
_EVENT = re.compile(
    r"^\s*(?P<comm>.*?)\s+(?P<pid>-?\d+)/(?P<tid>\d+)\s+\[(?P<cpu>\d+)\]\s+(?P<time>[\d.]+):\s+sched:sched_switch:\s+(?P<trace>.*)$"
)
_SWITCH = re.compile(
    r"prev_comm=(?P<prev_comm>.*) prev_pid=(?P<prev>\d+) prev_prio=\d+ prev_state=(?P<state>\S+) ==> "
    r"next_comm=(?P<next_comm>.*) next_pid=(?P<next>\d+) next_prio=\d+"
)


@dataclass(frozen=True, slots=True)
class Switch:
    time: float
    cpu: int
    prev: int
    prev_state: str
    next: int
    user_frame: str  # the innermost user-space frame of the thread switched out ("" if none)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    record_args = commands.add_parser("record", help="record the scheduler's switches")
    record_args.add_argument("--seconds", type=float, default=5.0, help="how long to record (default: 5)")
    record_args.add_argument("--delay", type=float, default=0.0, help="wait this long first (default: 0)")
    record_args.add_argument(
        "-o",
        "--output",
        type=pathlib.Path,
        default=pathlib.Path("sched.data"),
        help="perf's data file (default: sched.data)",
    )
    report_args = commands.add_parser("report", help="where the recorded time went")
    report_args.add_argument(
        "data",
        type=pathlib.Path,
        nargs="?",
        default=pathlib.Path("sched.data"),
        help="what record saved (default: sched.data)",
    )
    args = parser.parse_args()
    roles_file = (args.output if args.command == "record" else args.data).with_suffix(".roles.json")
    if args.command == "record":
        time.sleep(args.delay)  # the caller's choice of when to look, not synchronisation
        roles_file.write_text(json.dumps(process_roles()))
        subprocess.run(
            [
                "perf",
                "record",
                "-q",
                "-e",
                "sched:sched_switch",
                "-a",
                "-g",
                "-o",
                str(args.output),
                "--",
                "sleep",
                str(args.seconds),
            ],
            check=True,
            stdout=subprocess.DEVNULL,
        )
        return
    roles = {int(pid): role for pid, role in json.loads(roles_file.read_text()).items()}
    script = subprocess.run(
        ["perf", "script", "-i", str(args.data), "-F", "comm,pid,tid,cpu,time,event,trace,ip,sym,dso"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    switches, names, pids = parse(script)
    report(switches, {tid: f"{roles.get(pids.get(tid, -1), 'other')}/{name}" for tid, name in names.items()})


def process_roles() -> dict[int, str]:
    """pid -> what a kvservice process is, from its command line."""
    roles: dict[int, str] = {}
    for entry in pathlib.Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        words = [a.decode(errors="replace") for a in argv]
        if not any("kvservice" in w for w in words):
            continue
        role = next((words[i + 1] for i, w in enumerate(words[:-1]) if w == "--role"), None)
        roles[int(entry.name)] = role or next((w for w in ("proxy", "launch", "bench") if w in words), "kvservice")
    return roles


def parse(script: str) -> tuple[list[Switch], dict[int, str], dict[int, int]]:
    """perf script's switches, each thread's last name, and each thread's process."""
    switches: list[Switch] = []
    names: dict[int, str] = {}
    pids: dict[int, int] = {}
    header: re.Match[str] | None = None
    frames: list[str] = []

    def flush() -> None:
        if header is None:
            return
        switch = _SWITCH.search(header["trace"])
        if switch is None:
            return
        user = [f for f in frames if "kernel.kallsyms" not in f]
        prev, nxt = int(switch["prev"]), int(switch["next"])
        names[prev], names[nxt] = switch["prev_comm"], switch["next_comm"]
        pids[int(header["tid"])] = int(header["pid"])
        symbol = user[0].split(None, 1)[1] if user and len(user[0].split(None, 1)) > 1 else ""
        switches.append(
            Switch(
                float(header["time"]), int(header["cpu"]), prev, switch["state"], nxt, re.sub(r"\s*\(.*", "", symbol)
            )
        )

    for line in script.splitlines():
        if line.startswith(("\t", " " * 8)) and header is not None:
            frames.append(line.strip())
            continue
        flush()
        header, frames = _EVENT.match(line), []
    flush()
    return switches, names, pids


def off_cpu_cause(switch: Switch) -> str:
    if switch.prev_state.startswith("R"):
        return "preempted"
    if "fcntl" in switch.user_frame:
        return "core lease"
    if "futex" in switch.user_frame or "lll_lock" in switch.user_frame:
        return "futex (GIL, pool idle)"
    return switch.user_frame or "kernel"


@dataclass
class Accounting:
    """What `account` sums over a trace, in seconds."""

    window: float
    num_cpus: int
    on_cpu: collections.Counter[int]  # thread -> time on a CPU
    off_cpu: collections.Counter[tuple[int, str]]  # (thread, cause) -> time off it
    idle: collections.Counter[str]  # what the compute threads did -> idle CPU time meanwhile


def account(switches: list[Switch], compute: set[int]) -> Accounting:
    """Sum a trace's switches; `compute`: the compute threads. Time before a thread's first
    switch is not counted (its state then is unknown)."""
    on_cpu, off_cpu = _thread_times(switches)
    idle = _idle_times(switches, compute)
    window = switches[-1].time - switches[0].time if switches else 0.0
    return Accounting(window, len({s.cpu for s in switches}), on_cpu, off_cpu, idle)


def _thread_times(
    switches: list[Switch],
) -> tuple[collections.Counter[int], collections.Counter[tuple[int, str]]]:
    """Each thread's time on a CPU, and its time off it by cause."""
    on_cpu: collections.Counter[int] = collections.Counter()
    off_cpu: collections.Counter[tuple[int, str]] = collections.Counter()
    since: dict[int, float] = {}  # thread -> when it went on (or off) its CPU
    away: dict[int, str] = {}  # thread -> why it is off CPU
    for s in switches:
        if s.prev in since and s.prev not in away:
            on_cpu[s.prev] += s.time - since[s.prev]
        if s.next in away:
            off_cpu[(s.next, away.pop(s.next))] += s.time - since[s.next]
        since[s.prev] = since[s.next] = s.time
        if s.prev != 0:
            away[s.prev] = off_cpu_cause(s)
    return on_cpu, off_cpu


def _idle_times(switches: list[Switch], compute: set[int]) -> collections.Counter[str]:
    """Idle CPU time, by what the compute threads did meanwhile."""
    idle: collections.Counter[str] = collections.Counter()
    state: dict[int, str] = {}  # compute thread -> "running", "preempted" or "sleeping"
    idle_since: dict[int, float] = {}  # idle CPU -> since when (or since the compute threads last changed)

    def doing() -> str:
        states = [state.get(t, "sleeping") for t in compute]
        if "preempted" in states:
            return "a compute thread preempted"
        return "compute running on the other CPU" if "running" in states else "no compute thread runnable"

    for s in switches:
        label = doing()
        for start in idle_since.values():
            idle[label] += s.time - start
        idle_since = {cpu: s.time for cpu in idle_since if cpu != s.cpu}
        if s.prev in compute:
            state[s.prev] = "preempted" if s.prev_state.startswith("R") else "sleeping"
        if s.next in compute:
            state[s.next] = "running"
        if s.next == 0:
            idle_since[s.cpu] = s.time
    return idle


def report(switches: list[Switch], labels: dict[int, str]) -> None:
    if not switches:
        sys.exit("no context switches recorded")
    compute = {tid for tid, label in labels.items() if label.split("/", 1)[1] in COMPUTE_THREADS}
    totals = account(switches, compute)
    print(
        f"{totals.window:.2f} s on {totals.num_cpus} CPUs: {totals.window * totals.num_cpus:.2f} CPU-s\n\n"
        "on CPU, by process and thread:"
    )
    by_label: collections.Counter[str] = collections.Counter()
    for tid, seconds in totals.on_cpu.items():
        if tid != 0:
            by_label[labels.get(tid, "other/?")] += seconds
    for label, seconds in by_label.most_common(15):
        print(f"  {seconds:7.3f} s  {label}")
    print(f"  {sum(totals.idle.values()):7.3f} s  idle")
    print("\ncompute threads off CPU, by cause:")
    for tid in sorted(compute, key=lambda t: labels[t]):
        causes = sorted(((cause, v) for (t, cause), v in totals.off_cpu.items() if t == tid), key=lambda x: -x[1])
        print(f"  {labels[tid]} ({tid}): " + ", ".join(f"{cause} {v:.3f} s" for cause, v in causes[:4]))
    print("\nidle CPU time, by what the compute threads did meanwhile:")
    for why, seconds in totals.idle.most_common():
        print(f"  {seconds:7.3f} s  {why}")


if __name__ == "__main__":
    if os.geteuid() != 0 and pathlib.Path("/proc/sys/kernel/perf_event_paranoid").read_text().strip() not in ("-1",):
        print("note: tracing the scheduler usually needs root (or kernel.perf_event_paranoid = -1)", file=sys.stderr)
    main()
