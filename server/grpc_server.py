"""What every kvservice server shares: a grpc.aio server with health and reflection,
bound to a port, stopped gracefully on SIGTERM or SIGINT.

On a signal: health turns NOT_SERVING, the server stops accepting RPCs, in-flight
ones get `grace` seconds to finish, then the process exits 0. One deadline bounds the
whole drain: what runs before the server stops accepting (`before_stop`, e.g. a prefill
worker serving pulls of what it staged) and what drains alongside it (`alongside_stop`,
e.g. the proxy's HTTP front).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys
from collections.abc import Awaitable, Callable, Sequence

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection

from kvservice.runtime.grpc_options import GRPC_OPTIONS
from kvservice.v1 import kvservice_pb2 as pb

logger = logging.getLogger(__name__)

# What a server receives is a request (a prompt, sampling parameters, a pull's ids): 8 MiB
# holds a prompt of millions of token ids. Only KV chunks are bigger, and servers send those.
MAX_RECEIVE_MESSAGE_BYTES = 8 << 20
SERVER_OPTIONS = [
    *(option for option in GRPC_OPTIONS if option[0] != "grpc.max_receive_message_length"),
    ("grpc.max_receive_message_length", MAX_RECEIVE_MESSAGE_BYTES),
    ("grpc.so_reuseport", 0),
]


class GrpcServer:
    def __init__(
        self,
        service_names: Sequence[str],
        credentials: grpc.ServerCredentials | None = None,
        interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
    ) -> None:
        self.server = grpc.aio.server(options=SERVER_OPTIONS, interceptors=list(interceptors))
        # The asyncio servicer: a Watch stream ends with its RPC (the thread-pool one
        # blocks a worker thread forever, and with it the process's exit).
        self.health = HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.service_names = list(service_names)
        reflection.enable_server_reflection(
            [*self.service_names, health.SERVICE_NAME, reflection.SERVICE_NAME], self.server
        )
        self.credentials = credentials
        self.port = 0

    def bind(self, host: str, port: int) -> int:
        address = f"{host}:{port}"
        if self.credentials is not None:
            self.port = self.server.add_secure_port(address, self.credentials)
        else:
            self.port = self.server.add_insecure_port(address)
        if self.port == 0:
            raise OSError(f"cannot listen on {address}")
        return self.port

    async def set_serving(self, is_serving: bool) -> None:
        """Health of the server and of each of its services (call before start: it starts SERVING)."""
        status = health_pb2.HealthCheckResponse.SERVING if is_serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ["", *self.service_names]:
            await self.health.set(name, status)

    async def run_until_signalled(
        self,
        grace: float,
        on_stop: Callable[[], Awaitable[None]] | None = None,
        ready_line: str | None = None,
        stop: asyncio.Event | None = None,
        before_stop: Callable[[float], Awaitable[None]] | None = None,
        alongside_stop: Callable[[float], Awaitable[None]] | None = None,
    ) -> None:
        """Start, print `ready_line` (tests and the launcher wait for it), serve until
        SIGTERM/SIGINT or until `stop` is set (the server's own fatal error). The drain
        hooks get the drain's deadline (on the loop's clock)."""
        stop = stop if stop is not None else asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await self.server.start()
        if ready_line:
            print(ready_line, flush=True)
        try:
            await stop.wait()
        finally:
            logger.info("stopping: draining in-flight requests for up to %.1f s", grace)
            deadline = loop.time() + grace
            await self.health.enter_graceful_shutdown()
            if before_stop is not None:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout_at(deadline):
                        await before_stop(deadline)
            stopping = [self.server.stop(max(0.0, deadline - loop.time()))]
            if alongside_stop is not None:
                stopping.append(alongside_stop(deadline))
            await asyncio.gather(*stopping)
            if on_stop is not None:
                await on_stop()


SERVICE_NAMES = {
    "generation": pb.DESCRIPTOR.services_by_name["Generation"].full_name,
    "worker": pb.DESCRIPTOR.services_by_name["Worker"].full_name,
    "kv_transfer": pb.DESCRIPTOR.services_by_name["KVTransfer"].full_name,
}


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def add_log_level_argument(parser: argparse.ArgumentParser) -> None:
    """`--log-level`, in any case (`info` is `INFO`)."""
    parser.add_argument(
        "--log-level", type=str.upper, choices=LOG_LEVELS, default="WARNING", help="logging level (default: WARNING)"
    )


def configure_logging(level: str = "INFO") -> None:
    logging.basicConfig(level=level, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
