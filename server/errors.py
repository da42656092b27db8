"""Exceptions to gRPC status codes, in one place."""

from __future__ import annotations

import asyncio

import grpc

from kvservice.connector.transfer_errors import StagingExhausted, TransferDenied, TransferNotFound
from kvservice.engine.errors import EngineDeadError, QueueFull
from kvservice.server.kv_events import PublisherClosed, SubscriberTooSlow


class RequestFailed(Exception):
    """A request the engine ended with an error (e.g. its KV load failed under policy `fail`)."""


class StreamLost(Exception):
    """A request's decode stream broke and could not move to another worker; the message says why."""


class NoWorkerAvailable(Exception):
    """The proxy has no healthy worker of a role it needs."""


class Overloaded(Exception):
    """Admission control: the queue is full."""


class ShuttingDown(Exception):
    """The server is draining: it finishes what it has but takes nothing new."""


class PeerNotAllowed(Exception):
    """A decode request names a prefill worker this decode worker may not dial."""


_CODES: list[tuple[type[BaseException], grpc.StatusCode]] = [
    (StagingExhausted, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (Overloaded, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (QueueFull, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (SubscriberTooSlow, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (TransferDenied, grpc.StatusCode.PERMISSION_DENIED),
    (PeerNotAllowed, grpc.StatusCode.PERMISSION_DENIED),
    (TransferNotFound, grpc.StatusCode.NOT_FOUND),
    (EngineDeadError, grpc.StatusCode.UNAVAILABLE),
    (ShuttingDown, grpc.StatusCode.UNAVAILABLE),
    (PublisherClosed, grpc.StatusCode.UNAVAILABLE),
    (NoWorkerAvailable, grpc.StatusCode.UNAVAILABLE),
    (StreamLost, grpc.StatusCode.UNAVAILABLE),
    (RequestFailed, grpc.StatusCode.INTERNAL),
    (ValueError, grpc.StatusCode.INVALID_ARGUMENT),
    (TimeoutError, grpc.StatusCode.DEADLINE_EXCEEDED),
]


def status_for(error: BaseException) -> grpc.StatusCode:
    if isinstance(error, grpc.aio.AioRpcError):
        return error.code()
    for kind, code in _CODES:
        if isinstance(error, kind):
            return code
    return grpc.StatusCode.INTERNAL


def message_for(error: BaseException) -> str:
    if isinstance(error, grpc.aio.AioRpcError):
        return error.details() or error.code().name
    return str(error) or type(error).__name__


async def abort_with(context: grpc.aio.ServicerContext, error: BaseException) -> None:
    """End the RPC with the status that fits `error` (never for CancelledError: re-raise that)."""
    assert not isinstance(error, asyncio.CancelledError)
    await context.abort(status_for(error), message_for(error))
