"""`kvservice bench proxy-cpu`: the proxy's CPU time per relayed output token, over gRPC and HTTP.

A proxy in front of a fleet relays every token a decode worker produces; its CPU per token
decides how many workers one proxy core can front. This starts a 1P1D deployment with the
OpenAI front on the proxy, sends the same streamed greedy workload once through the gRPC API
and once through `/v1/completions`, and reads the proxy process's own CPU seconds (user +
system, from /proc/PID/stat) before and after each, divided by the output tokens relayed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from dataclasses import dataclass

from kvservice.client.bench.backend import Backend, GrpcBackend, OpenAIBackend
from kvservice.client.bench.grpc_message_floor import grpc_us_per_message
from kvservice.client.bench.runner import run_benchmark
from kvservice.client.bench.tcp_baseline import process_cpu_seconds
from kvservice.client.bench.workload import random_requests
from kvservice.client.cluster import LocalCluster

# The target a later round of work aims at (per relayed token, either front).
TARGET_US_PER_TOKEN = 15.0
_READY_TIMEOUT_S = 60.0


@dataclass(frozen=True, slots=True)
class ProxyCost:
    """One front's run: the tokens relayed and the proxy's CPU seconds spent meanwhile."""

    front: str
    num_tokens: int
    cpu_s: float
    wall_s: float

    @property
    def us_per_token(self) -> float:
        return 1e6 * self.cpu_s / self.num_tokens if self.num_tokens else float("nan")

    @property
    def tokens_per_s(self) -> float:
        return self.num_tokens / self.wall_s if self.wall_s else 0.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="tiny", help="the workers' model (default: tiny)")
    parser.add_argument("--num-prompts", type=int, default=128, help="requests per front (default: 128)")
    parser.add_argument("--input-len", type=int, default=64, help="prompt tokens (default: 64)")
    parser.add_argument("--output-len", type=int, default=256, help="tokens generated per request (default: 256)")
    parser.add_argument("--concurrency", type=int, default=64, help="requests in flight (default: 64)")
    parser.add_argument("--vocab-size", type=int, default=256, help="prompt ids are drawn from [0, N) (default: 256)")
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")


def main(args: argparse.Namespace) -> int:
    costs = asyncio.run(_measure(args))
    floor = grpc_us_per_message(args.concurrency)
    print(f"proxy CPU per relayed token, 1P1D on {args.model}, concurrency {args.concurrency}:")
    for cost in costs:
        verdict = "PASS" if cost.us_per_token <= TARGET_US_PER_TOKEN else "FAIL"
        print(
            f"  {cost.front:<5} {cost.num_tokens:7d} tokens  {cost.cpu_s:6.2f} CPU-s  "
            f"{cost.us_per_token:6.1f} us/token (target <= {TARGET_US_PER_TOKEN:g}: {verdict})  "
            f"{cost.tokens_per_s:7.1f} tok/s"
        )
    print(
        f"  floor: a bare grpc.aio server spends {floor:.1f} us per streamed message on this machine "
        "(a token per message cannot cost less)"
    )
    if args.json:
        result: dict[str, object] = {c.front: {"us_per_token": c.us_per_token, "tokens": c.num_tokens} for c in costs}
        result["grpc_floor_us_per_message"] = floor
        print(json.dumps(result))
    return 0


async def _measure(args: argparse.Namespace) -> list[ProxyCost]:
    requests = random_requests(args.num_prompts, args.input_len, args.output_len, 0.0, args.vocab_size, 0)
    cluster = LocalCluster(args.model, 1, 1, proxy_args=["--http-port", "0"])
    async with cluster:
        proxy = cluster.child("proxy")
        fronts: list[tuple[str, Backend]] = [
            ("grpc", GrpcBackend(cluster.address)),
            ("http", OpenAIBackend("openai", f"http://{proxy.http_address}", max_connections=args.concurrency)),
        ]
        costs = []
        for front, backend in fronts:
            async with backend:
                await backend.wait_until_ready(_READY_TIMEOUT_S)
                if isinstance(backend, OpenAIBackend):
                    backend.model = (await backend.served_models())[0]
                before = process_cpu_seconds(proxy.process.pid)
                metrics, _, _ = await run_benchmark(backend, requests, max_concurrency=args.concurrency)
                cpu_s = process_cpu_seconds(proxy.process.pid) - before
            if metrics.failed:
                print(f"kvservice bench proxy-cpu: {metrics.failed} {front} requests failed", file=sys.stderr)
            costs.append(ProxyCost(front, metrics.total_output_tokens, cpu_s, metrics.duration_s))
    return costs
