"""The two child processes of `kvservice bench transfer` and the typed messages they
exchange with the orchestrating process over a pipe.

The prefill process holds a seeded random KV cache, stages a request's blocks through
`PrefillKVConnector.save_kv_layer` layer by layer into a `TransferRegistry` and serves
them with `KVTransferService`; the decode process pulls them with `pull_kv` into its
own cache at other block ids and checksums what arrived. Each message is a dataclass:
the orchestrator waits for a message of a given type (`expect`), never a string tag.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import multiprocessing.connection
import os
import time
import zlib
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any, TypeVar

import torch

from kvservice.client.bench.tcp_baseline import peak_rss_bytes
from kvservice.model.kv_cache import KVCacheLayout, allocate_kv_caches
from kvservice.runtime.grpc_options import GRPC_OPTIONS

_CHANNEL_OPTIONS = [("grpc.max_receive_message_length", 64 << 20)]
FIRST_TOKEN_ID = 42  # what the prefill side completes each transfer with; the pull must return it

M = TypeVar("M")


@dataclass(frozen=True, slots=True)
class BenchSetup:
    """What both gRPC processes need to know; pickled into each."""

    layout: KVCacheLayout
    num_tokens: int
    is_reversed: bool  # decode block ids descending instead of ascending
    seed: int
    timeout_s: float
    device: str = "cpu"  # where both KV caches live; on CUDA the staging pool is pinned

    @property
    def num_blocks(self) -> int:
        return self.layout.num_blocks_for(self.num_tokens)

    @property
    def num_bytes(self) -> int:
        return self.num_blocks * self.layout.bytes_per_block


# ---------------------------------------------------------------- messages


@dataclass(frozen=True, slots=True)
class PrefillReady:
    port: int
    checksums: list[int]  # per layer, of the prompt's blocks in order (see `layer_checksums`)


@dataclass(frozen=True, slots=True)
class DecodeReady:
    pass


@dataclass(frozen=True, slots=True)
class Stage:
    """Orchestrator -> prefill: stage one request's KV under this id and token."""

    request_id: str
    token: bytes


@dataclass(frozen=True, slots=True)
class Staged:
    seconds: float
    process_cpu_seconds: float  # the prefill process's CPU time so far, all threads


@dataclass(frozen=True, slots=True)
class CpuQuery:
    pass


@dataclass(frozen=True, slots=True)
class CpuTime:
    process_cpu_seconds: float


@dataclass(frozen=True, slots=True)
class Pull:
    """Orchestrator -> decode: pull one staged request."""

    request_id: str
    token: bytes
    use_shared_memory: bool = False  # offer the prefill a segment (the same-host path)


@dataclass(frozen=True, slots=True)
class Pulled:
    seconds: float  # from the request to the done frame
    cpu_seconds: float
    error: str | None
    first_token_id: int | None
    checksums: list[int]
    is_guard_zero: bool  # block 0 belongs to no transfer: still all zeros


@dataclass(frozen=True, slots=True)
class Stop:
    pass


@dataclass(frozen=True, slots=True)
class Stopped:
    memory: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class ChildFailed:
    message: str


def expect(conn: Connection, process: mp.process.BaseProcess, kind: type[M], timeout_s: float) -> M:
    """The next message from `process`, which must be a `kind`; fails fast if the process died."""
    if not mp.connection.wait([conn, process.sentinel], timeout_s):
        raise TimeoutError(f"bench transfer: no {kind.__name__} message within {timeout_s} s")
    if not conn.poll():
        raise RuntimeError(f"bench transfer: the {process.name} process exited with code {process.exitcode}")
    message = conn.recv()
    if isinstance(message, ChildFailed):
        raise RuntimeError(f"bench transfer failed in the {message.message}")
    if not isinstance(message, kind):
        raise RuntimeError(f"bench transfer: expected {kind.__name__}, got {type(message).__name__}")
    return message


# ---------------------------------------------------------------- both processes


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def layer_checksums(kv_caches: list[torch.Tensor], block_ids: list[int]) -> list[int]:
    """Per layer, CRC-32 of K then V of each block, in the prompt's block order."""
    checksums = []
    for kv_layer in kv_caches:
        data = kv_layer.cpu().view(torch.uint8).numpy()  # [2, num_blocks, block_size, kv_heads, head_dim * itemsize]
        crc = 0
        for block_id in block_ids:
            crc = zlib.crc32(data[1, block_id], zlib.crc32(data[0, block_id], crc))
        checksums.append(crc)
    return checksums


def _child(role: str, conn: Connection, body: Callable[[], Coroutine[Any, Any, None]]) -> None:
    try:
        torch.set_num_threads(1)  # spinning OpenMP threads starve gRPC's on a small CPU
        asyncio.run(body())
    except BaseException as exc:
        conn.send(ChildFailed(f"{role}: {exc!r}"))
        raise
    finally:
        conn.close()


# ---------------------------------------------------------------- the prefill process


def prefill_process(conn: Connection, setup: BenchSetup) -> None:
    _child("prefill", conn, lambda: _serve_prefill(conn, setup))


async def _serve_prefill(conn: Connection, setup: BenchSetup) -> None:
    import grpc

    from kvservice.connector.kv_transfer_service import KVTransferService
    from kvservice.connector.prefill_connector import (
        PrefillConnectorMetadata,
        PrefillKVConnector,
        SaveSpec,
    )
    from kvservice.connector.staging import StagingPool
    from kvservice.connector.transfer_registry import TransferRegistry
    from kvservice.model.attention import AttentionMetadata

    idle_rss = _rss_bytes()
    layout = setup.layout
    gen = torch.Generator().manual_seed(setup.seed)
    kv_caches = allocate_kv_caches(layout, setup.num_blocks, torch.device("cpu"))
    for kv_layer in kv_caches:
        kv_layer.normal_(generator=gen)
    kv_caches = [t.to(setup.device) for t in kv_caches]
    # The prompt's blocks sit scattered in the cache: staging gathers them.
    block_ids = torch.randperm(setup.num_blocks, generator=gen).tolist()
    checksums = layer_checksums(kv_caches, block_ids)
    pool = StagingPool(setup.num_bytes, pin_memory=setup.device.startswith("cuda"))
    registry = TransferRegistry(pool, layout, lease_seconds=setup.timeout_s)
    connector = PrefillKVConnector(registry)
    connector.register_kv_caches(kv_caches, layout)
    no_attention = AttentionMetadata(torch.empty(0, dtype=torch.long), 0, None, None, [])

    def stage(request_id: str, token: bytes) -> float:
        """The prefill step's save path, layer by layer, then the request's completion."""
        start = time.perf_counter()
        registry.register(request_id, token, setup.num_tokens)
        connector.bind_connector_metadata(PrefillConnectorMetadata([SaveSpec(request_id, 0, block_ids)]))
        for layer, kv_layer in enumerate(kv_caches):
            connector.save_kv_layer(layer, kv_layer, no_attention)
        connector.wait_for_save()
        connector.clear_connector_metadata()
        registry.complete(request_id, FIRST_TOKEN_ID)
        return time.perf_counter() - start

    server = grpc.aio.server(options=GRPC_OPTIONS)
    transfer_service = KVTransferService(registry)
    server.add_generic_rpc_handlers((transfer_service.handler(),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        conn.send(PrefillReady(port, checksums))
        while not isinstance(message := await asyncio.to_thread(conn.recv), Stop):
            if isinstance(message, Stage):
                seconds = await asyncio.to_thread(stage, message.request_id, message.token)
                conn.send(Staged(seconds, time.process_time()))
            else:
                assert isinstance(message, CpuQuery), message
                conn.send(CpuTime(time.process_time()))
    finally:
        await server.stop(grace=1.0)
        transfer_service.close()
    memory = {
        "idle_rss_bytes": idle_rss,
        "peak_rss_bytes": peak_rss_bytes(),
        "kv_cache_bytes": sum(t.nbytes for t in kv_caches),
        "staging_bytes": pool.capacity_bytes,
        "staging_bytes_in_use_at_end": pool.bytes_in_use,
    }
    conn.send(Stopped(memory))


# ---------------------------------------------------------------- the decode process


def decode_process(conn: Connection, setup: BenchSetup, address: str) -> None:
    _child("decode", conn, lambda: _serve_decode(conn, setup, address))


async def _serve_decode(conn: Connection, setup: BenchSetup, address: str) -> None:
    import grpc

    from kvservice.connector.kv_puller import LoadSpec, pull_kv
    from kvservice.connector.shared_memory import SegmentPool
    from kvservice.core.outputs import KVTransferCounters

    idle_rss = _rss_bytes()
    layout = setup.layout
    n = setup.num_blocks
    # Block 0 belongs to nobody: it must still be zero after every pull.
    kv_caches = allocate_kv_caches(layout, n + 1, torch.device(setup.device))
    block_ids = list(range(n, 0, -1)) if setup.is_reversed else list(range(1, n + 1))
    stats = KVTransferCounters()
    segments = SegmentPool()  # as a decode worker's: kept across pulls
    async with grpc.aio.insecure_channel(address, options=_CHANNEL_OPTIONS) as channel:
        await asyncio.wait_for(channel.channel_ready(), setup.timeout_s)
        conn.send(DecodeReady())
        while isinstance(message := await asyncio.to_thread(conn.recv), Pull):
            request_id, token = message.request_id, message.token
            for kv_layer in kv_caches:
                kv_layer.zero_()  # a pull that wrote nothing must not pass on the last run's bytes
            spec = LoadSpec(request_id, address, token, block_ids, setup.num_tokens)
            start, start_cpu = time.perf_counter(), time.process_time()
            result = await pull_kv(
                channel,
                spec,
                kv_caches,
                layout,
                setup.timeout_s,
                stats,
                segments=segments if message.use_shared_memory else None,
            )
            if kv_caches[0].is_cuda:
                torch.cuda.synchronize(kv_caches[0].device)  # the last copies into the cache count too
            seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - start_cpu
            is_guard_zero = not any(bool(t[:, 0].view(torch.uint8).any()) for t in kv_caches)
            checksums = layer_checksums(kv_caches, block_ids)
            conn.send(Pulled(seconds, cpu_seconds, result.error, result.first_token_id, checksums, is_guard_zero))
    segments.close()
    memory = {
        "idle_rss_bytes": idle_rss,
        "peak_rss_bytes": peak_rss_bytes(),
        "kv_cache_bytes": sum(t.nbytes for t in kv_caches),
    }
    conn.send(Stopped(memory))
