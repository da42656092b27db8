"""`kvservice bench transfer`: one prompt's KV cache, prefill process to decode process,
over the real PullKV path (gRPC, and the same-host shared-memory segment) and over raw
TCP and a plain gRPC stream, side by side in one run.

The gRPC side runs the serving code itself. A prefill process holds a seeded random KV
cache (8B-like layout), stages the request's blocks through
`PrefillKVConnector.save_kv_layer` layer by layer into a `TransferRegistry`, and serves
them with `KVTransferService` on a grpc.aio server. A decode process pulls them with
`pull_kv` into its own preallocated cache, at different block ids (the mapping is part of
what is checked), timing from the request to the done frame. Each side then checksums
every layer's blocks in the prompt's order; a run whose bytes differ fails instead of
reporting a number (`verify_pull`). The same pair of processes then pulls again with
`--kv-transfer-shm`'s segment offered: reported apart, never as the gRPC figure. The TCP
side is `tcp_transfer` with the same number of bytes; `plain_grpc_transfer` shows what a
grpc.aio stream of prebuilt bytes moves here, the ceiling of the gRPC path. The child
processes and their messages live in `transfer_worker`.

Every process starts with the workers' environment (`WORKER_ENV`: malloc tunables and
passive OpenMP) and one torch thread: docs/benchmarks/method.md, "The processes' environment".
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import secrets
import statistics
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

import torch

from kvservice.client.bench.grpc_baseline import PlainGrpcResult, plain_grpc_transfer
from kvservice.client.bench.tcp_baseline import MiB, close_children, pin, tcp_transfer
from kvservice.client.bench.transfer_worker import (
    FIRST_TOKEN_ID,
    BenchSetup,
    CpuQuery,
    CpuTime,
    DecodeReady,
    PrefillReady,
    Pull,
    Pulled,
    Stage,
    Staged,
    Stop,
    Stopped,
    decode_process,
    expect,
    prefill_process,
)
from kvservice.model.kv_cache import KVCacheLayout
from kvservice.runtime.process_env import WORKER_ENV

# 8B-like (Llama 3 8B): 32 layers, 8 KV heads of 128, bfloat16, 16-token blocks. 128 KiB a token.
BENCH_LAYOUT = KVCacheLayout(num_layers=32, block_size=16, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16)
# What a process may hold beyond its caches and staging: gRPC's send/receive buffers and
# flow-control windows, frames being copied, malloc slack. Seen here at 256-512 MiB: the
# receiver 30-45 MiB, up to 81 MiB on a loaded machine (gRPC reads ahead of a slow consumer).
IN_FLIGHT_ALLOWANCE_BYTES = 96 * MiB


@dataclass(frozen=True, slots=True)
class GrpcTransfer:
    """One verified pull; `seconds` runs on the receiver from the request to the done frame."""

    seconds: float
    gb_per_s: float
    staging_seconds: float
    sender_cpu_seconds: float  # the prefill process's CPU time, all threads, while it served the pull
    receiver_cpu_seconds: float
    num_verified_bytes: int  # bytes whose checksums matched the prefill's (`verify_pull`)


def verify_pull(pulled: Pulled, sent_checksums: list[int]) -> None:
    """Raise unless the pull delivered exactly the prefill's bytes, into its own blocks only."""
    if pulled.error is not None:
        raise RuntimeError(f"bench transfer: the pull failed: {pulled.error}")
    if pulled.first_token_id != FIRST_TOKEN_ID:
        raise RuntimeError(f"bench transfer: first token {pulled.first_token_id}, sent {FIRST_TOKEN_ID}")
    bad = [layer for layer, (a, b) in enumerate(zip(pulled.checksums, sent_checksums, strict=True)) if a != b]
    if bad:
        raise RuntimeError(f"bench transfer: received KV differs from the prefill's in layers {bad}")
    if not pulled.is_guard_zero:
        raise RuntimeError("bench transfer: the pull wrote into a block outside its transfer")


# ---------------------------------------------------------------- the orchestrating process


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

    def __init__(self, setup: BenchSetup, cores: tuple[int, int] | None = None) -> None:
        self.setup = setup
        ctx = mp.get_context("spawn")
        self._prefill_conn, prefill_child = ctx.Pipe()
        self._decode_conn, decode_child = ctx.Pipe()
        self._processes: list[mp.process.BaseProcess] = []
        self._num_pulls = 0
        try:
            self._prefill = ctx.Process(
                target=prefill_process, args=(prefill_child, setup), name="prefill", daemon=True
            )
            self._processes.append(self._prefill)
            self._prefill.start()
            pin(self._prefill, cores[0] if cores else None)
            ready = expect(self._prefill_conn, self._prefill, PrefillReady, setup.timeout_s)
            self.checksums = ready.checksums
            address = f"127.0.0.1:{ready.port}"
            self._decode = ctx.Process(
                target=decode_process, args=(decode_child, setup, address), name="decode", daemon=True
            )
            self._processes.append(self._decode)
            self._decode.start()
            pin(self._decode, cores[1] if cores else None)
            expect(self._decode_conn, self._decode, DecodeReady, setup.timeout_s)
        except BaseException:
            self.close()
            raise
        finally:
            prefill_child.close()
            decode_child.close()

    def transfer(self, use_shared_memory: bool = False) -> GrpcTransfer:
        """Stage one request on the prefill side, pull it, verify it bit for bit.
        `use_shared_memory`: the same-host path (bytes through a segment, headers over gRPC)."""
        timeout = self.setup.timeout_s
        self._num_pulls += 1
        request_id, token = f"bench-{self._num_pulls}", secrets.token_bytes(16)
        self._prefill_conn.send(Stage(request_id, token))
        staged = expect(self._prefill_conn, self._prefill, Staged, timeout)
        self._decode_conn.send(Pull(request_id, token, use_shared_memory))
        pulled = expect(self._decode_conn, self._decode, Pulled, timeout)
        self._prefill_conn.send(CpuQuery())
        sender_cpu_end = expect(self._prefill_conn, self._prefill, CpuTime, timeout).process_cpu_seconds
        verify_pull(pulled, self.checksums)
        num_bytes = self.setup.num_bytes
        return GrpcTransfer(
            pulled.seconds,
            num_bytes / pulled.seconds / 1e9,
            staged.seconds,
            sender_cpu_end - staged.process_cpu_seconds,
            pulled.cpu_seconds,
            num_bytes,
        )

    def stop(self) -> dict[str, dict[str, int]]:
        """Stop both processes; each one's memory figures."""
        memory = {}
        for process, conn in ((self._decode, self._decode_conn), (self._prefill, self._prefill_conn)):
            conn.send(Stop())
            memory[process.name] = expect(conn, process, Stopped, self.setup.timeout_s).memory
        return memory

    def close(self) -> None:
        close_children([self._prefill_conn, self._decode_conn], list(self._processes))


def _memory_check(memory: dict[str, dict[str, int]]) -> dict[str, Any]:
    """Each process's peak RSS against its bound: idle footprint + what it must hold + in flight."""
    report = {}
    for role, m in memory.items():
        held = m["kv_cache_bytes"] + m.get("staging_bytes", 0)
        bound = m["idle_rss_bytes"] + held + IN_FLIGHT_ALLOWANCE_BYTES
        report[role] = {**m, "bound_bytes": bound, "is_within_bound": m["peak_rss_bytes"] <= bound}
    return report


def _gbps_summary(prefix: str, gbps: list[float], tcp_gbps: list[float]) -> dict[str, float]:
    """Best and median GB/s of one path, and each as a ratio to raw TCP's best and median."""
    return {
        f"{prefix}_gbps": max(gbps),
        f"{prefix}_gbps_median": statistics.median(gbps),
        f"{prefix}_ratio": max(gbps) / max(tcp_gbps),
        f"{prefix}_ratio_median": statistics.median(gbps) / statistics.median(tcp_gbps),
    }


def _cpu_per_gb(runs: list[GrpcTransfer], num_bytes: int) -> dict[str, float]:
    """CPU seconds per GB moved, each side, best run."""
    return {
        "sender_cpu_s_per_gb": min(r.sender_cpu_seconds for r in runs) / (num_bytes / 1e9),
        "receiver_cpu_s_per_gb": min(r.receiver_cpu_seconds for r in runs) / (num_bytes / 1e9),
    }


def run_transfer_bench(
    size_mib: float,
    repeats: int,
    *,
    is_reversed: bool = False,
    seed: int = 0,
    timeout_s: float = 120.0,
    log: Callable[[str], None] = print,
    cores: tuple[int, int] | None = None,
    device: str = "cpu",
    shared_memory: bool = True,
) -> dict[str, Any]:
    """Ship `size_mib` of KV `repeats` times each way, alternating; the report as a dict.

    Each repeat runs, one after another: PullKV over gRPC, PullKV over the same-host
    segment (`shared_memory`), raw TCP, and a plain gRPC stream (`grpc_baseline`, the
    ceiling of the gRPC path here). Raises RuntimeError when any transfer delivers bytes
    that differ from the source.
    """
    layout = BENCH_LAYOUT
    bytes_per_token = layout.bytes_per_block // layout.block_size
    num_tokens = max(1, round(size_mib * MiB / bytes_per_token))
    setup = BenchSetup(layout, num_tokens, is_reversed, seed, timeout_s, device)
    grpc_runs: list[GrpcTransfer] = []
    shm_runs: list[GrpcTransfer] = []
    tcp_runs = []
    plain_runs: list[PlainGrpcResult] = []
    with _worker_environment():
        pair = _GrpcPair(setup, cores)
        try:
            for i in range(repeats):
                grpc_runs.append(pair.transfer())
                if shared_memory:
                    shm_runs.append(pair.transfer(use_shared_memory=True))
                tcp_runs.append(
                    tcp_transfer(setup.num_bytes, chunk_bytes=MiB, timeout_s=timeout_s, seed=seed + i, cores=cores)
                )
                plain_runs.append(plain_grpc_transfer(setup.num_bytes, timeout_s=timeout_s, seed=seed + i, cores=cores))
                shm = f", same-host shm {shm_runs[-1].gb_per_s:.2f}" if shared_memory else ""
                log(
                    f"  run {i + 1}/{repeats} (GB/s): PullKV gRPC {grpc_runs[-1].gb_per_s:.2f}{shm}, "
                    f"raw TCP {tcp_runs[-1].gb_per_s:.2f}, plain gRPC stream {plain_runs[-1].gb_per_s:.2f}"
                )
            memory = pair.stop()
        finally:
            pair.close()
    tcp_gbps = [r.gb_per_s for r in tcp_runs]
    grpc = _gbps_summary("grpc", [r.gb_per_s for r in grpc_runs], tcp_gbps)
    plain = _gbps_summary("plain_grpc", [r.gb_per_s for r in plain_runs], tcp_gbps)
    report: dict[str, Any] = {
        "device": device,
        "num_bytes": setup.num_bytes,
        "num_tokens": num_tokens,
        "layout": {**asdict(layout), "dtype": str(layout.dtype).removeprefix("torch.")},
        "dst_blocks": "reversed" if is_reversed else "contiguous",
        "repeats": repeats,
        "grpc_gbps": grpc["grpc_gbps"],
        "grpc_gbps_median": grpc["grpc_gbps_median"],
        "tcp_gbps": max(tcp_gbps),
        "tcp_gbps_median": statistics.median(tcp_gbps),
        "ratio": grpc["grpc_ratio"],
        "ratio_median": grpc["grpc_ratio_median"],
        **plain,
        # PullKV against the plain stream: what the serving path keeps of gRPC's ceiling.
        "grpc_of_plain_grpc_median": grpc["grpc_gbps_median"] / plain["plain_grpc_gbps_median"],
        "grpc_seconds": [r.seconds for r in grpc_runs],
        "tcp_seconds": [r.seconds for r in tcp_runs],
        "plain_grpc_receiver_cpu_s_per_gb": min(r.receiver_cpu_seconds / (r.num_bytes / 1e9) for r in plain_runs),
        "staging_seconds": [r.staging_seconds for r in grpc_runs],
        # CPU seconds per GB moved, each side, best run (DESIGN: ~0.37 per side for gRPC).
        **{f"grpc_{k}": v for k, v in _cpu_per_gb(grpc_runs, setup.num_bytes).items()},
        # Every PullKV transfer went through `verify_pull`, which raises on any difference.
        "num_verified_bytes": sum(r.num_verified_bytes for r in grpc_runs + shm_runs),
        "memory": _memory_check(memory),
        "tcp_peak_rss_bytes": {
            "sender": max(r.sender_peak_rss_bytes for r in tcp_runs),
            "receiver": max(r.receiver_peak_rss_bytes for r in tcp_runs),
        },
    }
    if shm_runs:
        report |= _gbps_summary("shm", [r.gb_per_s for r in shm_runs], tcp_gbps)
        report |= {f"shm_{k}": v for k, v in _cpu_per_gb(shm_runs, setup.num_bytes).items()}
    return report


# ---------------------------------------------------------------- command line


def _positive(kind: type) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        value = kind(text)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return value

    return parse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--size-mib",
        type=_positive(float),
        default=256.0,
        help="KV bytes per transfer, MiB (8B-like layout: 256 MiB = 2,048 tokens; default 256)",
    )
    parser.add_argument(
        "--repeats",
        type=_positive(int),
        default=5,
        help="transfers each way, alternating; best and median reported (default 5)",
    )
    parser.add_argument(
        "--reversed-blocks", action="store_true", help="decode-side block ids in descending order (no contiguous runs)"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the source KV (default 0)")
    parser.add_argument(
        "--timeout",
        type=_positive(float),
        default=120.0,
        help="seconds any one step may take before the run fails (default 120)",
    )
    parser.add_argument(
        "--no-pin",
        dest="pin",
        action="store_false",
        help="do not pin the sender and the receiver (gRPC and TCP alike) to two different cores",
    )
    parser.add_argument(
        "--device",
        default="cpu",
        help="'cpu' or 'cuda[:N]': where both processes' KV caches live (raw TCP moves host bytes; default cpu)",
    )
    parser.add_argument(
        "--no-shm",
        dest="shared_memory",
        action="store_false",
        help="skip the same-host shared-memory path (--kv-transfer-shm), reported apart from gRPC",
    )
    parser.add_argument("--json", action="store_true", help="end with one line of JSON: the whole report")


def _mib(num_bytes: int) -> str:
    return f"{num_bytes / MiB:.0f} MiB"


def main(args: argparse.Namespace) -> int:
    print(f"KV transfer, 8B-like layout, {args.size_mib:g} MiB, {args.repeats} run(s) each way:")
    available = sorted(os.sched_getaffinity(0))
    cores = (available[0], available[1]) if args.pin and len(available) >= 2 else None
    report = run_transfer_bench(
        args.size_mib,
        args.repeats,
        is_reversed=args.reversed_blocks,
        seed=args.seed,
        timeout_s=args.timeout,
        cores=cores,
        device=args.device,
        shared_memory=args.shared_memory,
    )
    r = report
    print(
        f"raw TCP:            best {r['tcp_gbps']:.2f} GB/s, median {r['tcp_gbps_median']:.2f}\n"
        f"PullKV over gRPC:   best {r['grpc_gbps']:.2f} GB/s, median {r['grpc_gbps_median']:.2f}; "
        f"{r['ratio']:.2f}x raw TCP best, {r['ratio_median']:.2f}x median (target >= 0.6x)\n"
        f"plain gRPC stream:  best {r['plain_grpc_gbps']:.2f} GB/s, median {r['plain_grpc_gbps_median']:.2f}; "
        f"{r['plain_grpc_ratio']:.2f}x raw TCP best, {r['plain_grpc_ratio_median']:.2f}x median "
        f"(gRPC's ceiling here; PullKV keeps {r['grpc_of_plain_grpc_median']:.2f} of it)"
    )
    if "shm_gbps" in r:
        print(
            f"same-host shm:      best {r['shm_gbps']:.2f} GB/s, median {r['shm_gbps_median']:.2f}; "
            f"{r['shm_ratio']:.2f}x raw TCP best, {r['shm_ratio_median']:.2f}x median "
            "(--kv-transfer-shm; not the gRPC path)"
        )
    print(
        f"CPU per GB (best run): PullKV gRPC sender {r['grpc_sender_cpu_s_per_gb']:.2f} s, "
        f"receiver {r['grpc_receiver_cpu_s_per_gb']:.2f} s; "
        f"plain gRPC receiver {r['plain_grpc_receiver_cpu_s_per_gb']:.2f} s"
        + (
            f"; shm sender {r['shm_sender_cpu_s_per_gb']:.2f} s, receiver {r['shm_receiver_cpu_s_per_gb']:.2f} s"
            if "shm_gbps" in r
            else ""
        )
    )
    print("every PullKV transfer verified bit for bit; the baselines by CRC-32")
    for role, m in report["memory"].items():
        held = f"KV {_mib(m['kv_cache_bytes'])}" + (
            f" + staging {_mib(m['staging_bytes'])}" if "staging_bytes" in m else ""
        )
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
