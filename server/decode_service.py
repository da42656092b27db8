"""`Worker.Decode` on a decode worker: pull the prompt's KV from its prefill worker, then generate.

The worker dials only the prefill workers it may trust: a plain HOST:PORT (never a
`unix:` path or another scheme), named by a request that passed the bearer token check,
and within `--kv-peers` when that allow-list is given.
"""

from __future__ import annotations

import logging
import re
from collections.abc import AsyncIterator

import grpc

from kvservice.connector.base import REMOTE_ADDRESS, TRANSFER_TOKEN
from kvservice.core.request import check_request_id
from kvservice.engine.async_engine import AsyncLLMEngine
from kvservice.server.convert import prompt_from_proto, sampling_params_from_proto
from kvservice.server.errors import PeerNotAllowed, abort_with
from kvservice.server.generation import stream_responses
from kvservice.server.kv_events import KVEventPublisher
from kvservice.server.metrics import ServerMetrics
from kvservice.server.worker_service import EngineWorkerService
from kvservice.v1 import kvservice_pb2 as pb

logger = logging.getLogger(__name__)

_HOST_PORT = re.compile(r"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.-]+):[0-9]{1,5}")
_MAX_ADDRESS_CHARS = 256
# gRPC reads "unix:1234" as the socket path "1234", not host "unix" port 1234.
_GRPC_SCHEMES = frozenset({"unix", "unix-abstract", "vsock", "ipv4", "ipv6", "dns", "xds", "google-c2p"})


def check_kv_peer(address: str, kv_peers: frozenset[str] | None) -> None:
    """Raise unless this worker may dial `address` for a KV pull."""
    match = _HOST_PORT.fullmatch(address) if len(address) <= _MAX_ADDRESS_CHARS else None
    if match is None or match.group(1).lower() in _GRPC_SCHEMES:
        raise ValueError(f"kv_transfer_params.remote_address: expected HOST:PORT, got {address[:64]!r}")
    if kv_peers is not None and address not in kv_peers:
        raise PeerNotAllowed(f"kv_transfer_params.remote_address: {address} is not one of this worker's --kv-peers")


class DecodeWorkerService(EngineWorkerService):
    def __init__(
        self, engine: AsyncLLMEngine, metrics: ServerMetrics | None = None, kv_peers: frozenset[str] | None = None,
        kv_events: KVEventPublisher | None = None,
    ) -> None:
        """`kv_peers`: the prefill workers KV may be pulled from; None: any that a request names."""
        super().__init__(engine, "decode", kv_events)
        self.kv_peers = kv_peers
        self.metrics = metrics if metrics is not None else ServerMetrics("decode")

    async def Decode(self, request: pb.DecodeRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateResponse]:
        try:
            inner = request.request
            check_request_id(inner.request_id, "request.request_id")
            with self.metrics.track(inner.request_id, logger) as tracker:
                prompt = prompt_from_proto(inner, self.engine.engine.max_model_len)
                params = sampling_params_from_proto(inner.sampling_params)
                kv_params = None
                if request.HasField("kv_transfer_params"):
                    source = request.kv_transfer_params
                    if not source.remote_address or not source.transfer_token:
                        raise ValueError("kv_transfer_params: remote_address and transfer_token are required")
                    check_kv_peer(source.remote_address, self.kv_peers)
                    kv_params = {REMOTE_ADDRESS: source.remote_address, TRANSFER_TOKEN: source.transfer_token}
                    logger.info("request_id=%s pulls its KV from %s", inner.request_id, source.remote_address)
                async for response in stream_responses(self.engine, prompt, params, inner.request_id, kv_params):
                    tracker.on_tokens(len(response.token_ids))
                    yield response
        except Exception as e:
            await abort_with(context, e)
