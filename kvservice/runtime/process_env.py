"""Environment every kvservice worker process starts with (it must be set before the process starts).

- glibc malloc: keep large message buffers out of fresh mmaps and untrimmed, the largest
  single win for gRPC throughput measured here (0.35x -> 0.50x of raw TCP; docs/benchmarks/method.md).
- OpenMP threads that sleep instead of spinning against gRPC's threads on small machines,
  but only after a short spin (`GOMP_SPINCOUNT`): a decode step is ~150 parallel regions a
  few microseconds apart, and waking sleeping threads for each cost 12 ms of a 19 ms step
  (SmolLM2, 2 threads: 30.4 ms with a plain PASSIVE policy, 18.3-19.2 ms with 3k-100k spins).
  3k rather than more: the C++ kernels' own pool spins too, and OpenMP threads spinning
  longer take its cores. A step of 13 decoding requests plus a 32-token prompt chunk: 90-98 ms
  with 3k, 127-153 ms with 30k; the engine alone at concurrency 16: 158 vs 153 tok/s; a
  batch-1 decode step is the same (7.3 vs 7.5 ms).
"""

from __future__ import annotations

import os
import sys

WORKER_ENV: dict[str, str] = {
    "GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=33554432:glibc.malloc.trim_threshold=4294967296:"
    "glibc.malloc.top_pad=67108864:glibc.malloc.arena_max=1",
    "OMP_WAIT_POLICY": "PASSIVE",
    "GOMP_SPINCOUNT": "3000",
    "PYTHONUNBUFFERED": "1",
}


def exec_with_worker_env() -> None:
    """Run this script again with WORKER_ENV set (names already set keep their values), unless
    it already is: glibc reads its malloc tunables when the process starts, so a benchmark
    script that set them in `os.environ` measured without them (SmolLM2's gate/up projection of
    2,048 rows: ~165 GFLOP/s, its 25 MB outputs page-faulting, against ~190 with them). Call
    it first thing, before torch loads."""
    missing = {name: value for name, value in WORKER_ENV.items() if name not in os.environ}
    if missing:
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **missing})
