"""`kvservice launch`: N prefill + M decode workers and a proxy as local processes; Ctrl-C stops all."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import sys

from kvservice.client.cluster import LaunchError, LocalCluster
from kvservice.config import LAUNCH_STEP_TARGET_MS
from kvservice.runtime.engine_args import add_engine_arguments, engine_argv, engine_config
from kvservice.runtime.event_loop import run_event_loop
from kvservice.runtime.routing_args import add_routing_arguments, routing_argv
from kvservice.runtime.tls import (
    AUTH_TOKEN_ENV,
    TLSFiles,
    add_tls_arguments,
    add_worker_peer_names_argument,
    check_worker_peer_names,
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        default="tiny",
        help="'tiny', 'smollm2', a Hugging Face model directory or a GGUF file (default: tiny)",
    )
    parser.add_argument("--num-prefill", type=int, default=1, help="prefill workers (default: 1)")
    parser.add_argument("--num-decode", type=int, default=1, help="decode workers (default: 1)")
    parser.add_argument("--port", type=int, default=8000, help="the proxy's port (default: 8000; 0 lets the OS pick)")
    parser.add_argument(
        "--http-port", type=int, default=None, help="the proxy's OpenAI-compatible HTTP API on this port (default: off)"
    )
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="the proxy's Prometheus /metrics on this port; every worker gets one the OS picks (default: off)",
    )
    parser.add_argument(
        "--grace-period",
        type=float,
        default=30.0,
        help="seconds every child gets to drain on Ctrl-C / SIGTERM before it is killed (default: 30)",
    )
    parser.add_argument(
        "--kv-transfer-shm",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="KV from prefill to decode workers through shared-memory segments, only headers over gRPC (every "
        "worker runs on this host; `kvservice serve --kv-transfer-shm`): about half the CPU a KV byte costs over "
        "the gRPC stream (default: on)",
    )
    parser.add_argument(
        "--no-core-lease",
        action="store_true",
        help="let prefill and decode workers compute on the same cores at once (default: they take turns through a "
        "lease file, decode steps first: `kvservice serve --core-lease`)",
    )
    parser.add_argument(
        "--kv-offload-dir",
        metavar="DIR",
        default=None,
        help="give every worker a KV offload tier (`kvservice serve --kv-offload-dir`) in a subdirectory of DIR "
        "named for its role and index (prefill-0, decode-1, both), so launching again with the same DIR finds "
        "each worker's store again (default: off)",
    )
    parser.add_argument(
        "--kv-offload-gib", type=float, default=4.0, help="each worker's store bound in GiB (default: 4)"
    )
    add_routing_arguments(parser)  # passed to the proxy
    add_tls_arguments(parser)
    add_worker_peer_names_argument(parser)  # passed to every worker
    # Passed to every worker; the lease's decode-to-decode cycle aims lower than `serve`'s steps.
    add_engine_arguments(parser, step_target_ms=LAUNCH_STEP_TARGET_MS)
    parser.add_argument(
        "worker_args", nargs=argparse.REMAINDER, help="after '--': extra `kvservice serve` flags for every worker"
    )


def worker_argv(args: argparse.Namespace) -> list[str]:
    """Every worker's `kvservice serve` flags: the engine flags, peer names and shared-memory
    switch given to `launch`, then those after '--'."""
    peer_names = ["--worker-peer-names", *args.worker_peer_names] if args.worker_peer_names is not None else []
    shm = ["--kv-transfer-shm"] if args.kv_transfer_shm else []
    return [*engine_argv(args), *peer_names, *shm, *(a for a in args.worker_args if a != "--")]


def proxy_argv(args: argparse.Namespace) -> list[str]:
    """The proxy's flags: routing, the model (it loads the tokenizer only, to route text and chat
    prompts by what workers cache), and the HTTP and metrics ports given to `launch`."""
    argv = [*routing_argv(args), "--model", args.model]
    if args.http_port is not None:
        argv += ["--http-port", str(args.http_port)]
        if args.max_model_len is not None:
            argv += ["--max-model-len", str(args.max_model_len)]
    if args.metrics_port is not None:
        argv += ["--metrics-port", str(args.metrics_port)]
    return argv


def main(args: argparse.Namespace) -> int:
    try:
        engine_config(args)  # a bad engine flag fails here, not in every worker
        check_worker_peer_names(args.worker_peer_names, TLSFiles.from_args(args))
    except ValueError as e:
        print(f"kvservice launch: error: {e}", file=sys.stderr)
        return 2
    return run_event_loop(_launch(args, worker_argv(args)))


async def _launch(args: argparse.Namespace, worker_args: list[str]) -> int:
    tls = TLSFiles.from_args(args)
    proxy_args = [*tls.to_args(), *proxy_argv(args)]
    worker_args = [*worker_args, *tls.to_args()]
    if args.auth_token:
        # Through the environment, not argv (which `ps` shows): the proxy reads it from there.
        os.environ[AUTH_TOKEN_ENV] = args.auth_token
    if args.metrics_port is not None:
        worker_args = [*worker_args, "--metrics-port", "0"]
    cluster = LocalCluster(
        args.model,
        args.num_prefill,
        args.num_decode,
        args.port,
        worker_args,
        proxy_args=proxy_args,
        client_credentials=tls.channel_credentials(),
        grace_period=args.grace_period,
        core_lease=not args.no_core_lease,
        kv_offload_dir=args.kv_offload_dir,
        kv_offload_gib=args.kv_offload_gib,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        # A signal during start-up stops what has started, without waiting for the rest.
        starting = asyncio.create_task(cluster.start())
        stopper = asyncio.create_task(stop.wait())
        await asyncio.wait([starting, stopper], return_when=asyncio.FIRST_COMPLETED)
        stopper.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await stopper
        if not starting.done():
            starting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await starting
            print("kvservice launch: stopped during start-up", file=sys.stderr)
            return 1
        starting.result()
        print(f"kvservice launch: proxy listening on {cluster.address}", flush=True)
        for child in cluster.children:
            extras = "".join(
                f", {what} {address}"
                for what, address in (("http", child.http_address), ("metrics", child.metrics_address))
                if address
            )
            print(f"  {child.name:<10} {child.address}  (pid {child.process.pid}{extras})", flush=True)
        print("Ctrl-C or SIGTERM stops everything.", flush=True)
        waits = [asyncio.create_task(c.process.wait()) for c in cluster.children]
        stopper = asyncio.create_task(stop.wait())
        done, _ = await asyncio.wait([stopper, *waits], return_when=asyncio.FIRST_COMPLETED)
        for task in [stopper, *waits]:
            task.cancel()
        if stopper not in done:
            dead = [c.name for c in cluster.children if c.process.returncode is not None]
            print(f"kvservice launch: {', '.join(dead)} exited; stopping the rest", file=sys.stderr)
            return 1
        return 0
    except LaunchError as e:
        print(f"kvservice launch: error: {e}", file=sys.stderr)
        return 1
    finally:
        await cluster.stop()
