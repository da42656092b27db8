"""`kvservice bench spec --served`: where a served 1P1D pair's draft model runs over the prompt.

Three deployments of the same pair, one after the other, the same requests at concurrency 1:

- `draft on prefill` (the default): the prefill worker runs the draft over each prompt while its
  KV save is in flight (deferred finalize), and the draft's prompt KV travels with the target's;
- `draft on prefill, eager`: the same, but the prefill worker waits for the target's KV save
  before the draft pass (`--kv-save-before-draft`, eager finalize);
- `recompute on decode`: the prefill worker runs no draft, and the decode worker computes the
  draft's prompt KV after its pull, between the first token and the second.

It reports TTFT (at concurrency 1 the prefill worker answers when its step, draft pass and save
included, is done: the two draft-on-prefill modes' TTFTs differ by their steps' times), time to
second token and TPOT side by side, and each decode worker's draft prompt-token counters, which
show the modes did what they say. `bench spec`'s first part times the step itself in-process.
"""

from __future__ import annotations

import asyncio
import pathlib
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from kvservice.client.bench.backend import GrpcBackend
from kvservice.client.bench.runner import result_json, run_benchmark
from kvservice.client.bench.workload import random_requests
from kvservice.client.cluster import ChildProcess, LocalCluster
from kvservice.v1 import kvservice_pb2 as pb
from kvservice.v1 import kvservice_pb2_grpc as pb_grpc

DRAFT_ON_PREFILL, EAGER, RECOMPUTE_ON_DECODE = "draft on prefill", "draft on prefill, eager", "recompute on decode"
MODES = (RECOMPUTE_ON_DECODE, EAGER, DRAFT_ON_PREFILL)
ROWS = (
    ("mean TTFT (ms)", "mean_ttft_ms"),
    ("mean time to 2nd token (ms)", "mean_ttst_ms"),
    ("mean TPOT (ms)", "mean_tpot_ms"),
    ("p99 TPOT (ms)", "p99_tpot_ms"),
)
DRAFT_FLAGS = ("--draft-model", "--num-speculative-tokens")


@dataclass
class _DraftlessPrefillCluster(LocalCluster):
    """A LocalCluster whose prefill workers run without the draft the decode workers have."""

    async def _spawn(self, name: str, cmd: list[str], cores: Sequence[int] | None, stdin: bool = False) -> ChildProcess:
        if name.startswith("prefill"):
            cmd = _without_flags(cmd, DRAFT_FLAGS)
        return await super()._spawn(name, cmd, cores, stdin)


def _without_flags(cmd: list[str], flags: Sequence[str]) -> list[str]:
    """`cmd` without each of `flags` and the value after it."""
    out: list[str] = []
    skip = False
    for arg in cmd:
        if skip:
            skip = False
        elif arg in flags:
            skip = True
        else:
            out.append(arg)
    return out


async def served_draft_kv(
    target: pathlib.Path, draft: pathlib.Path, args: Any, vocab_size: int
) -> dict[str, dict[str, Any]]:
    """Each mode's bench-serve result, with its decode worker's `spec_decode` stats."""
    worker_args = ["--draft-model", str(draft), "--num-speculative-tokens", str(args.num_speculative_tokens)]
    worker_args += ["--max-model-len", str(args.prompt_len + args.max_tokens + 64)]
    requests = random_requests(args.num_requests, args.prompt_len, args.max_tokens, 0.0, vocab_size, 0)
    deployments = {
        DRAFT_ON_PREFILL: LocalCluster(str(target), 1, 1, worker_args=worker_args),
        EAGER: LocalCluster(str(target), 1, 1, worker_args=[*worker_args, "--kv-save-before-draft"]),
        RECOMPUTE_ON_DECODE: _DraftlessPrefillCluster(str(target), 1, 1, worker_args=worker_args),
    }
    results: dict[str, dict[str, Any]] = {}
    for name, cluster in deployments.items():
        print(f"{name}: starting", file=sys.stderr, flush=True)
        async with cluster:
            async with GrpcBackend(cluster.address) as backend:
                metrics, records, extra = await run_benchmark(backend, requests, max_concurrency=1, num_warmups=2)
            results[name] = result_json(metrics, records, extra)
            results[name]["decode_spec_decode"] = await _spec_stats(cluster.decode_addresses[0])
        print(f"{name}: {metrics.completed} completed, {metrics.failed} failed", file=sys.stderr, flush=True)
    return results


async def _spec_stats(address: str) -> dict[str, float]:
    async with grpc.aio.insecure_channel(address) as channel:
        stats = await pb_grpc.WorkerStub(channel).Stats(pb.StatsRequest(), timeout=10)
    spec = stats.spec_decode
    return {
        "num_draft_prompt_tokens_computed": spec.num_draft_prompt_tokens_computed,
        "num_draft_prompt_tokens_received": spec.num_draft_prompt_tokens_received,
        "num_draft_prompt_tokens_recomputed": spec.num_draft_prompt_tokens_recomputed,
        "acceptance_rate": spec.acceptance_rate,
    }


def report(results: dict[str, dict[str, Any]]) -> None:
    recompute, eager, deferred = (results[mode] for mode in MODES)
    header = f"{'recompute':>10} {'eager':>8} {'deferred':>9}   vs eager  vs recompute"
    print(f"served 1P1D, concurrency 1: {'':<10} {header}")
    for label, key in ROWS:
        a, b, c = (float(result[key]) for result in (recompute, eager, deferred))
        print(f"  {label:<36} {a:10.1f} {b:8.1f} {c:9.1f}   {_ratio(c, b):>8}  {_ratio(c, a):>12}")
    for name in MODES:
        spec = results[name]["decode_spec_decode"]
        print(
            f"  {name}: decode worker's draft prompt tokens computed {spec['num_draft_prompt_tokens_computed']}, "
            f"received {spec['num_draft_prompt_tokens_received']}, "
            f"recomputed {spec['num_draft_prompt_tokens_recomputed']}; acceptance {spec['acceptance_rate']:.2f}"
        )


def _ratio(value: float, base: float) -> str:
    return f"{value / base:.2f}x" if base else "nan"


def run(target: pathlib.Path, draft: pathlib.Path, args: Any, vocab_size: int) -> dict[str, dict[str, Any]]:
    results = asyncio.run(served_draft_kv(target, draft, args, vocab_size))
    report(results)
    return results
