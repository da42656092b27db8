"""`kvservice bench offload`: a multi-turn workload whose working set is several times the KV
cache, served with the KV offload tier off, on, and on again after a restart on the same store.

Every conversation resends its growing history, so a later turn's prompt starts with everything
its earlier turns computed. With a cache too small for all conversations, their earlier blocks
are evicted before their next turn: without the tier they are recomputed, with it they are read
back. The third run starts fresh workers on the second run's stores: their first turns find
their prefixes there (a warm restart). Reported per turn: mean and p99 TTFT; per run: output
tok/s, the tiers' hit blocks and bytes read, the blocks pulled from peers (1P2D: a prefill worker
pulls a conversation's history from the decode worker that served its last turn), and whether
every run's greedy tokens are the same.

`--deployment 1p2d` serves it with a prefill worker and two decode workers behind the proxy
(each worker its own store), and `--request-rate` spreads the conversations' starts (Poisson),
so a turn's TTFT is its own prefill more than the queue of everyone's. `--interleave` serves turn 1
of every conversation, then turn 2, ..., a few at a time: every conversation's history has left the
cache before its next turn, and the cores are not saturated.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import secrets
import statistics
import sys
import tempfile
import time
from typing import Any

from kvservice.client.bench.backend import GrpcBackend
from kvservice.client.bench.conversation import Conversation, multi_turn_conversations, next_turn_request
from kvservice.client.bench.metrics import BenchmarkMetrics, RequestRecord, compute_metrics
from kvservice.client.bench.runner import run_benchmark
from kvservice.client.client import KVServiceClient
from kvservice.client.cluster import LocalCluster

RUNS = ("tier off", "tier on", "tier on, restarted")
NO_PEER_PULLS = "tier off, no peer pulls"  # --compare-peer-pulls: the proxy's --peer-pull-min-tokens 0
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
    parser.add_argument(
        "--first-input-len",
        type=int,
        default=None,
        help="tokens of each conversation's first message, its own long system prompt (default: --input-len)",
    )
    parser.add_argument(
        "--interleave",
        action="store_true",
        help="turn 1 of every conversation, then turn 2, ... (at most --max-concurrency at once): between two "
        "turns of a conversation all the others run, so a small cache has evicted its history (default: each "
        "conversation's turns follow its answers, conversations arriving at --request-rate)",
    )
    parser.add_argument(
        "--max-concurrency", type=int, default=1, help="with --interleave: requests in flight (default: 1)"
    )
    parser.add_argument(
        "--compare-peer-pulls",
        action="store_true",
        help=f"first a run with the tier off and peer pulls off too ('{NO_PEER_PULLS}'), beside which 'tier off' "
        "shows what peer pulls save (1p2d: a prefill worker pulls a conversation's history from the decode worker "
        "that served its last turn)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")


def main(args: argparse.Namespace) -> int:
    results = asyncio.run(_run_all(args))
    _report(args, results)
    if args.json:
        print(json.dumps({name: {k: v for k, v in r.items() if k != "tokens"} for name, r in results.items()}))
    return 0 if all(r["failed"] == 0 for r in results.values()) else 1


async def _run_all(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    workload = _workload(args)
    worker_args = ["--kv-cache-mib", str(args.kv_cache_mib), "--max-model-len", str(_max_len(args))]
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="kvservice-offload-") as store:
        for name in _runs(args):
            offload = {"kv_offload_dir": store, "kv_offload_gib": args.kv_offload_gib} if "tier on" in name else {}
            print(f"{name}: starting", file=sys.stderr, flush=True)
            cluster = LocalCluster(
                args.model,
                num_decode=2,
                colocated=args.deployment == "colocated",
                worker_args=worker_args,
                proxy_args=["--peer-pull-min-tokens", "0"] if name == NO_PEER_PULLS else [],
                **offload,  # type: ignore[arg-type]
            )
            async with cluster:
                async with GrpcBackend(cluster.address) as backend:
                    if args.interleave:
                        metrics, records = await run_interleaved(backend, workload, args.max_concurrency)
                    else:
                        metrics, records, _ = await run_benchmark(
                            backend, workload, args.request_rate, max_concurrency=args.num_conversations
                        )
                async with KVServiceClient(cluster.address) as client:
                    stats = await client.stats()
            results[name] = _summary(records, metrics.output_throughput, metrics.failed, stats)
            print(f"{name}: {metrics.completed} completed, {metrics.failed} failed", file=sys.stderr, flush=True)
    return results


def _workload(args: argparse.Namespace) -> list[Conversation]:
    """The conversations: each first message `--first-input-len` tokens, every later one `--input-len`."""
    workload = multi_turn_conversations(args.num_conversations, args.turns, args.input_len, args.output_len, 256, 0)
    if args.first_input_len is None:
        return workload
    firsts = multi_turn_conversations(args.num_conversations, 1, args.first_input_len, args.output_len, 256, 1)
    return [Conversation((first.turns[0], *c.turns[1:])) for first, c in zip(firsts, workload)]


async def run_interleaved(
    backend: GrpcBackend, conversations: list[Conversation], max_concurrency: int
) -> tuple[BenchmarkMetrics, list[RequestRecord]]:
    """Turn t of every conversation, at most `max_concurrency` at once, then turn t + 1."""
    requests = [c.turns[0] for c in conversations]
    records: list[list[RequestRecord]] = [[] for _ in conversations]
    limit = asyncio.Semaphore(max_concurrency)
    tag = secrets.token_hex(4)

    async def send(index: int, turn: int) -> None:
        history = records[index]
        if history and not history[-1].success:
            now = time.perf_counter()
            history.append(RequestRecord(f"{index}-{turn}", 0, now, end=now, error="an earlier turn failed", turn=turn))
            return
        if turn:
            requests[index] = next_turn_request(
                requests[index], history[-1].output_token_ids, conversations[index].turns[turn]
            )
        async with limit:
            record = await backend.send(requests[index], f"offload-{tag}-{index}-turn{turn}", None)
        record.turn = turn
        history.append(record)

    start = time.perf_counter()
    for turn in range(max(len(c.turns) for c in conversations)):
        await asyncio.gather(*(send(i, turn) for i, c in enumerate(conversations) if turn < len(c.turns)))
    flat = [record for history in records for record in history]
    return compute_metrics(flat, time.perf_counter() - start), flat


def _runs(args: argparse.Namespace) -> tuple[str, ...]:
    return (NO_PEER_PULLS, *RUNS) if args.compare_peer_pulls else RUNS


def _max_len(args: argparse.Namespace) -> int:
    first = args.first_input_len if args.first_input_len is not None else args.input_len
    return first + (args.turns - 1) * args.input_len + args.turns * args.output_len + 64


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
        "peer_blocks_from_decode": offload.num_peer_blocks_from_decode,
        "peer_blocks_from_prefill": offload.num_peer_blocks_from_prefill,
        "peer_pulls_failed": offload.num_peer_pulls_failed,
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
        total.num_peer_blocks_from_decode += one.num_peer_blocks_from_decode
        total.num_peer_blocks_from_prefill += one.num_peer_blocks_from_prefill
        total.num_peer_pulls_failed += one.num_peer_pulls_failed
    return total


def _p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


def _ms(by_turn: dict[int, float], turn: int) -> float:
    return by_turn.get(turn, float("nan"))


def _arrivals(args: argparse.Namespace) -> str:
    if args.interleave:
        return f"turns interleaved, {args.max_concurrency} at a time"
    return "all at once" if math.isinf(args.request_rate) else f"{args.request_rate:g} conversations/s"


def _report(args: argparse.Namespace, results: dict[str, dict[str, Any]]) -> None:
    print(
        f"KV offload tier, {args.num_conversations} conversations x {args.turns} turns on {args.model}, "
        f"{args.deployment}, KV cache {args.kv_cache_mib} MiB a worker, "
        f"{_arrivals(args)}:"
    )
    runs = _runs(args)
    print(f"  {'turn':<6}" + "".join(f"{name + ' TTFT mean / p99 (ms)':>40}" for name in runs))
    for turn in range(args.turns):
        cells = [
            f"{_ms(results[n]['mean_ttft_ms'], turn):16.0f} / {_ms(results[n]['p99_ttft_ms'], turn):6.0f}" for n in runs
        ]
        print(f"  {turn:<6}" + "".join(f"{c:>40}" for c in cells))
    for name in runs:
        r = results[name]
        print(
            f"  {name}: {r['output_tok_per_s']:.1f} output tok/s, "
            f"prefix-cache hit rate {r['prefix_cache_hit_rate']:.2f}, "
            f"tier hit blocks {r['tier_hit_blocks']}, blocks written {r['tier_blocks_written']}, "
            f"bytes read {r['tier_bytes_read']}, blocks pulled from peers "
            f"{r['peer_blocks_from_decode']} (decode) + {r['peer_blocks_from_prefill']} (prefill), "
            f"{r['peer_pulls_failed']} failed"
        )
    same = len({json.dumps(r["tokens"]) for r in results.values()}) == 1
    print(f"  greedy tokens identical in every run: {'yes' if same else 'NO'}")
    off, on, warm = (results[n]["mean_ttft_ms"] for n in RUNS)
    later = [t for t in range(1, args.turns) if _ms(on, t)]
    if later and _ms(off, 0) and _ms(warm, 0):
        speedups = ", ".join(f"{_ms(off, t) / _ms(on, t):.2f}x" for t in later)
        print(f"  later turns, tier on vs off (mean TTFT): {speedups} (goal: >= 3x)")
        print(f"  first turns, restarted vs cold: {_ms(on, 0) / _ms(warm, 0):.2f}x (goal: >= 3x)")
    if NO_PEER_PULLS in results:
        without = results[NO_PEER_PULLS]["mean_ttft_ms"]
        speedups = ", ".join(f"{_ms(without, t) / _ms(off, t):.2f}x" for t in range(1, args.turns))
        print(f"  later turns, peer pulls on vs off (tier off, mean TTFT): {speedups}")
