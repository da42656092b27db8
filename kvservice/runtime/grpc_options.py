"""The gRPC channel and server options every kvservice process uses (no torch, no engine):
the proxy and the client commands import them without the KV transfer machinery."""

from __future__ import annotations

MAX_MESSAGE_BYTES = 64 << 20  # KV chunks are ~2 MiB; gRPC's default cap is 4 MiB
GRPC_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    # A peer behind a cut link is noticed within ~15 s by keepalive pings during calls,
    # not only when the call's deadline (--kv-transfer-timeout) runs out.
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    # Servers accept those pings (the default would answer them with too_many_pings).
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 5_000),
    ("grpc.http2.max_ping_strikes", 0),
]
