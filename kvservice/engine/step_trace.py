"""A record of every engine step's phases, and of every turn the core lease gave, for finding
where a server's time goes (`scripts/step_trace.py` reads them).

Off unless `KVSERVICE_STEP_TRACE` names a directory: each engine then writes
`steps-<pid>.json` there when its process exits. All times are `time.monotonic()`, one clock
for every process on the host, so a prefill worker's turns line up with a decode worker's.
"""

from __future__ import annotations

import atexit
import json
import os
import pathlib
from dataclasses import dataclass, field

TRACE_DIR_ENV = "KVSERVICE_STEP_TRACE"


@dataclass(slots=True)
class StepTrace:
    """steps: (started, scheduled, computing, computed, ended, num_tokens, num_requests) a step
    that computed: the prompt lane's slice and the schedule before `scheduled`, the wait for
    the core lease before `computing`, the forward and sampling to `computed`, outputs to `ended`.
    turns: (asked, taken, released) each time this process held the core lease's turn (a
    prefill step's turn ends at each hand-over and a new one starts when it comes back)."""

    path: pathlib.Path
    lease_role: str | None = None  # the core lease's role ("first": decode, "yielding": prefill), if any
    steps: list[tuple[float, float, float, float, float, int, int]] = field(default_factory=list)
    turns: list[tuple[float, float, float]] = field(default_factory=list)

    @classmethod
    def from_env(cls) -> StepTrace | None:
        """A trace written to $KVSERVICE_STEP_TRACE at exit, or None when that is unset."""
        directory = os.environ.get(TRACE_DIR_ENV)
        if not directory:
            return None
        trace = cls(pathlib.Path(directory) / f"steps-{os.getpid()}.json")
        atexit.register(trace.write)
        return trace

    def write(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(
            json.dumps({"pid": os.getpid(), "lease_role": self.lease_role, "steps": self.steps, "turns": self.turns})
        )
