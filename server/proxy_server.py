"""`kvservice proxy`: the router process in front of prefill and decode workers."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging

from kvservice.server.grpc_server import SERVICE_NAMES, GrpcServer, configure_logging, run_event_loop
from kvservice.server.proxy import ProxyService
from kvservice.server.worker_pool import WorkerPool
from kvservice.v1 import kvservice_pb2_grpc as pb_grpc

logger = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prefill", nargs="*", default=[], metavar="HOST:PORT", help="prefill workers (none: decode workers prefill themselves)")
    parser.add_argument("--decode", nargs="+", required=True, metavar="HOST:PORT", help="decode workers")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    parser.add_argument("--port", type=int, default=0, help="port to listen on; 0 lets the OS pick (default: 0)")
    parser.add_argument("--health-interval", type=float, default=1.0, help="seconds between worker health checks (default: 1)")
    parser.add_argument("--grace-period", type=float, default=30.0, help="seconds in-flight requests get on SIGTERM (default: 30)")
    parser.add_argument("--log-level", default="WARNING", help="logging level (default: WARNING)")


def main(args: argparse.Namespace) -> int:
    configure_logging(args.log_level)
    return run_event_loop(serve(args))


async def serve(args: argparse.Namespace) -> int:
    prefill = WorkerPool(args.prefill)
    decode = WorkerPool(args.decode)
    server = GrpcServer([SERVICE_NAMES["generation"]])
    pb_grpc.add_GenerationServicer_to_server(ProxyService(prefill, decode), server.server)
    port = server.bind(args.host, args.port)
    await server.set_serving(False)  # until a decode worker answers its health check
    monitor = asyncio.create_task(_monitor(server, prefill, decode, args.health_interval))

    async def on_stop() -> None:
        monitor.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await monitor
        await prefill.close()
        await decode.close()

    await server.run_until_signalled(args.grace_period, on_stop, ready_line=f"kvservice proxy: listening on {args.host}:{port}")
    return 0


async def _monitor(server: GrpcServer, prefill: WorkerPool, decode: WorkerPool, interval: float) -> None:
    """Health-check the workers; the proxy serves while at least one decode worker does."""
    was_serving = None
    while True:
        await asyncio.gather(prefill.check_all(interval), decode.check_all(interval))
        is_serving = decode.num_healthy > 0
        if is_serving != was_serving:
            await server.set_serving(is_serving)
            logger.info("proxy %s (%d/%d prefill, %d/%d decode healthy)", "serving" if is_serving else "not serving",
                        prefill.num_healthy, len(prefill.workers), decode.num_healthy, len(decode.workers))
            was_serving = is_serving
        await asyncio.sleep(interval)  # polling period of the health monitor
