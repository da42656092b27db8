"""The KV transfer registry's errors, apart from the registry (no torch): the servers' status
mapping imports them, including in the proxy, which runs no registry."""

from __future__ import annotations


class TransferError(Exception):
    """Base of the registry's errors; each maps to one gRPC status code at the edge."""


class TransferNotFound(TransferError):
    pass


class TransferDenied(TransferError):
    pass


class StagingExhausted(TransferError):
    pass


class TransferInvalid(TransferError):
    """The pull asked for something no transfer has (a block past the prompt)."""
