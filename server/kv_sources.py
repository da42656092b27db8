"""Which workers a worker may dial for KV, and the `kv_transfer_params` a request's KV sources become.

A worker dials only peers it may trust: a plain HOST:PORT (never a `unix:` path or another
scheme), named by a request that passed the bearer token check, and within `--kv-peers` when
that allow-list is given. Two sources exist: a decode worker's prefill worker (the whole prompt
and its first token), and a prefix source (`PrefixSource`: leading blocks another worker staged
with ExportKV), which any worker that pulls may be given.
"""

from __future__ import annotations

import re
from typing import Any

from kvservice.connector.base import PREFIX_ADDRESS, PREFIX_LAST_HASH, PREFIX_NUM_TOKENS, PREFIX_ROLE, PREFIX_TOKEN
from kvservice.server.errors import PeerNotAllowed
from kvservice.v1 import kvservice_pb2 as pb

_HOST_PORT = re.compile(r"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.-]+):[0-9]{1,5}")
_MAX_ADDRESS_CHARS = 256
# gRPC reads "unix:1234" as the socket path "1234", not host "unix" port 1234.
_GRPC_SCHEMES = frozenset({"unix", "unix-abstract", "vsock", "ipv4", "ipv6", "dns", "xds", "google-c2p"})


def check_kv_peer(address: str, kv_peers: frozenset[str] | None, field: str = "kv_transfer_params") -> None:
    """Raise unless this worker may dial `address` for a KV pull (`field` names it in the error)."""
    match = _HOST_PORT.fullmatch(address) if len(address) <= _MAX_ADDRESS_CHARS else None
    if match is None or match.group(1).lower() in _GRPC_SCHEMES:
        raise ValueError(f"{field}.remote_address: expected HOST:PORT, got {address[:64]!r}")
    if kv_peers is not None and address not in kv_peers:
        raise PeerNotAllowed(f"{field}.remote_address: {address} is not one of this worker's --kv-peers")


def prefix_source_params(source: pb.PrefixSource, kv_peers: frozenset[str] | None = None) -> dict[str, Any]:
    """A request's prefix source, checked, as `kv_transfer_params` entries; ValueError (or
    PeerNotAllowed) names what is wrong."""
    if not source.transfer_token or not source.num_tokens:
        raise ValueError("prefix_source: transfer_token and num_tokens are required")
    check_kv_peer(source.remote_address, kv_peers, "prefix_source")
    return {
        PREFIX_ADDRESS: source.remote_address,
        PREFIX_TOKEN: source.transfer_token,
        PREFIX_NUM_TOKENS: source.num_tokens,
        PREFIX_LAST_HASH: source.last_block_hash,
        PREFIX_ROLE: source.source_role or "decode",
    }
