"""`kvservice proxy`: the router process in front of prefill and decode workers."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import sys

from aiohttp import web
from grpc_health.v1 import health_pb2

from kvservice.loading.model_loader import load_model_config, load_tokenizer, model_name
from kvservice.loading.tokenizer import Tokenizer
from kvservice.runtime.event_loop import run_event_loop
from kvservice.runtime.routing_args import add_routing_arguments
from kvservice.runtime.tls import TLSFiles, add_tls_arguments
from kvservice.server.auth import BearerTokenInterceptor
from kvservice.server.grpc_server import SERVICE_NAMES, GrpcServer, add_log_level_argument, configure_logging
from kvservice.server.kv_subscriber import KVEventSubscriptions
from kvservice.server.metrics import (
    ServerMetrics,
    metrics_app,
    metrics_handler,
    start_http,
)
from kvservice.server.openai_front import OpenAIFront
from kvservice.server.proxy import DEFAULT_REQUEST_TIMEOUT_S, ProxyService
from kvservice.server.router import Router
from kvservice.server.worker_pool import WorkerPool
from kvservice.v1 import kvservice_pb2_grpc as pb_grpc

logger = logging.getLogger(__name__)
LIVENESS_SERVICE = "liveness"
MIN_HEALTH_CHECK_TIMEOUT_S = 2.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prefill", nargs="*", default=[], metavar="HOST:PORT", help="prefill workers (none: decode workers prefill themselves)")
    parser.add_argument("--decode", nargs="+", required=True, metavar="HOST:PORT", help="decode workers")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    parser.add_argument("--port", type=int, default=0, help="port to listen on; 0 lets the OS pick (default: 0)")
    parser.add_argument("--health-interval", type=float, default=1.0, help="seconds between worker health checks (default: 1)")
    parser.add_argument("--grace-period", type=float, default=30.0, help="seconds in-flight requests get on SIGTERM (default: 30)")
    parser.add_argument("--http-port", type=int, default=None, help="serve the OpenAI-compatible HTTP API (/v1/completions, /v1/models, /health) on this port; 0 lets the OS pick (default: off)")
    parser.add_argument("--served-model-name", default=None, help="the model name the HTTP API answers to (default: --model's own name, else 'kvservice')")
    parser.add_argument("--model", default=None, help="the workers' model (tiny, smollm2, a directory or a GGUF file): the proxy loads its tokenizer only, to route text and chat prompts by cache (--routing kv-aware) and for /tokenize and /detokenize, and its name and length for /v1/models (default: none)")
    parser.add_argument("--max-model-len", type=int, default=None, help="the maximum length /v1/models reports (default: the model's)")
    parser.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus metrics at http://HOST:PORT/metrics; 0 lets the OS pick (default: off)")
    parser.add_argument(
        "--retry-decode", action="store_true",
        help="when a decode worker is lost mid-request, restart greedy or seeded requests on another "
        "decode worker (tokens the client has are not sent again) instead of failing them with UNAVAILABLE",
    )
    parser.add_argument(
        "--request-timeout", type=float, default=DEFAULT_REQUEST_TIMEOUT_S,
        help=f"deadline of one request's calls to its workers, whole stream included, seconds (default: {DEFAULT_REQUEST_TIMEOUT_S:g})",
    )
    add_routing_arguments(parser)
    add_log_level_argument(parser)
    add_tls_arguments(parser)


def main(args: argparse.Namespace) -> int:
    configure_logging(args.log_level)
    try:
        if not args.request_timeout > 0:
            raise ValueError(f"--request-timeout must be > 0, got {args.request_timeout}")
        tls = TLSFiles.from_args(args)
        tls.server_credentials()  # unreadable files fail here, with exit code 2
    except ValueError as e:
        print(f"kvservice proxy: error: {e}", file=sys.stderr)
        return 2
    return run_event_loop(serve(args))


def _model_facts(args: argparse.Namespace) -> tuple[str, Tokenizer | None, int | None]:
    """(served name, tokenizer, max model length) from --model, with the flags' overrides."""
    if args.model is None:
        return args.served_model_name or "kvservice", None, args.max_model_len
    name = args.served_model_name or model_name(args.model)
    max_model_len = args.max_model_len or load_model_config(args.model).max_position_embeddings
    return name, load_tokenizer(args.model), max_model_len


async def serve(args: argparse.Namespace) -> int:
    served_name, tokenizer, max_model_len = await asyncio.to_thread(_model_facts, args)
    # The proxy presents the same certificate to its workers as to its clients.
    tls = TLSFiles.from_args(args)
    channel_credentials = tls.channel_credentials()
    prefill = WorkerPool(args.prefill, channel_credentials, args.auth_token)
    decode = WorkerPool(args.decode, channel_credentials, args.auth_token)
    metrics = ServerMetrics("proxy")
    assert metrics.workers_healthy is not None
    metrics.workers_healthy.labels("prefill").set_function(lambda: prefill.num_healthy)
    metrics.workers_healthy.labels("decode").set_function(lambda: decode.num_healthy)
    router = Router(prefill, decode, args.routing, args.max_local_prefill_tokens)
    service = ProxyService(
        prefill, decode, metrics, retry_decode=args.retry_decode, request_timeout=args.request_timeout, router=router, tokenizer=tokenizer,
    )
    # Each worker's cache index, from its KV events: only kv-aware routing and local prefill read it.
    subscriptions = KVEventSubscriptions(prefill.workers + decode.workers if router.needs_kv_events else [])
    interceptors = [BearerTokenInterceptor(args.auth_token)] if args.auth_token else []
    server = GrpcServer([SERVICE_NAMES["generation"]], tls.server_credentials(), interceptors)
    pb_grpc.add_GenerationServicer_to_server(service, server.server)
    port = server.bind(args.host, args.port)
    await server.set_serving(False)  # until a decode worker answers its health check
    # For liveness probes: the process answers, whatever its workers' state.
    await server.health.set(LIVENESS_SERVICE, health_pb2.HealthCheckResponse.SERVING)
    ready_line = f"kvservice proxy: listening on {args.host}:{port}"
    runners: list[web.AppRunner] = []
    front: OpenAIFront | None = None
    try:
        if args.http_port is not None:
            front = OpenAIFront(
                service, served_name, lambda: decode.num_healthy > 0, args.auth_token, tokenizer, max_model_len
            )
            app = front.app()
            app.router.add_get("/metrics", metrics_handler(metrics, None))
            runner, http_port = await start_http(
                app, args.host, args.http_port, shutdown_timeout=args.grace_period, ssl_context=tls.ssl_context(),
                handler_cancellation=True,  # a client that hangs up aborts its request on both workers
            )
            runners.append(runner)
            ready_line += f"; http on {args.host}:{http_port}"
        if args.metrics_port is not None:
            runner, metrics_port = await start_http(metrics_app(metrics), args.host, args.metrics_port)
            runners.append(runner)
            ready_line += f"; metrics on {args.host}:{metrics_port}"
    except BaseException:
        for runner in runners:
            await runner.cleanup()
        raise
    monitor = asyncio.create_task(_monitor(server, prefill, decode, args.health_interval))
    subscriptions.start()

    async def drain_http(deadline: float) -> None:
        """Alongside the gRPC drain, within the same grace period: /health turns 503, new
        requests are refused, in-flight ones finish while the pools are still open."""
        if front is not None:
            front.start_draining()
        for runner in runners:
            await runner.cleanup()

    async def on_stop() -> None:
        monitor.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await monitor
        await subscriptions.close()
        await prefill.close()
        await decode.close()

    await server.run_until_signalled(args.grace_period, on_stop, ready_line=ready_line, alongside_stop=drain_http)
    return 0


async def _monitor(server: GrpcServer, prefill: WorkerPool, decode: WorkerPool, interval: float) -> None:
    """Health-check the workers; the proxy serves while at least one decode worker does."""
    was_serving = None
    # A dead worker refuses the connection at once; only a live but busy one is slow to
    # answer, and a short deadline would take it out of rotation under load.
    timeout = max(interval, MIN_HEALTH_CHECK_TIMEOUT_S)
    while True:
        await asyncio.gather(prefill.check_all(timeout), decode.check_all(timeout))
        is_serving = decode.num_healthy > 0
        if is_serving != was_serving:
            await server.set_serving(is_serving)
            logger.info("proxy %s (%d/%d prefill, %d/%d decode healthy)", "serving" if is_serving else "not serving",
                        prefill.num_healthy, len(prefill.workers), decode.num_healthy, len(decode.workers))
            was_serving = is_serving
        await asyncio.sleep(interval)  # polling period of the health monitor
