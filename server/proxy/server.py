"""`kvservice proxy`: the router process in front of prefill and decode workers."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import sys

from aiohttp import web
from grpc_health.v1 import health_pb2

from kvservice.loading.model_files import load_model_config, load_tokenizer, model_name
from kvservice.loading.tokenizer import Tokenizer
from kvservice.runtime.event_loop import run_event_loop
from kvservice.runtime.routing_args import add_routing_arguments
from kvservice.runtime.thread_priority import lower_serving_threads
from kvservice.runtime.tls import TLSFiles, add_tls_arguments
from kvservice.server.auth import BearerTokenInterceptor
from kvservice.server.grpc_server import SERVICE_NAMES, GrpcServer, add_log_level_argument, configure_logging
from kvservice.server.metrics import (
    ServerMetrics,
    metrics_app,
    metrics_handler,
    start_http,
)
from kvservice.server.openai_front import OpenAIFront
from kvservice.server.proxy.discovery import DEFAULT_DISCOVERY_INTERVAL_S, Discovery, DNSName
from kvservice.server.proxy.kv_subscriber import KVEventSubscriptions
from kvservice.server.proxy.router import Router
from kvservice.server.proxy.service import DEFAULT_MIGRATION_LIMIT, DEFAULT_REQUEST_TIMEOUT_S, ProxyService
from kvservice.server.proxy.worker_pool import WORKER_STATES, WorkerPool
from kvservice.v1 import kvservice_pb2_grpc as pb_grpc

logger = logging.getLogger(__name__)
LIVENESS_SERVICE = "liveness"
MIN_HEALTH_CHECK_TIMEOUT_S = 2.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--prefill",
        nargs="*",
        default=[],
        metavar="HOST:PORT",
        help="prefill workers (none: decode workers prefill themselves)",
    )
    parser.add_argument(
        "--decode", nargs="*", default=[], metavar="HOST:PORT", help="decode workers (this, --decode-dns, or both)"
    )
    parser.add_argument(
        "--prefill-dns",
        action="append",
        default=[],
        metavar="NAME:PORT",
        help="prefill workers by DNS: every A/AAAA record of NAME is one worker on PORT "
        "(a Kubernetes headless Service, compose --scale, Swarm tasks.NAME); repeatable, beside --prefill",
    )
    parser.add_argument(
        "--decode-dns", action="append", default=[], metavar="NAME:PORT", help="decode workers by DNS, as --prefill-dns"
    )
    parser.add_argument(
        "--discovery-interval",
        type=float,
        default=DEFAULT_DISCOVERY_INTERVAL_S,
        help="seconds between DNS lookups of --prefill-dns/--decode-dns "
        f"(default: {DEFAULT_DISCOVERY_INTERVAL_S:g}); a new address joins once SERVING with its KV-event snapshot, "
        "a vanished one finishes its requests and is dropped",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    parser.add_argument("--port", type=int, default=0, help="port to listen on; 0 lets the OS pick (default: 0)")
    parser.add_argument(
        "--health-interval", type=float, default=1.0, help="seconds between worker health checks (default: 1)"
    )
    parser.add_argument(
        "--grace-period", type=float, default=30.0, help="seconds in-flight requests get on SIGTERM (default: 30)"
    )
    parser.add_argument(
        "--http-port",
        type=int,
        default=None,
        help="serve the OpenAI-compatible HTTP API (/v1/completions, /v1/models, /health) on this port; "
        "0 lets the OS pick (default: off)",
    )
    parser.add_argument(
        "--served-model-name",
        default=None,
        help="the model name the HTTP API answers to (default: --model's own name, else 'kvservice')",
    )
    parser.add_argument(
        "--model",
        default=None,
        help="the workers' model (tiny, smollm2, a directory or a GGUF file): the proxy loads its tokenizer only, "
        "to route text and chat prompts by cache (--routing kv-aware) and for /tokenize and /detokenize, "
        "and its name and length for /v1/models (default: none)",
    )
    parser.add_argument(
        "--max-model-len", type=int, default=None, help="the maximum length /v1/models reports (default: the model's)"
    )
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="serve Prometheus metrics at http://HOST:PORT/metrics; 0 lets the OS pick (default: off)",
    )
    parser.add_argument(
        "--migration-limit",
        type=int,
        default=DEFAULT_MIGRATION_LIMIT,
        help="times one request may move to another decode worker when its decode worker dies or its stream breaks: "
        "the prompt plus the tokens already streamed are resent, and the client's stream goes on "
        f"(default: {DEFAULT_MIGRATION_LIMIT}; 0: fail such requests with UNAVAILABLE)",
    )
    parser.add_argument(
        "--request-timeout",
        type=float,
        default=DEFAULT_REQUEST_TIMEOUT_S,
        help="deadline of one request's calls to its workers, whole stream included, seconds "
        f"(default: {DEFAULT_REQUEST_TIMEOUT_S:g})",
    )
    add_routing_arguments(parser)
    add_log_level_argument(parser)
    add_tls_arguments(parser)


def main(args: argparse.Namespace) -> int:
    configure_logging(args.log_level)
    try:
        if not args.request_timeout > 0:
            raise ValueError(f"--request-timeout must be > 0, got {args.request_timeout}")
        if args.migration_limit < 0:
            raise ValueError(f"--migration-limit must be >= 0, got {args.migration_limit}")
        if not args.discovery_interval > 0:
            raise ValueError(f"--discovery-interval must be > 0, got {args.discovery_interval}")
        if not args.decode and not args.decode_dns:
            raise ValueError("give decode workers: --decode HOST:PORT ... and/or --decode-dns NAME:PORT")
        for name in args.prefill_dns + args.decode_dns:
            DNSName.parse(name)
        tls = TLSFiles.from_args(args)
        tls.server_credentials()  # unreadable files fail here, with exit code 2
    except ValueError as e:
        print(f"kvservice proxy: error: {e}", file=sys.stderr)
        return 2
    lower_serving_threads()  # every thread the proxy starts serves: a worker's compute threads go first
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
    prefill = WorkerPool(args.prefill, channel_credentials, args.auth_token, role="prefill")
    decode = WorkerPool(args.decode, channel_credentials, args.auth_token, role="decode")
    metrics = ServerMetrics("proxy")
    _export_membership(metrics, prefill, decode)
    router = Router(prefill, decode, args.routing, args.max_local_prefill_tokens, args.peer_pull_min_tokens)
    service = ProxyService(
        prefill,
        decode,
        metrics,
        migration_limit=args.migration_limit,
        request_timeout=args.request_timeout,
        router=router,
        tokenizer=tokenizer,
    )
    discoveries = [
        Discovery(pool, [DNSName.parse(n) for n in names], args.discovery_interval)
        for pool, names in ((prefill, args.prefill_dns), (decode, args.decode_dns))
        if names
    ]
    interceptors = [BearerTokenInterceptor(args.auth_token)] if args.auth_token else []
    server = GrpcServer([SERVICE_NAMES["generation"]], tls.server_credentials(), interceptors)
    pb_grpc.add_GenerationServicer_to_server(service, server.server)
    port = server.bind(args.host, args.port)
    await server.set_serving(False)  # until a decode worker answers its health check
    # For liveness probes: the process answers, whatever its workers' state.
    await server.health.set(LIVENESS_SERVICE, health_pb2.HealthCheckResponse.SERVING)
    front: OpenAIFront | None = None
    if args.http_port is not None:
        front = OpenAIFront(
            service, served_name, lambda: decode.num_healthy > 0, args.auth_token, tokenizer, max_model_len
        )
    runners, http_ready = await _start_http(args, tls, metrics, front)
    # Every task the proxy starts is cancelled and awaited in on_stop.
    tasks = _start_tasks(args, server, router, prefill, decode, discoveries)

    async def drain_http(deadline: float) -> None:
        """Alongside the gRPC drain, within the same grace period: /health turns 503, new
        requests are refused, in-flight ones finish while the pools are still open."""
        if front is not None:
            front.start_draining()
        for runner in runners:
            await runner.cleanup()

    async def drain_requests(deadline: float) -> None:
        """Before the gRPC server stops: refuse new HTTP requests, let in-flight ones end."""
        if front is not None:
            front.start_draining()
        await service.wait_until_idle(deadline)

    async def on_stop() -> None:
        for task in tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await prefill.close()
        await decode.close()

    await server.run_until_signalled(
        args.grace_period,
        on_stop,
        ready_line=f"kvservice proxy: listening on {args.host}:{port}{http_ready}",
        before_stop=drain_requests,
        alongside_stop=drain_http,
    )
    return 0


async def _start_http(
    args: argparse.Namespace, tls: TLSFiles, metrics: ServerMetrics, front: OpenAIFront | None
) -> tuple[list[web.AppRunner], str]:
    """The HTTP servers the flags ask for: `front` with /metrics on --http-port, /metrics alone
    on --metrics-port; their runners and their part of the ready line. When one fails to start,
    those already started are cleaned up."""
    runners: list[web.AppRunner] = []
    ready = ""
    try:
        if front is not None:
            app = front.app()
            app.router.add_get("/metrics", metrics_handler(metrics, None))
            runner, http_port = await start_http(
                app,
                args.host,
                args.http_port,
                shutdown_timeout=args.grace_period,
                ssl_context=tls.ssl_context(),
                handler_cancellation=True,  # a client that hangs up aborts its request on both workers
            )
            runners.append(runner)
            ready += f"; http on {args.host}:{http_port}"
        if args.metrics_port is not None:
            runner, metrics_port = await start_http(metrics_app(metrics), args.host, args.metrics_port)
            runners.append(runner)
            ready += f"; metrics on {args.host}:{metrics_port}"
    except BaseException:
        for runner in runners:
            await runner.cleanup()
        raise
    return runners, ready


def _start_tasks(
    args: argparse.Namespace,
    server: GrpcServer,
    router: Router,
    prefill: WorkerPool,
    decode: WorkerPool,
    discoveries: list[Discovery],
) -> list[asyncio.Task[None]]:
    """Start watching the workers: their health (and, where routing reads it, their KV events)
    and the DNS names to discover; the tasks the caller must cancel and await."""
    # Each worker's cache index, from its KV events: only kv-aware routing and local prefill read it.
    # The pools own the subscription tasks (`on_added` below) and cancel them when they drop or close.
    subscriptions = KVEventSubscriptions([])
    for pool in (prefill, decode):
        pool.needs_snapshot = router.needs_kv_events
        pool.watch_health()
        if router.needs_kv_events:
            pool.on_added(subscriptions.follow)
    monitor = asyncio.create_task(_monitor(server, prefill, decode, args.health_interval))
    return [monitor, *(asyncio.create_task(d.run(), name=f"discovery {d.pool.role}") for d in discoveries)]


async def _monitor(server: GrpcServer, prefill: WorkerPool, decode: WorkerPool, interval: float) -> None:
    """Health-check the workers; the proxy serves while at least one decode worker does."""
    was_serving = None
    # A dead worker refuses the connection at once; only a live but busy one is slow to
    # answer, and a short deadline would take it out of rotation under load.
    timeout = max(interval, MIN_HEALTH_CHECK_TIMEOUT_S)
    while True:
        await asyncio.gather(prefill.check_all(timeout), decode.check_all(timeout))
        await asyncio.gather(prefill.update_membership(), decode.update_membership())
        is_serving = decode.num_healthy > 0
        if is_serving != was_serving:
            await server.set_serving(is_serving)
            logger.info(
                "proxy %s (%d/%d prefill, %d/%d decode healthy)",
                "serving" if is_serving else "not serving",
                prefill.num_healthy,
                len(prefill.workers),
                decode.num_healthy,
                len(decode.workers),
            )
            was_serving = is_serving
        await asyncio.sleep(interval)  # polling period of the health monitor


def _export_membership(metrics: ServerMetrics, *pools: WorkerPool) -> None:
    """`kvservice_workers{role,state}`, joins and leaves, read from the pools at each scrape."""
    assert metrics.workers_healthy is not None and metrics.workers is not None
    assert metrics.worker_joins is not None and metrics.worker_leaves is not None
    for pool in pools:
        metrics.workers_healthy.labels(pool.role).set_function(lambda pool=pool: pool.num_healthy)
        metrics.worker_joins.labels(pool.role).set_function(lambda pool=pool: pool.num_joins)
        metrics.worker_leaves.labels(pool.role).set_function(lambda pool=pool: pool.num_leaves)
        for state in WORKER_STATES:
            metrics.workers.labels(pool.role, state).set_function(
                lambda pool=pool, state=state: pool.num_in_state()[state]
            )
