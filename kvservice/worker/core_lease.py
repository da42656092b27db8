"""Turns on shared cores: workers on one host that compute on the same cores take turns.

Two processes that each run a thread per core on the same cores stall each other: every
parallel region of a step waits for its slowest thread, and the OS has just given that
thread's core to the other process. `kvservice launch` on 2 cores (one prefill and one
decode worker, SmolLM2, concurrency 16): decode steps of 9 requests took 125-255 ms instead
of ~25 ms while the prefill worker ran its 2,048-token steps, and both ran at a fraction of
their speed.

So such workers take turns through a lease on a file all of them open (`--core-lease`):
- a decode worker holds the turn for each of its steps, which are short (tens of ms);
- a prefill worker holds it while it computes and, at the pause points between the
  model's matmuls, hands it over once a decode step waits and running on to the next pause
  point would take it past its quantum (what follows each point was timed in the step's
  earlier layers, which repeat the same ops on the same rows).
The quantum is what the decode step leaves of the cycle (`DecodeCycle`: the time from one
decode step to the next), the decode step's time being how long the prefill worker waited for
the turn back. A prefill step's first pause point hands over at once: the decode step after it
takes the requests whose first token the previous prefill step produced, a quantum sooner (1P1D
at concurrency 16: mean time from the first to the second token 137-148 -> 84-104 ms). Every
step runs on all cores, and no cycle is spent spinning against the other process.

The turn and the "a decode step waits" signal are POSIX record locks on two bytes of the
file: the kernel drops a process's locks when it dies, so a crashed worker never wedges
the others. Only the engine's step thread may use a lease (record locks belong to the process).
"""

from __future__ import annotations

import contextlib
import enum
import fcntl
import os
import time
from collections.abc import Iterator

_TURN = 0  # held (exclusive) by whoever computes
_WANT = 1  # held (shared) by every decode step waiting for the turn
_HELD = (BlockingIOError, PermissionError)  # a non-blocking lock that another process holds: EAGAIN or EACCES


def prompt_quantum(cycle_s: float, decode_step_s: float) -> float:
    """How long prompts may compute before the next decode step: what the last decode step left
    of `cycle_s`, at least a quarter of it, so a slow decode step cannot starve the prompts (the
    lease's quantum, and a colocated worker's prompt-lane slice of its step target)."""
    return max(cycle_s - decode_step_s, cycle_s / 4)


class DecodeCycle:
    """The time from one decode step to the next that a prefill worker's quantum aims at.

    The cycle is `target_s` (`--step-target-ms`) or, where decode steps are slow, three of them
    (smoothed): while prompts wait, decode takes at most about a third of the cores. On 2 Zen 5
    cores a decode step of 16 requests takes ~21 ms and the 70 ms target holds. On 2 Zen 3 cores
    (AVX2) `launch`'s decode steps of 8.6 requests took 33 ms: the 70 ms cycle left the prompts
    so little that half the clients waited for their first token (mean TTFT 7.1-7.3 s) and the
    decode batch stayed small (by Little's law it holds the tokens/s times 128 times the cycle).
    Three decode steps there, bench peers' 1P1D load, alternating with the 70 ms cycle: 138.3,
    150.3, 148.9 against 138.0, 132.8, 133.4 output tok/s; decode batches of 10.8-11.0 requests
    against 8.8-8.9; mean TTFT 4.8-5.2 against 6.6-7.0 s; p99 ITL 124-151 against 100-103 ms
    (vLLM's there: 248-281). A colocated worker's prompt lane keeps its step target: the same rule
    there gave 139.2, 148.8 against 139.7, 153.3 tok/s (its decode batches 11.1 against 10.0-10.5
    requests already) and a p99 ITL of 131-140 against 89-113 ms."""

    STEPS = 3.0  # the cycle is at least this many (smoothed) decode steps
    SMOOTHING = 0.2  # weight of the latest decode step in the smoothed one

    def __init__(self, target_s: float) -> None:
        if not target_s > 0:
            raise ValueError(f"target_s must be > 0, got {target_s}")
        self.target_s = target_s
        self.decode_step_s: float | None = None  # smoothed

    def observe(self, decode_step_s: float) -> None:
        """A decode step took `decode_step_s`."""
        smoothed = self.decode_step_s
        self.decode_step_s = (
            decode_step_s if smoothed is None else smoothed + self.SMOOTHING * (decode_step_s - smoothed)
        )

    @property
    def cycle_s(self) -> float:
        return max(self.target_s, self.STEPS * (self.decode_step_s or 0.0))


class LeaseRole(enum.Enum):
    FIRST = "first"  # decode: its steps take the turn as soon as it is handed over
    YIELDING = "yielding"  # prefill: hands the turn over at pause points


class CoreLease:
    """One worker's end of the lease at `path` (created if missing)."""

    def __init__(self, path: str, role: LeaseRole, target_s: float) -> None:
        self.path, self.role = path, role
        self.cycle = DecodeCycle(target_s)
        self.quantum_s = target_s  # until a decode step has been timed
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        self._held_since: float | None = None
        self._last_pause: tuple[str, float] | None = None  # this step's last pause point, and when
        self._segment_s: dict[str, float] = {}  # this step: how long the ops after each named point took
        self.num_handovers = 0  # times a yielding worker handed the turn over
        # When set (`StepTrace`): (asked, taken, released) for each time this process held the turn.
        self.turn_log: list[tuple[float, float, float]] | None = None
        self._asked = self._taken = 0.0

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)  # drops every lock this process holds on the file
            self._fd = -1

    @contextlib.contextmanager
    def turn(self) -> Iterator[None]:
        """Hold the turn for one step."""
        self._asked = time.monotonic()
        if self.role is LeaseRole.FIRST:
            self._take_first()  # its steps never pause: nothing to time
        else:
            fcntl.lockf(self._fd, fcntl.LOCK_EX, 1, _TURN)
            # The step's first pause point hands over to a waiting decode step at once: that one
            # can take the requests whose first token the previous step produced (their KV was
            # pulled meanwhile), a quantum sooner.
            self._held_since = time.monotonic() - self.quantum_s
        self._taken = time.monotonic()
        try:
            yield
        finally:
            self._held_since = self._last_pause = None
            self._segment_s.clear()
            self._log_turn()
            fcntl.lockf(self._fd, fcntl.LOCK_UN, 1, _TURN)

    def pause(self, next_op: str) -> None:
        """A pause point of a yielding worker's step, before `next_op`: hand the turn over if a
        decode step waits and `next_op` would end past the quantum; take it back after that step."""
        now = time.monotonic()
        if self._last_pause is not None:
            self._segment_s[self._last_pause[0]] = now - self._last_pause[1]
        self._last_pause = (next_op, now)
        held_since = self._held_since
        if (
            held_since is None
            or now - held_since + self._segment_s.get(next_op, 0.0) < self.quantum_s
            or not self.others_wait()
        ):
            return
        self.num_handovers += 1
        self._asked = self._log_turn()  # the turn ends here, and the wait for the next starts
        # Blocked in the kernel until every waiting decode step holds the turn (each drops its
        # share of _WANT once it does, and only then is _WANT free to lock exclusively), then
        # until the turn comes back; again while another decode step queued meanwhile. Polling
        # for that woke this thread every 0.2 ms of the decode step, each time taking a core
        # from the step it was waiting for.
        while True:
            fcntl.lockf(self._fd, fcntl.LOCK_UN, 1, _TURN)
            fcntl.lockf(self._fd, fcntl.LOCK_EX, 1, _WANT)
            fcntl.lockf(self._fd, fcntl.LOCK_UN, 1, _WANT)
            fcntl.lockf(self._fd, fcntl.LOCK_EX, 1, _TURN)
            if not self.others_wait():
                break
        self._held_since = self._taken = time.monotonic()
        self._last_pause = (next_op, self._held_since)
        waited = self._held_since - now
        self.cycle.observe(waited)
        self.quantum_s = prompt_quantum(self.cycle.cycle_s, waited)

    def _log_turn(self) -> float:
        """Log the turn that ends now (when tracing); returns now."""
        now = time.monotonic()
        if self.turn_log is not None:
            self.turn_log.append((self._asked, self._taken, now))
        return now

    def others_wait(self) -> bool:
        """Whether a decode step waits for the turn."""
        try:
            fcntl.lockf(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, _WANT)
        except _HELD:
            return True
        fcntl.lockf(self._fd, fcntl.LOCK_UN, 1, _WANT)
        return False

    def _take_first(self) -> None:
        try:
            fcntl.lockf(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, _TURN)
            return
        except _HELD:
            pass
        fcntl.lockf(self._fd, fcntl.LOCK_SH, 1, _WANT)  # tells the holder to hand over
        try:
            fcntl.lockf(self._fd, fcntl.LOCK_EX, 1, _TURN)
        finally:
            fcntl.lockf(self._fd, fcntl.LOCK_UN, 1, _WANT)
