"""One builder per worker role: each assembles its engine, connector and gRPC services.

  prefill: Worker.Prefill + KVTransfer.PullKV, with a staging pool and a transfer registry, and
           the pull connector beside its staging one (prefixes other workers hold);
  decode:  Worker.Decode, with the pull connector; KVTransfer.PullKV for the prefixes it exports;
  both:    the client API (Generation) and, on request, the OpenAI HTTP API; no connector.

Every role also serves Worker.Stats and Worker.SubscribeKVEvents. `kvservice.server.worker_server`
runs what a builder returns: starts the engine, binds the port, serves until a signal, drains.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import pathlib
import sys
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import grpc

from kvservice.config import EngineConfig
from kvservice.connector.base import KVConnectorBase
from kvservice.connector.decode_connector import DecodeKVConnector
from kvservice.connector.joined_connector import JoinedKVConnector
from kvservice.connector.kv_transfer_service import KVTransferService
from kvservice.connector.offload_store import DiskKVStore, OffloadStoreLockedError, StoreFingerprint
from kvservice.connector.offload_tier import OffloadTier
from kvservice.connector.prefill_connector import PrefillKVConnector
from kvservice.connector.staging import StagingPool
from kvservice.connector.transfer_registry import TransferRegistry
from kvservice.engine.async_engine import AsyncLLMEngine
from kvservice.engine.engine import LLMEngine
from kvservice.engine.engine_builder import build_engine
from kvservice.model.kv_cache import KVCacheLayout
from kvservice.runtime.tls import TLSFiles
from kvservice.server.auth import BearerTokenInterceptor, PeerNameInterceptor
from kvservice.server.colocated_service import ColocatedGenerationService
from kvservice.server.decode_service import DecodeWorkerService
from kvservice.server.grpc_server import SERVICE_NAMES, GrpcServer
from kvservice.server.kv_events import KVEventPublisher
from kvservice.server.metrics import ServerMetrics
from kvservice.server.prefill_service import PrefillWorkerService
from kvservice.server.worker_service import EngineWorkerService
from kvservice.v1 import kvservice_pb2_grpc as pb_grpc
from kvservice.worker.core_lease import CoreLease, LeaseRole

logger = logging.getLogger(__name__)

# --kv-staging-mib's default per role: a prefill worker stages every prompt it computes, a decode
# worker only the prefixes it exports to peers.
DEFAULT_STAGING_MIB = {"prefill": 256, "decode": 64}


class StartupError(RuntimeError):
    """What stops a worker before it serves, reported as one line (exit code 2)."""


@dataclass(slots=True)
class Worker:
    """A built worker, not yet serving: what `worker_server.serve` starts, runs and stops."""

    engine: LLMEngine
    async_engine: AsyncLLMEngine
    server: GrpcServer
    worker_service: EngineWorkerService
    metrics: ServerMetrics
    kv_events: KVEventPublisher
    generation: ColocatedGenerationService | None = None  # a colocated worker's client API
    # Run once on stop, after the engine has stopped (connector threads, transfer buffers).
    closers: list[Callable[[], None]] = field(default_factory=list)
    # Background tasks the worker owns (lease expiry), cancelled on stop.
    tasks: list[asyncio.Task[None]] = field(default_factory=list)
    # Before the grace period: what must finish or be promised before the server stops.
    drain: Callable[[], Awaitable[None]] | None = None


async def build_prefill_worker(
    args: argparse.Namespace, config: EngineConfig, layout: KVCacheLayout, tls: TLSFiles
) -> Worker:
    """Prefill: stages each prompt's KV in a bounded pool and serves it to decode workers' pulls."""
    registry = _transfer_registry(args, config, layout)
    # It stages its prompts' KV, and pulls the prefixes that other workers hold (a prefix source).
    connector = JoinedKVConnector(PrefillKVConnector(registry), _pulling_connector(args, layout, tls))
    engine, async_engine, kv_events = await _load_engine(args, config, connector, LeaseRole.YIELDING, layout)
    connector.loading.on_load_done = async_engine.wake
    server, transfer_service = _serving_pulls(args, tls, registry)
    metrics = ServerMetrics(args.role)
    service = PrefillWorkerService(
        async_engine, registry, metrics=metrics, kv_events=kv_events, kv_sending=transfer_service.stats
    )
    pb_grpc.add_WorkerServicer_to_server(service, server.server)

    async def drain() -> None:
        # Decode workers were promised this KV: refusing their pulls would make them recompute.
        if async_engine.error is None:
            await service.drain()

    return Worker(
        engine, async_engine, server, service, metrics, kv_events,
        closers=_closers(engine, connector.shutdown, transfer_service.close),
        tasks=[asyncio.create_task(_expire_leases(registry))],
        drain=drain,
    )  # fmt: skip


def _serving_pulls(
    args: argparse.Namespace, tls: TLSFiles, registry: TransferRegistry
) -> tuple[GrpcServer, KVTransferService]:
    """A server for the Worker service (added by the caller) and KVTransfer.PullKV of `registry`'s transfers."""
    server = GrpcServer(
        [SERVICE_NAMES["worker"], SERVICE_NAMES["kv_transfer"]], tls.server_credentials(), _interceptors(args)
    )
    transfer_service = KVTransferService(registry)
    server.server.add_generic_rpc_handlers([transfer_service.handler()])
    return server, transfer_service


async def build_decode_worker(
    args: argparse.Namespace, config: EngineConfig, layout: KVCacheLayout, tls: TLSFiles
) -> Worker:
    """Decode: pulls each prompt's KV from the prefill worker the request names, then generates;
    stages the prefixes it holds for other workers to pull (ExportKV)."""
    connector = _pulling_connector(args, layout, tls)
    # Read while the model loads (`--kv-peers -`); a decode worker fails here, before it computes anything.
    reading_kv_peers = asyncio.ensure_future(read_kv_peers(args.kv_peers))
    try:
        engine, async_engine, kv_events = await _load_engine(args, config, connector, LeaseRole.FIRST, layout)
    except BaseException:
        reading_kv_peers.cancel()
        raise
    kv_peers = await reading_kv_peers
    connector.on_load_done = async_engine.wake
    registry = _transfer_registry(args, config, layout)
    server, transfer_service = _serving_pulls(args, tls, registry)
    metrics = ServerMetrics(args.role)
    service = DecodeWorkerService(
        async_engine,
        metrics=metrics,
        kv_peers=kv_peers,
        kv_events=kv_events,
        kv_sending=transfer_service.stats,
        registry=registry,
    )
    pb_grpc.add_WorkerServicer_to_server(service, server.server)
    if args.kv_peers == ["-"]:
        read_more_kv_peers(service.allow_kv_peers)

    async def drain() -> None:
        service.drain()  # DecodeStreams never end by themselves: each ends once its requests have

    return Worker(
        engine, async_engine, server, service, metrics, kv_events,
        closers=_closers(engine, connector.shutdown, transfer_service.close),
        tasks=[asyncio.create_task(_expire_leases(registry))],
        drain=drain,
    )  # fmt: skip


async def build_colocated_worker(
    args: argparse.Namespace, config: EngineConfig, layout: KVCacheLayout, tls: TLSFiles
) -> Worker:
    """Colocated (`both`): prefill and decode in one engine, serving clients directly; the baseline."""
    engine, async_engine, kv_events = await _load_engine(args, config, None, LeaseRole.FIRST, layout)
    server = GrpcServer(
        [SERVICE_NAMES["generation"], SERVICE_NAMES["worker"]], tls.server_credentials(), _interceptors(args)
    )
    metrics = ServerMetrics(args.role)
    generation = ColocatedGenerationService(async_engine, metrics=metrics)
    pb_grpc.add_GenerationServicer_to_server(generation, server.server)
    service = EngineWorkerService(async_engine, "both", kv_events)
    pb_grpc.add_WorkerServicer_to_server(service, server.server)
    return Worker(
        engine, async_engine, server, service, metrics, kv_events, generation=generation, closers=_closers(engine)
    )


def _transfer_registry(args: argparse.Namespace, config: EngineConfig, layout: KVCacheLayout) -> TransferRegistry:
    """The transfers this worker's PullKV serves (a prefill's KV, or prefixes it exports), in a
    pool bounded by --kv-staging-mib."""
    mib = args.kv_staging_mib if args.kv_staging_mib is not None else DEFAULT_STAGING_MIB[args.role]
    pool = StagingPool(mib << 20, pin_memory=config.device.startswith("cuda"))
    return TransferRegistry(pool, layout, args.kv_lease_seconds)


def _pulling_connector(args: argparse.Namespace, layout: KVCacheLayout, tls: TLSFiles) -> DecodeKVConnector:
    """The connector that pulls KV from other workers: a prefill worker's, or a prefix source's."""
    return DecodeKVConnector(
        layout,
        transfer_timeout=args.kv_transfer_timeout,
        channel_credentials=tls.channel_credentials(),
        auth_token=args.auth_token,
        use_shared_memory=args.kv_transfer_shm,
    )


ROLE_BUILDERS = {"prefill": build_prefill_worker, "decode": build_decode_worker, "both": build_colocated_worker}


def read_more_kv_peers(add: Callable[[frozenset[str]], None]) -> None:
    """`--kv-peers -`, after the first line: every further line of stdin is more peers (the
    launcher's decode workers, once they are ready), passed to `add` on the caller's event loop
    until stdin ends. A daemon thread reads them: it never holds up the worker's exit."""
    loop = asyncio.get_running_loop()

    def read() -> None:
        for line in sys.stdin:
            if peers := frozenset(line.split()):
                loop.call_soon_threadsafe(add, peers)

    threading.Thread(target=read, name="kv-peers-stdin", daemon=True).start()


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


async def _load_engine(
    args: argparse.Namespace,
    config: EngineConfig,
    connector: KVConnectorBase | None,
    lease_role: LeaseRole,
    layout: KVCacheLayout,
) -> tuple[LLMEngine, AsyncLLMEngine, KVEventPublisher]:
    """The engine (loaded off the event loop), its async driver (not started) and its KV events."""
    core_lease = None
    if args.core_lease is not None and config.device == "cpu":  # what a GPU worker shares is not its cores
        core_lease = CoreLease(args.core_lease, lease_role, config.step_target_s)
    tier = offload_tier(args, layout.target)
    try:
        engine = await asyncio.to_thread(build_engine, args.model, config, connector, core_lease, kv_tier=tier)
    except BaseException:
        if tier is not None:
            tier.close()
        raise
    kv_events = KVEventPublisher(asyncio.get_running_loop(), config.block_size, engine.core.kv_hash_seed)
    async_engine = AsyncLLMEngine(
        engine, max_queued_requests=args.max_queued_requests, kv_events_sink=kv_events.publish
    )
    if tier is not None:
        tier.on_load_done = async_engine.wake  # a read finished: the engine may be idle, waiting for it
    return engine, async_engine, kv_events


def offload_tier(args: argparse.Namespace, layout: KVCacheLayout) -> OffloadTier | None:
    """The KV offload tier --kv-offload-dir asks for, its directory locked; None without the flag."""
    if args.kv_offload_dir is None:
        return None
    fingerprint = StoreFingerprint.from_layout(args.model, layout)
    label = f"{args.role} worker (pid {os.getpid()})"
    try:
        store = DiskKVStore(
            pathlib.Path(args.kv_offload_dir), int(args.kv_offload_gib * (1 << 30)), fingerprint, label=label
        )
    except OffloadStoreLockedError as e:
        raise StartupError(f"--kv-offload-dir: {e}") from None
    return OffloadTier(store)


def _closers(engine: LLMEngine, *closers: Callable[[], None]) -> list[Callable[[], None]]:
    """What a worker closes on stop, its offload tier last (its queued writes land first)."""
    tier = engine.core.kv_tier
    return [*closers, *([tier.close] if isinstance(tier, OffloadTier) else [])]


def _interceptors(args: argparse.Namespace) -> list[grpc.aio.ServerInterceptor]:
    """Every role checks the bearer token on every RPC but health; workers can also check the peer's certificate."""
    interceptors: list[grpc.aio.ServerInterceptor] = []
    if args.auth_token:
        interceptors.append(BearerTokenInterceptor(args.auth_token))
    if args.worker_peer_names is not None:
        interceptors.append(PeerNameInterceptor(args.worker_peer_names))
    return interceptors


async def _expire_leases(registry: TransferRegistry) -> None:
    while True:
        await asyncio.sleep(1.0)  # lease granularity, not synchronisation
        expired = registry.expire()
        if expired:
            logger.warning("KV lease expired for %d transfer(s): %s", len(expired), expired[:5])
