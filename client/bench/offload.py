"""`kvservice bench offload`: a multi-turn workload whose working set is several times the KV
cache, served with the KV offload tier off, on, and on again after a restart on the same store.

Every conversation resends its growing history, so a later turn's prompt starts with everything
its earlier turns computed. With a cache too small for all conversations, their earlier blocks
are evicted before their next turn: without the tier they are recomputed, with it they are read
back. The third run starts fresh workers on the second run's stores: their first turns find
their prefixes there (a warm restart). Reported per turn: mean and p99 TTFT; per run: output
tok/s, the tiers' hit blocks and bytes read, and whether every run's greedy tokens are the same.

`--deployment 1p2d` serves it with a prefill worker and two decode workers behind the proxy
(each worker its own store), and `--request-rate` spreads the conversations' starts (Poisson),
so a turn's TTFT is its own prefill more than the queue of everyone's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import statistics
import sys
import tempfile
from typing import Any

from kvservice.client.bench.backend import GrpcBackend
from kvservice.client.bench.conversation import multi_turn_conversations
from kvservice.client.bench.metrics import RequestRecord
from kvservice.client.bench.runner import run_benchmark
from kvservice.client.client import KVServiceClient
from kvservice.client.cluster import LocalCluster

RUNS = ("tier off", "tier on", "tier on, restarted")
DEPLOYMENTS = ("colocated", "1p2d")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2", help="the worker's model (default: smollm2)")
    parser.add_argument("--num-conversations", type=int, default=12, help="conversations, all at once (default: 12)")
    parser.add_argument("--turns", type=int, default=4, help="turns per conversation (default: 4)")
    parser.add_argument("--input-len", type=int, default=256, help="tokens of each user message (default: 256)")
    parser.add_argument("--output-len", type=int, default=32, help="tokens of each answer (default: 32)")
    parser.add_argument(
        "--kv-cache-mib", type=int, default=96, help="the worker's KV cache: a few conversations' worth (default: 96)"
    )
    parser.add_argument("--kv-offload-gib", type=float, default=2.0, help="each store's bound (default: 2)")
    parser.add_argument(
        "--deployment",
        choices=DEPLOYMENTS,
        default="colocated",
        help="one colocated worker, or a prefill and two decode workers behind the proxy (default: colocated)",
    )
    parser.add_argument(
        "--request-rate",
        type=float,
        default=math.inf,
        help="conversations started per second, Poisson; later turns follow their answers (default: all at once)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")


def main(args: argparse.Namespace) -> int:
    results = asyncio.run(_run_all(args))
    _report(args, results)
    if args.json:
        print(json.dumps({name: {k: v for k, v in r.items() if k != "tokens"} for name, r in results.items()}))
    return 0 if all(r["failed"] == 0 for r in results.values()) else 1


async def _run_all(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    workload = multi_turn_conversations(args.num_conversations, args.turns, args.input_len, args.output_len, 256, 0)
    worker_args = ["--kv-cache-mib", str(args.kv_cache_mib), "--max-model-len", str(_max_len(args))]
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="kvservice-offload-") as store:
        for name in RUNS:
            offload = {} if name == "tier off" else {"kv_offload_dir": store, "kv_offload_gib": args.kv_offload_gib}
            print(f"{name}: starting", file=sys.stderr, flush=True)
            cluster = LocalCluster(
                args.model,
                num_decode=2,
                colocated=args.deployment == "colocated",
                worker_args=worker_args,
                **offload,  # type: ignore[arg-type]
            )
            async with cluster:
                async with GrpcBackend(cluster.address) as backend:
                    metrics, records, _ = await run_benchmark(
                        backend, workload, args.request_rate, max_concurrency=args.num_conversations
                    )
                async with KVServiceClient(cluster.address) as client:
                    stats = await client.stats()
            results[name] = _summary(records, metrics.output_throughput, metrics.failed, stats)
            print(f"{name}: {metrics.completed} completed, {metrics.failed} failed", file=sys.stderr, flush=True)
    return results


def _max_len(args: argparse.Namespace) -> int:
    return args.turns * (args.input_len + args.output_len) + 64


def _summary(records: list[RequestRecord], tok_per_s: float, failed: int, stats: Any) -> dict[str, Any]:
    by_turn: dict[int, list[float]] = {}
    for r in records:
        if r.ttft is not None:
            by_turn.setdefault(r.turn, []).append(1000 * r.ttft)
    offload = _offload_totals(stats)
    return {
        "mean_ttft_ms": {t: statistics.mean(v) for t, v in sorted(by_turn.items())},
        "p99_ttft_ms": {t: _p99(v) for t, v in sorted(by_turn.items())},
        "output_tok_per_s": tok_per_s,
        "failed": failed,
        "tier_hit_blocks": offload.num_hit_blocks,
        "tier_blocks_written": offload.num_blocks_written,
        "tier_bytes_read": offload.num_bytes_read,
        "prefix_cache_hit_rate": stats.prefix_cache.hits / stats.prefix_cache.queries
        if stats.prefix_cache.queries
        else 0.0,
        "tokens": sorted(tuple(r.output_token_ids) for r in records),  # ids differ per run: compare the answers
    }


def _offload_totals(stats: Any) -> Any:
    """The tiers' counters: a colocated worker's own, or summed over the proxy's workers."""
    if not stats.workers:
        return stats.kv_offload
    total = type(stats.kv_offload)()
    for worker in stats.workers:
        one = worker.stats.kv_offload
        total.num_hit_blocks += one.num_hit_blocks
        total.num_blocks_written += one.num_blocks_written
        total.num_bytes_read += one.num_bytes_read
    return total


def _p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


def _ms(by_turn: dict[int, float], turn: int) -> float:
    return by_turn.get(turn, float("nan"))


def _report(args: argparse.Namespace, results: dict[str, dict[str, Any]]) -> None:
    print(
        f"KV offload tier, {args.num_conversations} conversations x {args.turns} turns on {args.model}, "
        f"{args.deployment}, KV cache {args.kv_cache_mib} MiB a worker, "
        f"{'all at once' if math.isinf(args.request_rate) else f'{args.request_rate:g} conversations/s'}:"
    )
    print(f"  {'turn':<6}" + "".join(f"{name + ' TTFT mean / p99 (ms)':>40}" for name in RUNS))
    for turn in range(args.turns):
        cells = [
            f"{_ms(results[n]['mean_ttft_ms'], turn):16.0f} / {_ms(results[n]['p99_ttft_ms'], turn):6.0f}" for n in RUNS
        ]
        print(f"  {turn:<6}" + "".join(f"{c:>40}" for c in cells))
    for name in RUNS:
        r = results[name]
        print(
            f"  {name}: {r['output_tok_per_s']:.1f} output tok/s, "
            f"prefix-cache hit rate {r['prefix_cache_hit_rate']:.2f}, "
            f"tier hit blocks {r['tier_hit_blocks']}, blocks written {r['tier_blocks_written']}, "
            f"bytes read {r['tier_bytes_read']}"
        )
    same = len({json.dumps(r["tokens"]) for r in results.values()}) == 1
    print(f"  greedy tokens identical in every run: {'yes' if same else 'NO'}")
