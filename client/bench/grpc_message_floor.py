"""The floor under `kvservice bench proxy-cpu`: a bare grpc.aio server's CPU per streamed message.

A child process serves one server-streaming method that yields a prebuilt one-token
`GenerateResponse` per message and does nothing else; the parent reads `concurrency`
such streams at once, as the proxy's clients do, and reads the child's CPU seconds from
/proc. A proxy that sends each token as its own message cannot go below this; only
carrying several tokens in one message (a stream that fell behind) does.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
from multiprocessing.connection import Connection
from typing import Any

from kvservice.client.bench.grpc_baseline import serve_until_told
from kvservice.client.bench.tcp_baseline import close_children, expect_reply, process_cpu_seconds

_METHOD = "/kvservice.bench.Floor/Stream"
_WHAT = "gRPC message floor"


def _server(conn: Connection, messages_per_call: int) -> None:
    import grpc

    from kvservice.v1 import kvservice_pb2 as pb

    message = pb.GenerateResponse(request_id="r" * 32, token_ids=[1], text="ab").SerializeToString()

    async def stream(request: bytes, context: grpc.aio.ServicerContext) -> Any:
        for _ in range(messages_per_call):
            yield message

    async def serve() -> None:
        server = grpc.aio.server()
        service, method = _METHOD.rsplit("/", 1)
        handler = grpc.unary_stream_rpc_method_handler(stream)
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.lstrip("/"), {method: handler}),))
        port = server.add_insecure_port("127.0.0.1:0")
        await serve_until_told(server, conn, ("ready", port))

    try:
        asyncio.run(serve())
    except BaseException as exc:
        conn.send(("error", f"server: {exc!r}"))
        raise


async def _read_streams(port: int, concurrency: int, timeout_s: float) -> int:
    import grpc

    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        await asyncio.wait_for(channel.channel_ready(), timeout_s)
        method = channel.unary_stream(_METHOD)

        async def one() -> int:
            return sum([1 async for _ in method(b"", timeout=timeout_s)])

        return sum(await asyncio.gather(*(one() for _ in range(concurrency))))


def grpc_us_per_message(concurrency: int, messages_per_call: int = 256, timeout_s: float = 60.0) -> float:
    """The bare server's CPU microseconds per message over `concurrency` streams at once."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    server = ctx.Process(target=_server, args=(child, messages_per_call), daemon=True)
    try:
        server.start()
        (port,) = expect_reply(parent, timeout_s, "server start", _WHAT)
        assert server.pid is not None
        before = process_cpu_seconds(server.pid)
        num_messages = asyncio.run(_read_streams(port, concurrency, timeout_s))
        cpu_s = process_cpu_seconds(server.pid) - before
        if num_messages != concurrency * messages_per_call:
            raise RuntimeError(f"{_WHAT}: {num_messages} of {concurrency * messages_per_call} messages arrived")
        parent.send("stop")
    finally:
        close_children([parent, child], [server])
    return 1e6 * cpu_s / num_messages
