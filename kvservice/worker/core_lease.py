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
The quantum is what the decode step leaves of `target_s` (the time from one decode step to
the next: `--step-target-ms`, as a colocated worker's mixed steps), the decode step's time
being how long the prefill worker waited for the turn back; at least a quarter of it, so a
slow decode step cannot starve the prompts. A prefill step's first pause point hands over at
once: the decode step after it takes the requests whose first token the previous prefill step
produced, a quantum sooner (1P1D at concurrency 16: mean time from the first to the second token
137-148 -> 84-104 ms). Every step runs on all cores, and no cycle is spent spinning against
the other process.

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


def prompt_quantum(target_s: float, decode_step_s: float) -> float:
    """How long prompts may compute before the next decode step: what the last decode step left
    of `target_s`, at least a quarter of it, so a slow decode step cannot starve the prompts
    (the lease's quantum, and a colocated worker's prompt-lane slice)."""
    return max(target_s - decode_step_s, target_s / 4)


class LeaseRole(enum.Enum):
    FIRST = "first"  # decode: its steps take the turn as soon as it is handed over
    YIELDING = "yielding"  # prefill: hands the turn over at pause points


class CoreLease:
    """One worker's end of the lease at `path` (created if missing)."""

    def __init__(self, path: str, role: LeaseRole, target_s: float) -> None:
        if not target_s > 0:
            raise ValueError(f"target_s must be > 0, got {target_s}")
        self.path, self.role, self.target_s = path, role, target_s
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
        if held_since is None or now - held_since + self._segment_s.get(next_op, 0.0) < self.quantum_s or not self.others_wait():
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
        self.quantum_s = prompt_quantum(self.target_s, self._held_since - now)

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
