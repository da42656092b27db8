"""`kvservice generate`, `kvservice stats` and `kvservice health`: the client API from a terminal."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys

import grpc
from google.protobuf.json_format import MessageToDict

from kvservice.client.client import KVServiceClient, PromptInput
from kvservice.runtime.tls import TLSFiles, add_tls_arguments
from kvservice.v1 import kvservice_pb2 as pb


def _token_ids(value: str) -> list[int]:
    try:
        return [int(t) for t in value.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {value!r}") from None


def _client(args: argparse.Namespace) -> KVServiceClient:
    """A client with the TLS files and bearer token of the command line."""
    return KVServiceClient(args.target, TLSFiles.from_args(args).channel_credentials(), args.auth_token)


def add_generate_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", required=True, metavar="HOST:PORT", help="the proxy or a colocated worker")
    parser.add_argument("prompt", nargs="?", help="prompt text (or use --prompt-token-ids or --chat)")
    parser.add_argument("--prompt-token-ids", type=_token_ids, metavar="1,2,3", help="prompt as token ids")
    parser.add_argument(
        "--chat",
        metavar="MESSAGE",
        help="one chat turn: MESSAGE as the user's message, rendered with the model's chat template",
    )
    parser.add_argument("--system", metavar="TEXT", help="with --chat: a system message before it")
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens to generate (default: 16)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default: 0)")
    parser.add_argument("--top-p", type=float, default=None, help="nucleus sampling mass (default: off)")
    parser.add_argument("--top-k", type=int, default=None, help="sample among the k likeliest (default: off)")
    parser.add_argument("--seed", type=int, default=None, help="seed for reproducible sampling")
    parser.add_argument("--ignore-eos", action="store_true", help="keep going past end-of-sequence")
    parser.add_argument(
        "--stop",
        action="append",
        default=[],
        metavar="TEXT",
        help="stop when the text contains TEXT, which is not printed (repeat for several)",
    )
    parser.add_argument("--request-id", default="", help="request id (default: the server assigns one)")
    parser.add_argument("--timeout", type=float, default=None, help="deadline in seconds")
    parser.add_argument(
        "--json", action="store_true", help="last line: one JSON object with token_ids, text, finish_reason"
    )
    add_tls_arguments(parser)


def generate_main(args: argparse.Namespace) -> int:
    if sum(p is not None for p in (args.prompt, args.prompt_token_ids, args.chat)) != 1:
        print("kvservice generate: error: give exactly one of PROMPT, --prompt-token-ids or --chat", file=sys.stderr)
        return 2
    if args.system is not None and args.chat is None:
        print("kvservice generate: error: --system goes with --chat", file=sys.stderr)
        return 2
    return asyncio.run(_generate(args))


async def _generate(args: argparse.Namespace) -> int:
    prompt: PromptInput
    if args.chat is not None:
        system = [{"role": "system", "content": args.system}] if args.system else []
        prompt = [*system, {"role": "user", "content": args.chat}]
    else:
        prompt = args.prompt if args.prompt is not None else args.prompt_token_ids
    token_ids: list[int] = []
    text = ""
    finish_reason = None
    request_id = ""
    async with _client(args) as client:
        try:
            async for chunk in client.generate(
                prompt,
                timeout=args.timeout,
                max_tokens=args.max_tokens,
                temperature=args.temperature,
                top_p=args.top_p,
                top_k=args.top_k,
                seed=args.seed,
                ignore_eos=args.ignore_eos,
                stop=args.stop,
                request_id=args.request_id,
            ):
                token_ids.extend(chunk.token_ids)
                text += chunk.text
                finish_reason = chunk.finish_reason or finish_reason
                request_id = chunk.request_id
                if not args.json:
                    sys.stdout.write(chunk.text)
                    sys.stdout.flush()
        except grpc.aio.AioRpcError as e:
            print(f"\nkvservice generate: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
    if args.json:
        print(
            json.dumps({"request_id": request_id, "token_ids": token_ids, "text": text, "finish_reason": finish_reason})
        )
    else:
        print(f"\n[{len(token_ids)} tokens, finish_reason={finish_reason}]")
    return 0


def add_stats_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", required=True, metavar="HOST:PORT", help="a proxy or a worker")
    parser.add_argument("--json", action="store_true", help="print the stats as one JSON object")
    add_tls_arguments(parser)


def stats_main(args: argparse.Namespace) -> int:
    return asyncio.run(_stats(args))


async def _stats(args: argparse.Namespace) -> int:
    async with _client(args) as client:
        try:
            stats = await client.stats()
        except grpc.aio.AioRpcError as e:
            print(f"kvservice stats: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
    data = MessageToDict(stats, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)
    if args.json:
        print(json.dumps(data))
        return 0
    print(f"role: {data['role']}")
    if data["compute_path"]:
        print(f"  {'compute_path':<28} {data['compute_path']}")
    for key in (
        "num_blocks_total",
        "num_blocks_free",
        "num_running_requests",
        "num_waiting_requests",
        "num_waiting_for_remote_kv",
        "num_finished_requests",
        "num_aborted_requests",
    ):
        print(f"  {key:<28} {data[key]}")
    for direction in ("kv_sending", "kv_receiving"):
        print(f"  {direction}: " + ", ".join(f"{k}={v}" for k, v in data.get(direction, {}).items()))
    print(f"  prefix_cache: {_hit_rate(stats.prefix_cache)}")
    for worker, entry in zip(data.get("workers", []), stats.workers):
        s = worker.get("stats", {})
        role = s.get("role") or worker.get("role") or "?"
        print(
            f"  worker {worker['address']} ({role}, {worker.get('state') or '?'}, "
            f"healthy={worker['is_healthy']}, outstanding={worker['num_outstanding']}): "
            f"{entry.stats.compute_path or 'compute path unknown'}, "
            f"blocks free {s.get('num_blocks_free', 0)}/{s.get('num_blocks_total', 0)}, "
            f"prefix cache {_hit_rate(entry.stats.prefix_cache)}, "
            f"indexed by the proxy {entry.num_indexed_blocks} blocks{_offloaded(entry)}"
        )
    return 0


def _offloaded(entry: pb.WorkerStats) -> str:
    num_blocks = entry.num_indexed_offload_blocks
    return f" (+{num_blocks} in its offload tier)" if num_blocks else ""


def _hit_rate(prefix_cache: pb.PrefixCacheStats) -> str:
    rate = f"{prefix_cache.hits / prefix_cache.queries:.1%}" if prefix_cache.queries else "n/a"
    return f"hits {prefix_cache.hits}/{prefix_cache.queries} tokens ({rate})"


def add_health_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", required=True, metavar="HOST:PORT", help="any kvservice server")
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for an answer (default: 5)")
    add_tls_arguments(parser)


def health_main(args: argparse.Namespace) -> int:
    async def check() -> str:
        async with _client(args) as client:
            return await client.health(timeout=args.timeout)

    try:
        status = asyncio.run(check())
    except grpc.aio.AioRpcError as e:
        print(f"kvservice health: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1
    print(status)
    return 0 if status == "SERVING" else 1
