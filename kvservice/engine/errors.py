"""The engine's errors, apart from the engine (no torch): the servers' status mapping imports
them, including in the proxy, which runs no engine."""

from __future__ import annotations


class EngineDeadError(RuntimeError):
    """The step loop failed; the engine serves nothing more."""


class QueueFull(RuntimeError):
    """Admission control: `max_queued_requests` requests already wait; retry later or elsewhere."""
