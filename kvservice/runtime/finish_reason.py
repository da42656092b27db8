"""Why a request ended: the engine's names ("stop", "length", "abort") and the wire's enum,
one table read both ways by the servers, the client and the OpenAI front."""

from __future__ import annotations

from kvservice.v1 import kvservice_pb2 as pb

FINISH_REASONS: dict[str | None, int] = {
    None: pb.FINISH_REASON_UNSPECIFIED,
    "stop": pb.FINISH_REASON_STOP,
    "length": pb.FINISH_REASON_LENGTH,
    "abort": pb.FINISH_REASON_ABORT,
}
_NAMES: dict[int, str | None] = {value: name for name, value in FINISH_REASONS.items()}


def finish_reason_to_proto(reason: str | None) -> int:
    """The enum of an engine finish reason. "error" never reaches the wire as a reason:
    it becomes a status code, so it maps to UNSPECIFIED like any unknown name."""
    return FINISH_REASONS.get(reason, pb.FINISH_REASON_UNSPECIFIED)


def finish_reason_from_proto(value: int) -> str | None:
    """The name of a wire finish reason; None while the request is still running."""
    return _NAMES.get(value)
