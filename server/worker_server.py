"""`kvservice serve`: one worker process, prefill, decode or colocated (`both`).

Its flags and their checks, and the serving lifecycle every role shares: start the engine,
bind, serve until a signal or an engine failure, drain, stop. What each role is made of (its
engine, connector and services) is its builder's, in `kvservice.server.worker_builders`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import logging
import sys

import torch

from kvservice.config import EngineConfig
from kvservice.engine.async_engine import AsyncLLMEngine
from kvservice.engine.engine_builder import kv_transfer_layout
from kvservice.loading.model_loader import ModelLoadError
from kvservice.model.kv_cache import KVCacheLayout
from kvservice.runtime import engine_args
from kvservice.runtime.event_loop import run_event_loop
from kvservice.runtime.thread_priority import lower_serving_threads
from kvservice.runtime.tls import TLSFiles, add_tls_arguments, add_worker_peer_names_argument, check_worker_peer_names
from kvservice.server.grpc_server import GrpcServer, add_log_level_argument, configure_logging
from kvservice.server.metrics import metrics_app, start_http
from kvservice.server.openai_front import OpenAIFront
from kvservice.server.worker_builders import ROLE_BUILDERS, StartupError

logger = logging.getLogger(__name__)
ROLES = ("prefill", "decode", "both")


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """The worker's flags; the `EngineConfig` knobs come from `kvservice.runtime.engine_args` (shared with `launch`)."""
    parser.add_argument(
        "--model",
        default="tiny",
        help="'tiny' (built in, random weights), 'smollm2' (SmolLM2-135M-Instruct, installed by make setup), a "
        "Hugging Face model directory or a GGUF file (default: tiny)",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    engine_args.add_engine_arguments(parser)
    parser.add_argument(
        "--kv-lease-seconds",
        type=float,
        default=30.0,
        help="staged KV (a prefill's, or an exported prefix) not pulled within this is freed (default: 30)",
    )
    parser.add_argument(
        "--kv-staging-mib",
        type=int,
        default=None,
        help="staging pool for KV that other workers pull: a prefill worker's prompts, and the cached prefixes any "
        "worker exports to peers (ExportKV), allocated at start (default: 256 on prefill workers, 64 on decode)",
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
        help="admission control: requests not yet running (incl. waiting for remote KV) past which new ones get "
        "RESOURCE_EXHAUSTED (default: 1024)",
    )
    parser.add_argument("--num-threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument(
        "--core-lease",
        metavar="FILE",
        default=None,
        help=(
            "take turns on the cores with the other workers given the same FILE (on this host, the same cores): a "
            "decode step gets all of them as soon as it starts, a prefill step hands them over between its matmuls so "
            "decode steps start about --step-target-ms apart, or three decode steps apart where those are slower; two "
            "workers that compute on the same cores at once stall each other (`kvservice launch` gives one to its "
            "workers; a --device cuda worker ignores it; default: off)"
        ),
    )
    parser.add_argument(
        "--kv-offload-dir",
        metavar="DIR",
        default=None,
        help="keep the full blocks the prefix cache evicts in a bounded store in DIR, checked on every read, "
        "and read a prefix that misses the cache back from there; a worker restarted with the same DIR "
        "serves the prefixes it held (one worker per DIR: a second is refused; default: off)",
    )
    parser.add_argument(
        "--kv-offload-gib",
        type=float,
        default=4.0,
        help="the store's bound in GiB: the least recently used blocks go to keep within it (default: 4)",
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
        help="--role both: serve the OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, ...) on this "
        "port; 0 lets the OS pick (default: off)",
    )
    parser.add_argument(
        "--served-model-name",
        default=None,
        help="the model name the HTTP API answers to (default: the model's own: a GGUF file's general.name, a "
        "directory's name)",
    )
    parser.add_argument(
        "--kv-peers",
        nargs="+",
        default=None,
        metavar="HOST:PORT",
        help="decode side: the only workers KV may be pulled from, prefill workers and the peers a prompt's prefix "
        "comes from (default: any a request names; with --auth-token only authenticated requests name one); '-': "
        "read them from the first line of stdin once the model has loaded, and add every later line (how `kvservice "
        "launch` starts decode workers while its prefill workers still load, then tells them about each other)",
    )
    add_engine_arguments(parser)
    add_tls_arguments(parser)
    add_worker_peer_names_argument(parser)


def engine_config(args: argparse.Namespace) -> EngineConfig:
    config = engine_args.engine_config(args)
    if args.role != "both":  # the lane is a colocated worker's own prefill
        config = dataclasses.replace(config, prompt_lane=False)
    if args.role == "prefill" and config.speculative_method == "ngram":
        # A prefill worker samples only the first token, so it verifies nothing; prompt lookup
        # has nothing to hand on. A draft model stays: its prompt KV, computed while the
        # target's save is in flight, travels to the decode worker with the target's.
        return dataclasses.replace(config, speculative_method=None, num_speculative_tokens=0)
    return config


def main(args: argparse.Namespace) -> int:
    configure_logging(args.log_level)
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    try:
        config = engine_config(args)
        layout = kv_transfer_layout(args.model, config)
        if args.kv_offload_gib <= 0:
            raise ValueError(f"--kv-offload-gib must be > 0, got {args.kv_offload_gib}")
        if args.max_queued_requests < 1:
            raise ValueError(f"--max-queued-requests must be >= 1, got {args.max_queued_requests}")
        if args.http_port is not None and args.role != "both":
            raise ValueError(
                "--http-port: only a colocated worker (--role both) serves the HTTP API; for a prefill/decode pair, "
                "give it to the proxy"
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


async def serve(args: argparse.Namespace, config: EngineConfig, layout: KVCacheLayout, tls: TLSFiles) -> int:
    """Build the role's worker, serve until a signal (or the engine fails), drain, stop."""
    worker = await ROLE_BUILDERS[args.role](args, config, layout, tls)
    async_engine = worker.async_engine
    async_engine.start()
    # The step thread (and the pool it starts) computes; this thread and what it starts serve.
    lower_serving_threads([async_engine.step_thread_id])
    port = worker.server.bind(args.host, args.port)
    await worker.server.set_serving(True)
    ready_line = f"kvservice serve: role={args.role} listening on {args.host}:{port}"
    runners = []
    if worker.generation is not None and args.http_port is not None:
        front = OpenAIFront(
            worker.generation,
            args.served_model_name or worker.engine.core.loaded.name,
            lambda: async_engine.is_alive,
            args.auth_token,
            worker.engine.tokenizer,
            worker.engine.max_model_len,
        )
        runner, http_port = await start_http(
            front.app(), args.host, args.http_port, shutdown_timeout=args.grace_period, ssl_context=tls.ssl_context()
        )
        runners.append(runner)
        ready_line += f"; http on {args.host}:{http_port}"
    if args.metrics_port is not None:
        metrics_app_ = metrics_app(worker.metrics, worker.worker_service.stats)
        metrics_runner, metrics_port = await start_http(metrics_app_, args.host, args.metrics_port)
        runners.append(metrics_runner)
        ready_line += f"; metrics on {args.host}:{metrics_port}"
    stop = asyncio.Event()
    watchdog = asyncio.create_task(_stop_when_engine_fails(async_engine, worker.server, stop))

    async def on_stop() -> None:
        for task in [watchdog, *worker.tasks]:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for runner in runners:
            await runner.cleanup()
        await async_engine.stop()
        for close in worker.closers:
            close()

    async def prepare_drain(deadline: float) -> None:
        worker.kv_events.close()  # event streams never end by themselves: end them before the drain waits
        if worker.drain is not None:
            await worker.drain()

    await worker.server.run_until_signalled(
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
