"""The plain gRPC baseline of `kvservice bench transfer`: what a grpc.aio stream moves here
when neither end does anything but hand it bytes and check them.

A server process streams a source tensor's bytes as prebuilt 2 MiB `bytes` messages (built
before the clock starts: no copy, no framing, no protobuf of ours); a client process reads
them and keeps a running CRC-32. Time runs on the client from the first message to the
last. Both sides' CRC-32 must match, and the byte count too, or the run fails. This is the
ceiling of PullKV's gRPC path on this machine: PullKV does the same plus staging, framing
and the copy into cache blocks.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from kvservice.client.bench.tcp_baseline import MiB, close_children, expect_reply, pin
from kvservice.connector.wire import checksum

_BASELINE = "plain gRPC baseline"
_METHOD = "/kvservice.bench.Plain/Stream"
_OPTIONS = [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)]


@dataclass(frozen=True, slots=True)
class PlainGrpcResult:
    num_bytes: int
    seconds: float
    gb_per_s: float
    receiver_cpu_seconds: float


def _messages(num_bytes: int, message_bytes: int, seed: int) -> list[bytes]:
    import torch

    gen = torch.Generator().manual_seed(seed)
    src = torch.randint(0, 256, (num_bytes,), dtype=torch.uint8, generator=gen).numpy()
    return [src[i : i + message_bytes].tobytes() for i in range(0, num_bytes, message_bytes)]


def _server(conn: Connection, num_bytes: int, message_bytes: int, seed: int) -> None:
    import grpc

    async def serve() -> None:
        messages = _messages(num_bytes, message_bytes, seed)
        crc = 0
        for message in messages:
            crc = checksum(message, crc)

        async def stream(request: bytes, context: grpc.aio.ServicerContext) -> Any:
            for message in messages:
                yield message

        server = grpc.aio.server(options=_OPTIONS)
        service, method = _METHOD.rsplit("/", 1)
        server.add_generic_rpc_handlers(
            (
                grpc.method_handlers_generic_handler(
                    service.lstrip("/"), {method: grpc.unary_stream_rpc_method_handler(stream)}
                ),
            )
        )
        port = server.add_insecure_port("127.0.0.1:0")
        await serve_until_told(server, conn, ("ready", port, crc))

    try:
        asyncio.run(serve())
    except BaseException as exc:
        conn.send(("error", f"server: {exc!r}"))
        raise


async def serve_until_told(server: Any, conn: Connection, ready: tuple[Any, ...]) -> None:
    """Start a baseline child's grpc.aio `server`, send `ready` to the orchestrator, and stop once
    told to (or once the orchestrator is gone)."""
    await server.start()
    conn.send(ready)
    try:
        await asyncio.to_thread(conn.recv)  # until told to stop
    except EOFError:
        pass  # the orchestrator is gone: stop too
    await server.stop(None)


def _client(conn: Connection, port: int, timeout_s: float) -> None:
    import grpc

    async def pull() -> None:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=_OPTIONS) as channel:
            await asyncio.wait_for(channel.channel_ready(), timeout_s)
            call = channel.unary_stream(_METHOD)(b"", timeout=timeout_s)
            received = crc = 0
            start = start_cpu = 0.0
            async for message in call:
                if not received:
                    start, start_cpu = time.perf_counter(), time.process_time()  # the first message has arrived
                received += len(message)
                crc = checksum(message, crc)
            conn.send(("done", received, crc, time.perf_counter() - start, time.process_time() - start_cpu))

    try:
        asyncio.run(pull())
    except BaseException as exc:
        conn.send(("error", f"client: {exc!r}"))
        raise


def plain_grpc_transfer(
    num_bytes: int,
    *,
    message_bytes: int = 2 * MiB,
    timeout_s: float = 120.0,
    seed: int = 0,
    cores: tuple[int, int] | None = None,
) -> PlainGrpcResult:
    """Stream `num_bytes` over one grpc.aio call between two fresh processes; the first
    message is not timed (its bytes count). Raises RuntimeError when what arrived differs
    from what was sent. `cores`: the server on the first, the client on the second."""
    if num_bytes < 2 or message_bytes <= 0:
        raise ValueError(f"num_bytes must be at least 2 and message_bytes positive: {num_bytes}, {message_bytes}")
    message_bytes = min(message_bytes, max(1, num_bytes // 4))  # small runs: still several messages to time
    ctx = mp.get_context("spawn")
    server_conn, server_child = ctx.Pipe()
    client_conn, client_child = ctx.Pipe()
    server = ctx.Process(target=_server, args=(server_child, num_bytes, message_bytes, seed), daemon=True)
    client: mp.process.BaseProcess | None = None
    try:
        server.start()
        pin(server, cores[0] if cores else None)
        port, sent_crc = expect_reply(server_conn, timeout_s, "port from the server", _BASELINE)
        client = ctx.Process(target=_client, args=(client_child, port, timeout_s), daemon=True)
        client.start()
        pin(client, cores[1] if cores else None)
        received, received_crc, seconds, cpu_seconds = expect_reply(
            client_conn, timeout_s, "client's result", _BASELINE
        )
        server_conn.send("stop")
    finally:
        close_children([server_conn, server_child, client_conn, client_child], [server, client])
    if received != num_bytes or received_crc != sent_crc:
        raise RuntimeError(
            f"plain gRPC baseline: received {received} bytes, crc32 {received_crc:#010x}; "
            f"sent {num_bytes}, {sent_crc:#010x}"
        )
    timed_bytes = num_bytes - message_bytes
    return PlainGrpcResult(timed_bytes, seconds, timed_bytes / seconds / 1e9, cpu_seconds)
