"""A peer pull's first half, on the proxy: ask the route's prefix source to stage the prompt's
leading blocks it caches (`Worker.ExportKV`), and release them once the request is done.

The prefill worker then pulls them with the token this module made (`pb.PrefixSource` on its
Prefill call). Every failure here only means no peer pull: the prefill worker computes the
prompt as it would have without one.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
from collections.abc import Sequence
from dataclasses import dataclass

import grpc

from kvservice.server.proxy.router import PrefixSource
from kvservice.v1 import kvservice_pb2 as pb

logger = logging.getLogger(__name__)

# ExportKV copies cached blocks on the source's engine thread between steps: a step plus the copy.
EXPORT_TIMEOUT_S = 2.0


@dataclass(frozen=True, slots=True)
class PeerExport:
    """Blocks a source staged for one request: what the puller is told, and whom to release."""

    source: PrefixSource
    request_id: str
    prefix_source: pb.PrefixSource

    async def release(self) -> None:
        """Free the staged blocks now, if nobody pulled them (after a pull, a no-op)."""
        worker = self.source.worker
        with contextlib.suppress(grpc.aio.AioRpcError):
            await worker.stub.ReleaseKV(
                pb.ReleaseKVRequest(request_id=self.request_id, transfer_token=self.prefix_source.transfer_token),
                timeout=EXPORT_TIMEOUT_S,
                metadata=worker.metadata,
            )


async def export_prefix(source: PrefixSource, request_id: str, token_ids: Sequence[int]) -> PeerExport | None:
    """Ask `source` to stage the prompt's cached leading blocks; None when it staged none (it has
    evicted them since its last KV events, its staging is full, or the call failed)."""
    worker = source.worker
    token = secrets.token_bytes(32)
    try:
        response = await worker.stub.ExportKV(
            pb.ExportKVRequest(request_id=request_id, transfer_token=token, prompt_token_ids=token_ids),
            timeout=EXPORT_TIMEOUT_S,
            metadata=worker.metadata,
        )
    except grpc.aio.AioRpcError as e:
        logger.warning(
            "request_id=%s: ExportKV on %s failed (%s: %s); the prefill worker computes the prefix",
            request_id,
            worker.address,
            e.code().name,
            e.details(),
        )
        return None
    if not response.num_tokens:
        logger.info("request_id=%s: %s no longer holds the prefix; computing it", request_id, worker.address)
        return None
    prefix_source = pb.PrefixSource(
        remote_address=worker.address,
        transfer_token=token,
        num_tokens=response.num_tokens,
        last_block_hash=response.last_block_hash,
        source_role=source.role,
    )
    return PeerExport(source, request_id, prefix_source)
