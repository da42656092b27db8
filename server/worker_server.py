"""`kvservice serve`: one worker process, prefill, decode or colocated (`both`).

Each role is an engine plus the services of that role:
  prefill: Worker.Prefill + KVTransfer.PullKV, with a staging pool and a transfer registry;
  decode:  Worker.Decode, with the pull connector;
  both:    the client API (Generation), no connector - the baseline.
Every role also serves Worker.Stats and Worker.SubscribeKVEvents: its prefix cache's
changes, which is how the proxy routes by what each worker caches.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import logging
import sys

import grpc
import torch

from kvservice.config import EngineConfig
from kvservice.connector.base import KVConnectorBase
from kvservice.connector.decode_connector import DecodeKVConnector
from kvservice.connector.kv_transfer_service import KVTransferService
from kvservice.connector.prefill_connector import PrefillKVConnector
from kvservice.connector.staging import StagingPool
from kvservice.connector.transfer_registry import TransferRegistry
from kvservice.engine.async_engine import AsyncLLMEngine
from kvservice.engine.engine import LLMEngine
from kvservice.loading.model_files import load_model_config
from kvservice.loading.model_loader import ModelLoadError, resolve_dtype
from kvservice.model.kv_cache import KVCacheLayout
from kvservice.runtime import engine_args
from kvservice.runtime.event_loop import run_event_loop
from kvservice.runtime.thread_priority import lower_serving_threads
from kvservice.runtime.tls import TLSFiles, add_tls_arguments, add_worker_peer_names_argument, check_worker_peer_names
from kvservice.server.auth import BearerTokenInterceptor, PeerNameInterceptor
from kvservice.server.colocated_service import ColocatedGenerationService
from kvservice.server.decode_service import DecodeWorkerService
from kvservice.server.grpc_server import SERVICE_NAMES, GrpcServer, add_log_level_argument, configure_logging
from kvservice.server.kv_events import KVEventPublisher
from kvservice.server.metrics import ServerMetrics, metrics_app, start_http
from kvservice.server.openai_front import OpenAIFront
from kvservice.server.prefill_service import PrefillWorkerService
from kvservice.server.worker_service import EngineWorkerService
from kvservice.v1 import kvservice_pb2_grpc as pb_grpc
from kvservice.worker.core_lease import CoreLease, LeaseRole

logger = logging.getLogger(__name__)
ROLES = ("prefill", "decode", "both")


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """The worker's flags; the `EngineConfig` knobs come from `kvservice.runtime.engine_args` (shared with `launch`)."""
    parser.add_argument(
        "--model",
        default="tiny",
        help="'tiny' (built in, random weights), 'smollm2' (SmolLM2-135M-Instruct, installed by make setup), a Hugging Face model directory or a GGUF file (default: tiny)",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    engine_args.add_engine_arguments(parser)
    parser.add_argument(
        "--kv-lease-seconds",
        type=float,
        default=30.0,
        help="prefill side: staged KV not pulled within this is freed (default: 30)",
    )
    parser.add_argument(
        "--kv-staging-mib", type=int, default=256, help="prefill side: staging pool bound (default: 256)"
    )
    parser.add_argument(
        "--kv-transfer-timeout",
        type=float,
        default=120.0,
        help="decode side: deadline of one KV pull, seconds (default: 120)",
    )
    parser.add_argument(
        "--kv-transfer-shm",
        action="store_true",
        help="decode side: offer each prefill worker a shared-memory segment in /dev/shm for the KV bytes (8 MiB, "
        "reused by later pulls from that worker); a prefill worker on the same host (same /dev/shm, same user) writes "
        "them there and streams only chunk headers, any other streams the bytes over gRPC as usual (default: off; "
        "`kvservice launch` turns it on)",
    )
    parser.add_argument(
        "--max-queued-requests",
        type=int,
        default=1024,
        help="admission control: requests not yet running (incl. waiting for remote KV) past which new ones get RESOURCE_EXHAUSTED (default: 1024)",
    )
    parser.add_argument("--num-threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument(
        "--core-lease",
        metavar="FILE",
        default=None,
        help="take turns on the cores with the other workers given the same FILE (on this host, the same cores): a decode "
        "step gets all of them as soon as it starts, a prefill step hands them over between its matmuls so decode steps "
        "start about --step-target-ms apart, or three decode steps apart where those are slower; two workers that "
        "compute on the same cores at once stall each other (`kvservice launch` gives one to its workers; a --device cuda "
        "worker ignores it; default: off)",
    )
    parser.add_argument(
        "--grace-period", type=float, default=30.0, help="seconds in-flight requests get on SIGTERM (default: 30)"
    )
    add_log_level_argument(parser)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--role", required=True, choices=ROLES, help="prefill, decode, or both (colocated, no KV transfer)"
    )
    parser.add_argument("--port", type=int, default=0, help="port to listen on; 0 lets the OS pick (default: 0)")
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="serve Prometheus metrics at http://HOST:PORT/metrics; 0 lets the OS pick (default: off)",
    )
    parser.add_argument(
        "--http-port",
        type=int,
        default=None,
        help="--role both: serve the OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, ...) on this port; 0 lets the OS pick (default: off)",
    )
    parser.add_argument(
        "--served-model-name",
        default=None,
        help="the model name the HTTP API answers to (default: the model's own: a GGUF file's general.name, a directory's name)",
    )
    parser.add_argument(
        "--kv-peers",
        nargs="+",
        default=None,
        metavar="HOST:PORT",
        help="decode side: the only prefill workers KV may be pulled from (default: any a request names; "
        "with --auth-token only authenticated requests name one); '-': read them from the first line of stdin "
        "once the model has loaded (how `kvservice launch` starts decode workers while its prefill workers still load)",
    )
    add_engine_arguments(parser)
    add_tls_arguments(parser)
    add_worker_peer_names_argument(parser)


def engine_config(args: argparse.Namespace) -> EngineConfig:
    config = engine_args.engine_config(args)
    if args.role != "both":  # the lane is a colocated worker's own prefill
        config = dataclasses.replace(config, prompt_lane=False)
    if args.role == "prefill":
        # The draft's KV never travels: a prefill worker would compute it for nobody.
        return dataclasses.replace(config, draft_model=None, num_speculative_tokens=0)
    return config


def main(args: argparse.Namespace) -> int:
    configure_logging(args.log_level)
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    try:
        config = engine_config(args)
        model_config = load_model_config(args.model)
        layout = KVCacheLayout.for_model(model_config, config.block_size, resolve_dtype(config.dtype, model_config))
        if args.max_queued_requests < 1:
            raise ValueError(f"--max-queued-requests must be >= 1, got {args.max_queued_requests}")
        if args.http_port is not None and args.role != "both":
            raise ValueError(
                "--http-port: only a colocated worker (--role both) serves the HTTP API; for a prefill/decode pair, give it to the proxy"
            )
        tls = TLSFiles.from_args(args)
        tls.server_credentials()  # unreadable files fail here, before the model loads
        check_worker_peer_names(args.worker_peer_names, tls)
        if args.worker_peer_names is not None and args.role == "both":
            raise ValueError(
                "--worker-peer-names: a colocated worker serves clients; it is for prefill and decode workers"
            )
    except (ModelLoadError, ValueError) as e:
        print(f"kvservice serve: error: {e}", file=sys.stderr)
        return 2
    try:
        return run_event_loop(serve(args, config, layout, tls))
    except (ModelLoadError, StartupError) as e:
        print(f"kvservice serve: error: {e}", file=sys.stderr)
        return 2


class StartupError(RuntimeError):
    """What stops a worker before it serves, reported as one line (exit code 2)."""


async def read_kv_peers(given: list[str] | None) -> frozenset[str] | None:
    """--kv-peers as given, or, for `-`, the addresses on stdin's first line (they may come long
    after start: the launcher writes them once its prefill workers are ready)."""
    if given != ["-"]:
        return frozenset(given) if given is not None else None
    line = await asyncio.to_thread(sys.stdin.readline)
    peers = frozenset(line.split())
    if not peers:
        raise StartupError("--kv-peers -: stdin ended before a line of prefill addresses")
    return peers


async def serve(args: argparse.Namespace, config: EngineConfig, layout: KVCacheLayout, tls: TLSFiles) -> int:
    registry: TransferRegistry | None = None
    connector: KVConnectorBase | None = None
    if args.role == "prefill":
        registry = TransferRegistry(
            StagingPool(args.kv_staging_mib << 20, pin_memory=config.device.startswith("cuda")),
            layout,
            args.kv_lease_seconds,
        )
        connector = PrefillKVConnector(registry)
    elif args.role == "decode":
        connector = DecodeKVConnector(
            layout,
            transfer_timeout=args.kv_transfer_timeout,
            channel_credentials=tls.channel_credentials(),
            auth_token=args.auth_token,
            use_shared_memory=args.kv_transfer_shm,
        )
    core_lease = None
    if args.core_lease is not None and config.device == "cpu":  # what a GPU worker shares is not its cores
        role = LeaseRole.YIELDING if args.role == "prefill" else LeaseRole.FIRST
        core_lease = CoreLease(args.core_lease, role, config.step_target_s)
    # Read while the model loads (`--kv-peers -`); a decode worker fails here, before it computes anything.
    reading_kv_peers = asyncio.ensure_future(read_kv_peers(args.kv_peers))
    engine = await asyncio.to_thread(LLMEngine, args.model, config, connector, core_lease)
    kv_peers = await reading_kv_peers
    kv_events = KVEventPublisher(asyncio.get_running_loop(), config.block_size, engine.kv_hash_seed)
    async_engine = AsyncLLMEngine(
        engine, max_queued_requests=args.max_queued_requests, kv_events_sink=kv_events.publish
    )
    if isinstance(connector, DecodeKVConnector):
        connector.on_load_done = async_engine.wake
    async_engine.start()
    # The step thread (and the pool it starts) computes; this thread and what it starts serve.
    lower_serving_threads([async_engine.step_thread_id])

    metrics = ServerMetrics(args.role)
    prefill_service: PrefillWorkerService | None = None
    transfer_service: KVTransferService | None = None
    worker_service: EngineWorkerService
    credentials = tls.server_credentials()
    generation: ColocatedGenerationService | None = None
    # Every role checks the bearer token on every RPC but health; workers can also check the peer's certificate.
    interceptors: list[grpc.aio.ServerInterceptor] = (
        [BearerTokenInterceptor(args.auth_token)] if args.auth_token else []
    )
    if args.worker_peer_names is not None:
        interceptors.append(PeerNameInterceptor(args.worker_peer_names))
    if args.role == "both":
        server = GrpcServer([SERVICE_NAMES["generation"], SERVICE_NAMES["worker"]], credentials, interceptors)
        generation = ColocatedGenerationService(async_engine, metrics=metrics)
        pb_grpc.add_GenerationServicer_to_server(generation, server.server)
        worker_service = EngineWorkerService(async_engine, "both", kv_events)
    elif args.role == "decode":
        server = GrpcServer([SERVICE_NAMES["worker"]], credentials, interceptors)
        worker_service = DecodeWorkerService(async_engine, metrics=metrics, kv_peers=kv_peers, kv_events=kv_events)
    else:
        assert registry is not None
        server = GrpcServer([SERVICE_NAMES["worker"], SERVICE_NAMES["kv_transfer"]], credentials, interceptors)
        transfer_service = KVTransferService(registry)
        server.server.add_generic_rpc_handlers([transfer_service.handler()])
        worker_service = prefill_service = PrefillWorkerService(
            async_engine, registry, metrics=metrics, kv_events=kv_events, kv_sending=transfer_service.stats
        )
    pb_grpc.add_WorkerServicer_to_server(worker_service, server.server)
    port = server.bind(args.host, args.port)
    await server.set_serving(True)
    ready_line = f"kvservice serve: role={args.role} listening on {args.host}:{port}"

    runners = []
    if generation is not None and args.http_port is not None:
        front = OpenAIFront(
            generation,
            args.served_model_name or engine.loaded.name,
            lambda: async_engine.is_alive,
            args.auth_token,
            engine.tokenizer,
            engine.max_model_len,
        )
        runner, http_port = await start_http(
            front.app(), args.host, args.http_port, shutdown_timeout=args.grace_period, ssl_context=tls.ssl_context()
        )
        runners.append(runner)
        ready_line += f"; http on {args.host}:{http_port}"
    if args.metrics_port is not None:
        metrics_runner, metrics_port = await start_http(
            metrics_app(metrics, worker_service.stats), args.host, args.metrics_port
        )
        runners.append(metrics_runner)
        ready_line += f"; metrics on {args.host}:{metrics_port}"

    reaper = asyncio.create_task(_expire_leases(registry)) if registry is not None else None
    stop = asyncio.Event()
    watchdog = asyncio.create_task(_stop_when_engine_fails(async_engine, server, stop))

    async def on_stop() -> None:
        watchdog.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watchdog
        if reaper is not None:
            reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reaper
        for runner in runners:
            await runner.cleanup()
        await async_engine.stop()
        if connector is not None:
            connector.shutdown()
        if transfer_service is not None:
            transfer_service.close()

    async def prepare_drain(deadline: float) -> None:
        kv_events.close()  # event streams never end by themselves: end them before the drain waits for them
        if isinstance(worker_service, DecodeWorkerService):
            worker_service.drain()  # nor do DecodeStreams: each ends once its requests have
        # Decode workers were promised this KV: refusing their pulls would make them recompute.
        if prefill_service is not None and async_engine.error is None:
            await prefill_service.drain()

    await server.run_until_signalled(
        args.grace_period, on_stop, ready_line=ready_line, stop=stop, before_stop=prepare_drain
    )
    if async_engine.error is not None:
        print(f"kvservice serve: error: the engine failed: {async_engine.error!r}", file=sys.stderr)
        return 1
    return 0


async def _stop_when_engine_fails(engine: AsyncLLMEngine, server: GrpcServer, stop: asyncio.Event) -> None:
    """A dead engine serves nothing: report NOT_SERVING at once, then stop (exit non-zero)."""
    error = await engine.wait_failed()
    logger.critical("engine failed, stopping the worker: %r", error)
    await server.set_serving(False)
    stop.set()


async def _expire_leases(registry: TransferRegistry | None) -> None:
    assert registry is not None
    while True:
        await asyncio.sleep(1.0)  # lease granularity, not synchronisation
        expired = registry.expire()
        if expired:
            logger.warning("KV lease expired for %d transfer(s): %s", len(expired), expired[:5])
