"""`kvservice bench transfer`: one prompt's KV cache, prefill process to decode process,
over the real PullKV path and over raw TCP, side by side in one run.

The gRPC side runs the serving code itself. A prefill process holds a seeded random KV
cache (8B-like layout), stages the request's blocks through
`PrefillKVConnector.save_kv_layer` layer by layer into a `TransferRegistry`, and serves
them with `KVTransferService` on a grpc.aio server. A decode process pulls them with
`pull_kv` into its own preallocated cache, at different block ids (the mapping is part of
what is checked), timing from the request to the done frame. Each side then checksums
every layer's blocks in the prompt's order; a run whose bytes differ fails instead of
reporting a number. The TCP side is `tcp_transfer` with the same number of bytes.

Every process starts with the workers' environment (`WORKER_ENV`: malloc tunables and
passive OpenMP) and one torch thread: DESIGN.md, "Performance targets".
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing as mp
import multiprocessing.connection
import os
import secrets
import statistics
import time
import zlib
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from multiprocessing.connection import Connection
from typing import Any

import torch

from kvservice.client.bench.tcp_baseline import MiB, peak_rss_bytes, pin, tcp_transfer
from kvservice.connector.kv_transfer_service import GRPC_OPTIONS
from kvservice.kv_cache import KVCacheLayout, allocate_kv_caches
from kvservice.process_env import WORKER_ENV

# 8B-like (Llama 3 8B): 32 layers, 8 KV heads of 128, bfloat16, 16-token blocks. 128 KiB a token.
BENCH_LAYOUT = KVCacheLayout(num_layers=32, block_size=16, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16)
# What a process may hold beyond its caches and staging: gRPC's send/receive buffers and
# flow-control windows, frames being copied, malloc slack. Seen here at 256-512 MiB: the
# receiver 30-45 MiB, up to 81 MiB on a loaded machine (gRPC reads ahead of a slow consumer).
IN_FLIGHT_ALLOWANCE_BYTES = 96 * MiB
_CHANNEL_OPTIONS = [("grpc.max_receive_message_length", 64 << 20)]
_FIRST_TOKEN_ID = 42


@dataclass(frozen=True, slots=True)
class _Setup:
    """What both gRPC processes need to know; pickled into each."""

    layout: KVCacheLayout
    num_tokens: int
    is_reversed: bool  # decode block ids descending instead of ascending
    seed: int
    timeout_s: float

    @property
    def num_blocks(self) -> int:
        return -(-self.num_tokens // self.layout.block_size)

    @property
    def num_bytes(self) -> int:
        return self.num_blocks * self.layout.bytes_per_block


@dataclass(frozen=True, slots=True)
class GrpcTransfer:
    """One verified pull; `seconds` runs on the receiver from the request to the done frame."""

    seconds: float
    gb_per_s: float
    staging_seconds: float
    sender_cpu_seconds: float  # the prefill process's CPU time, all threads, while it served the pull
    receiver_cpu_seconds: float


# ---------------------------------------------------------------- both gRPC processes


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _layer_checksums(kv_caches: list[torch.Tensor], block_ids: list[int]) -> list[int]:
    """Per layer, CRC-32 of K then V of each block, in the prompt's block order."""
    checksums = []
    for kv_layer in kv_caches:
        data = kv_layer.view(torch.uint8).numpy()  # [2, num_blocks, block_size, kv_heads, head_dim * itemsize]
        crc = 0
        for block_id in block_ids:
            crc = zlib.crc32(data[1, block_id], zlib.crc32(data[0, block_id], crc))
        checksums.append(crc)
    return checksums


def _child(role: str, conn: Connection, body: Callable[[], Any]) -> None:
    try:
        torch.set_num_threads(1)  # spinning OpenMP threads starve gRPC's on a small CPU
        asyncio.run(body())
    except BaseException as exc:
        conn.send(("error", f"{role}: {exc!r}"))
        raise
    finally:
        conn.close()


# ---------------------------------------------------------------- the prefill process


def _prefill_process(conn: Connection, setup: _Setup) -> None:
    _child("prefill", conn, lambda: _serve_prefill(conn, setup))


async def _serve_prefill(conn: Connection, setup: _Setup) -> None:
    import grpc

    from kvservice.attention import AttentionMetadata
    from kvservice.connector.kv_transfer_service import KVTransferService
    from kvservice.connector.prefill_connector import (
        PrefillConnectorMetadata,
        PrefillKVConnector,
        SaveSpec,
    )
    from kvservice.connector.staging import StagingPool
    from kvservice.connector.transfer_registry import TransferRegistry

    idle_rss = _rss_bytes()
    layout = setup.layout
    gen = torch.Generator().manual_seed(setup.seed)
    kv_caches = allocate_kv_caches(layout, setup.num_blocks, torch.device("cpu"))
    for kv_layer in kv_caches:
        kv_layer.normal_(generator=gen)
    # The prompt's blocks sit scattered in the cache: staging gathers them.
    block_ids = torch.randperm(setup.num_blocks, generator=gen).tolist()
    checksums = _layer_checksums(kv_caches, block_ids)
    pool = StagingPool(setup.num_bytes)
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
        registry.complete(request_id, _FIRST_TOKEN_ID)
        return time.perf_counter() - start

    server = grpc.aio.server(options=GRPC_OPTIONS)
    server.add_generic_rpc_handlers((KVTransferService(registry).handler(),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        conn.send(("ready", port, checksums))
        while (message := await asyncio.to_thread(conn.recv))[0] != "stop":
            if message[0] == "stage":
                conn.send(("staged", await asyncio.to_thread(stage, message[1], message[2]), time.process_time()))
            else:  # "cpu": the process's CPU seconds so far, all threads
                conn.send(("cpu", time.process_time()))
    finally:
        await server.stop(grace=1.0)
    memory = {
        "idle_rss_bytes": idle_rss,
        "peak_rss_bytes": peak_rss_bytes(),
        "kv_cache_bytes": sum(t.nbytes for t in kv_caches),
        "staging_bytes": pool.capacity_bytes,
        "staging_bytes_in_use_at_end": pool.bytes_in_use,
    }
    conn.send(("stopped", memory))


# ---------------------------------------------------------------- the decode process


def _decode_process(conn: Connection, setup: _Setup, address: str) -> None:
    _child("decode", conn, lambda: _serve_decode(conn, setup, address))


async def _serve_decode(conn: Connection, setup: _Setup, address: str) -> None:
    import grpc

    from kvservice.connector.kv_puller import LoadSpec, pull_kv
    from kvservice.connector.transfer_stats import TransferStats

    idle_rss = _rss_bytes()
    layout = setup.layout
    n = setup.num_blocks
    # Block 0 belongs to nobody: it must still be zero after every pull.
    kv_caches = allocate_kv_caches(layout, n + 1, torch.device("cpu"))
    block_ids = list(range(n, 0, -1)) if setup.is_reversed else list(range(1, n + 1))
    stats = TransferStats()
    async with grpc.aio.insecure_channel(address, options=_CHANNEL_OPTIONS) as channel:
        await asyncio.wait_for(channel.channel_ready(), setup.timeout_s)
        conn.send(("ready",))
        while (message := await asyncio.to_thread(conn.recv))[0] == "pull":
            _, request_id, token = message
            for kv_layer in kv_caches:
                kv_layer.zero_()  # a pull that wrote nothing must not pass on the last run's bytes
            spec = LoadSpec(request_id, address, token, block_ids, setup.num_tokens)
            start, start_cpu = time.perf_counter(), time.process_time()
            result = await pull_kv(channel, spec, kv_caches, layout, setup.timeout_s, stats)
            seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - start_cpu
            is_guard_zero = not any(bool(t[:, 0].view(torch.uint8).any()) for t in kv_caches)
            checksums = _layer_checksums(kv_caches, block_ids)
            conn.send(("pulled", seconds, cpu_seconds, result.error, result.first_token_id, checksums, is_guard_zero))
    memory = {
        "idle_rss_bytes": idle_rss,
        "peak_rss_bytes": peak_rss_bytes(),
        "kv_cache_bytes": sum(t.nbytes for t in kv_caches),
    }
    conn.send(("stopped", memory))


# ---------------------------------------------------------------- the orchestrating process


def _expect(conn: Connection, process: mp.process.BaseProcess, kind: str, timeout_s: float) -> tuple[Any, ...]:
    """The next message from `process`, which must be `kind`; fails fast if the process died."""
    if not mp.connection.wait([conn, process.sentinel], timeout_s):
        raise TimeoutError(f"bench transfer: no {kind!r} message within {timeout_s} s")
    if not conn.poll():
        raise RuntimeError(f"bench transfer: the {process.name} process exited with code {process.exitcode}")
    message = conn.recv()
    if message[0] == "error":
        raise RuntimeError(f"bench transfer failed in the {message[1]}")
    if message[0] != kind:
        raise RuntimeError(f"bench transfer: expected {kind!r}, got {message[0]!r}")
    return message[1:]


@contextlib.contextmanager
def _worker_environment() -> Iterator[None]:
    """Children spawned inside start with the workers' environment (read at process start)."""

    saved = {name: os.environ.get(name) for name in WORKER_ENV}
    os.environ.update(WORKER_ENV)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


class _GrpcPair:
    """A prefill and a decode process, kept up across repeats like real workers."""

    def __init__(self, setup: _Setup, cores: tuple[int, int] | None = None) -> None:
        self.setup = setup
        ctx = mp.get_context("spawn")
        self._prefill_conn, prefill_child = ctx.Pipe()
        self._decode_conn, decode_child = ctx.Pipe()
        self._processes: list[mp.process.BaseProcess] = []
        self._num_pulls = 0
        try:
            self._prefill = ctx.Process(target=_prefill_process, args=(prefill_child, setup), name="prefill", daemon=True)
            self._processes.append(self._prefill)
            self._prefill.start()
            pin(self._prefill, cores[0] if cores else None)
            port, self.checksums = _expect(self._prefill_conn, self._prefill, "ready", setup.timeout_s)
            address = f"127.0.0.1:{port}"
            self._decode = ctx.Process(target=_decode_process, args=(decode_child, setup, address), name="decode", daemon=True)
            self._processes.append(self._decode)
            self._decode.start()
            pin(self._decode, cores[1] if cores else None)
            _expect(self._decode_conn, self._decode, "ready", setup.timeout_s)
        except BaseException:
            self.close()
            raise
        finally:
            prefill_child.close()
            decode_child.close()

    def transfer(self) -> GrpcTransfer:
        """Stage one request on the prefill side, pull it, verify it bit for bit."""
        timeout = self.setup.timeout_s
        self._num_pulls += 1
        request_id, token = f"bench-{self._num_pulls}", secrets.token_bytes(16)
        self._prefill_conn.send(("stage", request_id, token))
        staging_seconds, sender_cpu_start = _expect(self._prefill_conn, self._prefill, "staged", timeout)
        self._decode_conn.send(("pull", request_id, token))
        seconds, receiver_cpu, error, first_token_id, checksums, is_guard_zero = _expect(
            self._decode_conn, self._decode, "pulled", timeout
        )
        self._prefill_conn.send(("cpu",))
        (sender_cpu_end,) = _expect(self._prefill_conn, self._prefill, "cpu", timeout)
        if error is not None:
            raise RuntimeError(f"bench transfer: the pull failed: {error}")
        if first_token_id != _FIRST_TOKEN_ID:
            raise RuntimeError(f"bench transfer: first token {first_token_id}, sent {_FIRST_TOKEN_ID}")
        bad = [layer for layer, (a, b) in enumerate(zip(checksums, self.checksums, strict=True)) if a != b]
        if bad:
            raise RuntimeError(f"bench transfer: received KV differs from the prefill's in layers {bad}")
        if not is_guard_zero:
            raise RuntimeError("bench transfer: the pull wrote into a block outside its transfer")
        num_bytes = self.setup.num_bytes
        return GrpcTransfer(seconds, num_bytes / seconds / 1e9, staging_seconds, sender_cpu_end - sender_cpu_start, receiver_cpu)

    def stop(self) -> dict[str, dict[str, int]]:
        """Stop both processes; each one's memory figures."""
        memory = {}
        for process, conn in ((self._decode, self._decode_conn), (self._prefill, self._prefill_conn)):
            conn.send(("stop",))
            (memory[process.name],) = _expect(conn, process, "stopped", self.setup.timeout_s)
        return memory

    def close(self) -> None:
        for conn in (self._prefill_conn, self._decode_conn):
            conn.close()
        for process in self._processes:
            if process.pid is None:
                continue  # never started
            process.join(timeout=5)
            if process.is_alive():
                process.kill()
                process.join()


def _memory_check(memory: dict[str, dict[str, int]]) -> dict[str, Any]:
    """Each process's peak RSS against its bound: idle footprint + what it must hold + in flight."""
    report = {}
    for role, m in memory.items():
        held = m["kv_cache_bytes"] + m.get("staging_bytes", 0)
        bound = m["idle_rss_bytes"] + held + IN_FLIGHT_ALLOWANCE_BYTES
        report[role] = {**m, "bound_bytes": bound, "is_within_bound": m["peak_rss_bytes"] <= bound}
    return report


def run_transfer_bench(
    size_mib: float,
    repeats: int,
    *,
    is_reversed: bool = False,
    seed: int = 0,
    timeout_s: float = 120.0,
    log: Callable[[str], None] = print,
    cores: tuple[int, int] | None = None,
) -> dict[str, Any]:
    """Ship `size_mib` of KV `repeats` times each way, alternating; the report as a dict.

    Raises RuntimeError when any transfer delivers bytes that differ from the source.
    """
    layout = BENCH_LAYOUT
    bytes_per_token = layout.bytes_per_block // layout.block_size
    num_tokens = max(1, round(size_mib * MiB / bytes_per_token))
    setup = _Setup(layout, num_tokens, is_reversed, seed, timeout_s)
    grpc_runs: list[GrpcTransfer] = []
    tcp_runs = []
    with _worker_environment():
        pair = _GrpcPair(setup, cores)
        try:
            for i in range(repeats):
                grpc_runs.append(pair.transfer())
                tcp_runs.append(tcp_transfer(setup.num_bytes, chunk_bytes=MiB, timeout_s=timeout_s, seed=seed + i, cores=cores))
                log(
                    f"  run {i + 1}/{repeats}: gRPC {grpc_runs[-1].gb_per_s:.2f} GB/s "
                    f"({grpc_runs[-1].seconds * 1e3:.1f} ms), TCP {tcp_runs[-1].gb_per_s:.2f} GB/s "
                    f"({tcp_runs[-1].seconds * 1e3:.1f} ms)"
                )
            memory = pair.stop()
        finally:
            pair.close()
    grpc_gbps = [r.gb_per_s for r in grpc_runs]
    tcp_gbps = [r.gb_per_s for r in tcp_runs]
    return {
        "num_bytes": setup.num_bytes,
        "num_tokens": num_tokens,
        "layout": {**asdict(layout), "dtype": str(layout.dtype).removeprefix("torch.")},
        "dst_blocks": "reversed" if is_reversed else "contiguous",
        "repeats": repeats,
        "grpc_gbps": max(grpc_gbps),
        "grpc_gbps_median": statistics.median(grpc_gbps),
        "tcp_gbps": max(tcp_gbps),
        "tcp_gbps_median": statistics.median(tcp_gbps),
        "ratio": max(grpc_gbps) / max(tcp_gbps),
        "ratio_median": statistics.median(grpc_gbps) / statistics.median(tcp_gbps),
        "grpc_seconds": [r.seconds for r in grpc_runs],
        "tcp_seconds": [r.seconds for r in tcp_runs],
        "staging_seconds": [r.staging_seconds for r in grpc_runs],
        # CPU seconds per GB moved, each side, best run (DESIGN: ~0.37 per side for gRPC).
        "grpc_sender_cpu_s_per_gb": min(r.sender_cpu_seconds for r in grpc_runs) / (setup.num_bytes / 1e9),
        "grpc_receiver_cpu_s_per_gb": min(r.receiver_cpu_seconds for r in grpc_runs) / (setup.num_bytes / 1e9),
        "is_verified": True,  # every run's checksums matched, or we raised
        "memory": _memory_check(memory),
        "tcp_peak_rss_bytes": {
            "sender": max(r.sender_peak_rss_bytes for r in tcp_runs),
            "receiver": max(r.receiver_peak_rss_bytes for r in tcp_runs),
        },
    }


# ---------------------------------------------------------------- command line


def _positive(kind: type) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        value = kind(text)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return value

    return parse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--size-mib", type=_positive(float), default=256.0,
                        help="KV bytes per transfer, MiB (8B-like layout: 256 MiB = 2,048 tokens; default 256)")
    parser.add_argument("--repeats", type=_positive(int), default=5,
                        help="transfers each way, alternating; best and median reported (default 5)")
    parser.add_argument("--reversed-blocks", action="store_true",
                        help="decode-side block ids in descending order (no contiguous runs)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the source KV (default 0)")
    parser.add_argument("--timeout", type=_positive(float), default=120.0,
                        help="seconds any one step may take before the run fails (default 120)")
    parser.add_argument("--no-pin", dest="pin", action="store_false",
                        help="do not pin the sender and the receiver (gRPC and TCP alike) to two different cores")
    parser.add_argument("--json", action="store_true", help="end with one line of JSON: the whole report")


def _mib(num_bytes: int) -> str:
    return f"{num_bytes / MiB:.0f} MiB"


def main(args: argparse.Namespace) -> int:
    print(f"KV transfer, 8B-like layout, {args.size_mib:g} MiB, {args.repeats} run(s) each way:")
    available = sorted(os.sched_getaffinity(0))
    cores = (available[0], available[1]) if args.pin and len(available) >= 2 else None
    report = run_transfer_bench(
        args.size_mib, args.repeats, is_reversed=args.reversed_blocks, seed=args.seed, timeout_s=args.timeout,
        cores=cores,
    )
    print(
        f"gRPC PullKV: best {report['grpc_gbps']:.2f} GB/s, median {report['grpc_gbps_median']:.2f}\n"
        f"raw TCP:     best {report['tcp_gbps']:.2f} GB/s, median {report['tcp_gbps_median']:.2f}\n"
        f"gRPC / TCP:  best {report['ratio']:.2f}x, median {report['ratio_median']:.2f}x "
        f"(target >= 0.6x); every transfer verified bit for bit\n"
        f"gRPC CPU per GB: sender {report['grpc_sender_cpu_s_per_gb']:.2f} s, "
        f"receiver {report['grpc_receiver_cpu_s_per_gb']:.2f} s (best run each)"
    )
    for role, m in report["memory"].items():
        held = f"KV {_mib(m['kv_cache_bytes'])}" + (f" + staging {_mib(m['staging_bytes'])}" if "staging_bytes" in m else "")
        verdict = "within" if m["is_within_bound"] else "OVER"
        print(
            f"{role} peak RSS {_mib(m['peak_rss_bytes'])}: {verdict} bound {_mib(m['bound_bytes'])} "
            f"(idle {_mib(m['idle_rss_bytes'])} + {held} + in flight {_mib(IN_FLIGHT_ALLOWANCE_BYTES)})"
        )
    tcp_rss = report["tcp_peak_rss_bytes"]
    print(f"TCP peak RSS: sender {_mib(tcp_rss['sender'])}, receiver {_mib(tcp_rss['receiver'])}")
    if args.json:
        print(json.dumps(report))
    return 0 if all(m["is_within_bound"] for m in report["memory"].values()) else 1
