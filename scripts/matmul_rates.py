#!/usr/bin/env python3
"""GFLOP/s of the block-quantized matmul (`block_quant_linear`) on SmolLM2's projection shapes.

    .venv/bin/python scripts/matmul_rates.py [--rows 1 4 8 16 256 2040] [--threads 2]

For each row count M: each projection (qkv, o, gate/up, down) alone, its weights warm in the
caches; then a decode step's 30 layers of the four in a row, every layer its own weights, so
they stream from DRAM as in a served step. Random Q4_1-shaped codes, the same kernel path as
SmolLM2's; the figures to set against the CPU's FMA peak, and to compare builds or CPUs
(`ATEN_CPU_CAPABILITY=avx2` times the AVX2 build).
"""

from __future__ import annotations

from kvservice.runtime.process_env import exec_with_worker_env

exec_with_worker_env()  # as `kvservice serve` runs: the malloc tunables and OpenMP's policy, from the start

import argparse
import functools
import time
from collections.abc import Callable

import torch

from kvservice.model.block_quant import BlockQuantWeight
from kvservice.model.cpu_kernels import load_cpu_kernels

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}  # (N, K)
LAYERS = 30


def random_weight(num_rows: int, num_cols: int, gen: torch.Generator) -> BlockQuantWeight:
    codes = torch.randint(0, 16, (num_rows, num_cols), generator=gen, dtype=torch.int8)
    scales = (torch.rand(num_rows, num_cols // 32, generator=gen) * 0.01).half().float()
    mins = (-torch.rand(num_rows, num_cols // 32, generator=gen) * 0.08).half().float()
    return BlockQuantWeight.from_rows(codes, scales, mins)


def best_seconds(fn: Callable[[], object], repeats: int, rounds: int = 5) -> float:
    """The fastest of `rounds` timings of `repeats` calls, per call."""
    for _ in range(2):
        fn()
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(repeats):
            fn()
        best = min(best, (time.perf_counter() - start) / repeats)
    return best


def prepare_kernels(threads: int) -> torch.Generator:
    """Load the C++ kernels (or exit: nothing to time) and run on `threads` threads; a seeded generator."""
    if not load_cpu_kernels():
        raise SystemExit("the C++ kernels did not build here: nothing to time")
    torch.set_num_threads(threads)
    return torch.Generator().manual_seed(0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--rows",
        type=int,
        nargs="+",
        default=[1, 4, 8, 16, 256, 2040],
        help="row counts M (default: 1 4 8 16 256 2040)",
    )
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default: 2)")
    args = parser.parse_args()
    gen = prepare_kernels(args.threads)
    layers = [{name: random_weight(n, k, gen) for name, (n, k) in SHAPES.items()} for _ in range(LAYERS)]
    layer_flops = sum(2 * n * k for n, k in SHAPES.values())
    for rows in args.rows:
        inputs = {k: torch.randn(rows, k, generator=gen) for k in (576, 1536)}
        cells = []
        for name, (n, k) in SHAPES.items():
            seconds = best_seconds(
                functools.partial(layers[0][name].linear, inputs[k]), repeats=max(3, int(2e9 / (2 * rows * n * k)))
            )
            cells.append(f"{name} {1e3 * seconds:7.3f} ms {2 * rows * n * k / seconds / 1e9:5.0f}")
        seconds = best_seconds(functools.partial(decode_step, layers, inputs), repeats=1, rounds=7)
        print(
            f"M={rows:5d} | " + " | ".join(cells) + f" | {LAYERS} layers from DRAM {1e3 * seconds:7.2f} ms "
            f"{LAYERS * layer_flops * rows / seconds / 1e9:5.0f} GFLOP/s"
        )


def decode_step(layers: list[dict[str, BlockQuantWeight]], inputs: dict[int, torch.Tensor]) -> None:
    """Every layer's four projections in turn, each layer its own weights."""
    for layer in layers:
        for name, (_, k) in SHAPES.items():
            layer[name].linear(inputs[k])


if __name__ == "__main__":
    main()
