#!/usr/bin/env python3
"""GB/s of the paged decode attention (`paged_decode_attention`) on SmolLM2's shapes, its cache
streaming from DRAM as in a served decode step, against a plain read of as many bytes.

    .venv/bin/python scripts/attention_rates.py [--requests 16] [--context 128 320 512] [--threads 2]

A decode step reads every request's K and V rows once a layer: SmolLM2 (9 query heads, 3 KV
heads of 64) keeps 1,536 bytes a token a layer in float32, so 16 requests of 320 tokens read
~236 MB a step over its 30 layers, more than any cache holds. For each context length: the 30
layers' attention with each request's blocks in order in the cache, and with the blocks drawn
at random from a cache of a server's size (`--kv-cache-mib`'s default: a served cache after many
requests came and went); then a plain sum over a tensor of the same bytes, what the cores can
read at all. `ATEN_CPU_CAPABILITY=avx2` times the AVX2 build.
"""

from __future__ import annotations

from kvservice.runtime.process_env import exec_with_worker_env

exec_with_worker_env()  # as `kvservice serve` runs: the malloc tunables and OpenMP's policy, from the start

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from matmul_rates import prepare_kernels  # this folder's: python puts a script's folder on sys.path

from kvservice.config import DEFAULT_KV_CACHE_MIB
from kvservice.model.kv_cache import KVCacheLayout

LAYERS, HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 30, 9, 3, 64, 16


def median_seconds(fn: Callable[[], object], rounds: int = 15) -> float:
    """The median of `rounds` timings of one call, after two warm-up calls."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def attention_step(requests: int, context: int, layout: str, gen: torch.Generator) -> tuple[Callable[[], None], int]:
    """One decode step's attention over LAYERS layers, and the bytes of cache it reads. `layout`:
    "in order" (each request's blocks side by side) or "scattered" (drawn at random from a served
    cache's blocks)."""
    blocks_per_request = (context + BLOCK_SIZE - 1) // BLOCK_SIZE
    num_blocks = requests * blocks_per_request
    if layout == "in order":
        order = torch.arange(num_blocks)
    else:
        kv = KVCacheLayout(LAYERS, BLOCK_SIZE, KV_HEADS, HEAD_DIM, torch.float32)
        num_blocks = max(num_blocks, DEFAULT_KV_CACHE_MIB * 2**20 // kv.bytes_per_block)
        order = torch.randperm(num_blocks, generator=gen)[: requests * blocks_per_request]
    table = order.view(requests, blocks_per_request).contiguous()
    starts = torch.full((requests,), context - 1, dtype=torch.long)
    caches = [torch.randn(2, num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM, generator=gen) for _ in range(LAYERS)]
    q = torch.randn(requests, HEADS, HEAD_DIM, generator=gen)
    scale = HEAD_DIM**-0.5

    def step() -> None:
        for cache in caches:
            torch.ops.kvservice.paged_decode_attention(q, cache, table, starts, 1, scale)

    return step, LAYERS * requests * context * 2 * KV_HEADS * HEAD_DIM * 4


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=16, help="requests in the step (default: 16)")
    parser.add_argument(
        "--context",
        type=int,
        nargs="+",
        default=[128, 320, 512],
        help="tokens of each request's context (default: 128 320 512)",
    )
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default: 2)")
    args = parser.parse_args()
    gen = prepare_kernels(args.threads)
    for context in args.context:
        cells = []
        for layout in ("in order", "scattered"):
            step, num_bytes = attention_step(args.requests, context, layout, gen)
            seconds = median_seconds(step)
            cells.append(f"{layout} {1e3 * seconds:6.2f} ms {num_bytes / seconds / 1e9:5.1f} GB/s")
            del step
        plain = torch.randn(num_bytes // 4, generator=gen)
        seconds = median_seconds(plain.sum)
        cells.append(f"plain sum {1e3 * seconds:6.2f} ms {num_bytes / seconds / 1e9:5.1f} GB/s")
        print(f"{args.requests} requests of {context:4d} tokens, {num_bytes / 1e6:5.0f} MB | " + " | ".join(cells))


if __name__ == "__main__":
    main()
