"""`kvservice demo`: the main job. Launches 1 prefill + 1 decode worker and a proxy on the
tiny model, sends concurrent requests through the proxy, prints their outputs and a
latency report (TTFT, time to second token, TPOT) with the KV transfer figures, and
stops everything, leaving no process behind.
"""

from __future__ import annotations

import argparse
import asyncio
import time

from kvservice.client.bench.metrics import RequestRecord, compute_metrics, format_report
from kvservice.client.bench.record import record_grpc_request
from kvservice.client.client import KVServiceClient
from kvservice.client.cluster import LocalCluster
from kvservice.event_loop import run_event_loop

DEMO_PROMPTS = [
    "Disaggregated serving splits prefill from decode.",
    "The KV cache travels over gRPC, block by block and layer by layer,",
    "Hello, world!",
    "Prefill workers run prompts; decode workers generate the remaining tokens.",
    "A proxy pairs a prefill worker with a decode worker for every request.",
    "Time to first token comes from the prefill; time to second token shows the hand-off.",
]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="tiny", help="'tiny' (built in) or a model directory (default: tiny)")
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens to generate per request (default: 32)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of concurrent requests (default: 2)")


def main(args: argparse.Namespace) -> int:
    return run_event_loop(_demo(args))


async def _demo(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    print(f"kvservice demo: launching 1 prefill + 1 decode worker and a proxy on model {args.model!r} ...", flush=True)
    async with LocalCluster(args.model, num_prefill=1, num_decode=1) as cluster:
        print(f"  ready in {time.perf_counter() - t0:.1f} s: proxy {cluster.address}, "
              f"prefill {cluster.prefill_addresses[0]}, decode {cluster.decode_addresses[0]}", flush=True)
        async with KVServiceClient(cluster.address) as client:
            records: list[RequestRecord] = []
            start = time.perf_counter()
            for round_index in range(args.rounds):
                records += await asyncio.gather(
                    *(
                        record_grpc_request(client, prompt, f"demo-{round_index}-{i}", max_tokens=args.max_tokens)
                        for i, prompt in enumerate(DEMO_PROMPTS)
                    )
                )
            duration = time.perf_counter() - start
            stats = await client.stats()
        print()
        for record in records[: len(DEMO_PROMPTS)]:
            prompt = DEMO_PROMPTS[int(record.request_id.rsplit("-", 1)[1])]
            status = f"{record.output_len} tokens" if record.success else f"FAILED: {record.error}"
            print(f"  {prompt[:48]!r:<52} -> {status}: {record.text[:40]!r}")
        metrics = compute_metrics(records, duration)
        kv = stats.kv_receiving
        extra = [
            ("KV transfers:", str(kv.num_transfers)),
            ("KV bytes moved:", f"{kv.num_bytes}"),
            ("Mean KV transfer time (ms):", f"{1000 * kv.total_seconds / max(kv.num_transfers, 1):.2f}"),
        ]
        print()
        print(format_report(metrics, extra))
        leaked = [(w.address, w.stats.num_blocks_total - w.stats.num_blocks_free) for w in stats.workers
                  if w.stats.num_blocks_free != w.stats.num_blocks_total]
    print(f"kvservice demo: stopped every process ({time.perf_counter() - t0:.1f} s in all)")
    if metrics.failed or leaked:
        print(f"kvservice demo: FAILED ({metrics.failed} failed requests; blocks still in use: {leaked})")
        return 1
    return 0
