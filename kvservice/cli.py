"""The `kvservice` command line: one entry point, one subcommand per job.

This is the composition root: it imports the servers, the client and the
benchmarks lazily, per subcommand, so `kvservice --help` stays fast and the
library itself never depends on the processes built on it.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Command:
    """A subcommand: the module that defines it and the names of its two functions there."""

    module: str
    help: str
    add_arguments: str = "add_arguments"
    main: str = "main"


COMMANDS: dict[str, Command] = {
    "serve": Command("kvservice.server.worker_server", "run one worker: --role prefill | decode | both (colocated)"),
    "proxy": Command(
        "kvservice.server.proxy.server", "run the router that clients talk to, in front of prefill and decode workers"
    ),
    "launch": Command(
        "kvservice.client.launch", "start N prefill + M decode workers and a proxy locally; Ctrl-C stops all"
    ),
    "generate": Command(
        "kvservice.client.commands",
        "send one request and stream its tokens to the terminal",
        "add_generate_arguments",
        "generate_main",
    ),
    "chat": Command(
        "kvservice.client.chat", "an interactive chat in the terminal (history kept, answers streamed; Ctrl-D quits)"
    ),
    "stats": Command(
        "kvservice.client.commands",
        "show a server's KV blocks, requests and KV transfer counters",
        "add_stats_arguments",
        "stats_main",
    ),
    "health": Command(
        "kvservice.client.commands",
        "check a server's gRPC health (exit 0 when SERVING)",
        "add_health_arguments",
        "health_main",
    ),
    "demo": Command(
        "kvservice.client.demo",
        "the main job: launch a prefill/decode pair on SmolLM2, ask it chat questions, report latency, stop",
    ),
}
BENCHMARKS: dict[str, Command] = {
    "serve": Command(
        "kvservice.client.bench.serve",
        "load a server with a vLLM-style workload: TTFT/TTST/TPOT/ITL/E2EL, throughput, KV transfer",
    ),
    "compare": Command(
        "kvservice.client.bench.compare",
        "disaggregated (1 prefill core + 1 decode core) vs colocated (2 cores): same workload, side by side",
    ),
    "prefix": Command(
        "kvservice.client.bench.prefix",
        "prefix caching off vs on, by routing (1 prefill + 2 decode each): same workload, side by side with ratios",
    ),
    "local-prefill": Command(
        "kvservice.client.bench.local_prefill",
        "decode-worker (local) vs disaggregated prefill of uncached prompt tails: "
        "the --max-local-prefill-tokens crossover",
    ),
    "transfer": Command(
        "kvservice.client.bench.transfer", "KV transfer over gRPC PullKV vs raw TCP, tensor to tensor across processes"
    ),
    "spec": Command(
        "kvservice.client.bench.spec",
        "speculative decoding: deferred vs eager finalize of a prefill step; decode tokens/s with good and poor drafts",
    ),
    "peers": Command(
        "kvservice.client.bench.peers",
        "kvservice (colocated, 1P1D) vs llama.cpp and vLLM on SmolLM2: "
        "same workload at concurrency 1 and 16, one ratio table",
    ),
    "offload": Command(
        "kvservice.client.bench.offload",
        "multi-turn chats several times the KV cache: the KV offload tier off, on, and on after a restart",
    ),
    "proxy-cpu": Command(
        "kvservice.client.bench.proxy_cpu",
        "the proxy's CPU time per relayed output token, over gRPC and over the OpenAI HTTP front (1P1D)",
    ),
    "kv-dtype": Command(
        "kvservice.client.bench.kv_dtype",
        "--kv-cache-dtype's quality on SmolLM2 against transformers: prompt logprobs, greedy chat agreement, "
        "lm-eval loglikelihoods",
    ),
    "engine": Command(
        "kvservice.client.bench.engine",
        "prefill and decode tokens/s at batch 1 and 16, side by side with transformers' generate",
    ),
}


def _add_all(sub: argparse._SubParsersAction, commands: dict[str, Command], load: bool) -> None:
    """One subparser per command; only with `load` are their modules imported and their flags added."""
    for name, command in commands.items():
        if not load:
            sub.add_parser(name, help=command.help)
            continue
        parser = sub.add_parser(name, help=command.help, description=command.help)
        module = importlib.import_module(command.module)
        getattr(module, command.add_arguments)(parser)
        main: Callable[[argparse.Namespace], int] = getattr(module, command.main)
        parser.set_defaults(run=main)


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The full parser; with `command`, only that subcommand's module is imported."""
    parser = argparse.ArgumentParser(
        prog="kvservice",
        description="Disaggregated prefill/decode LLM serving: "
        "prefill workers stream the KV cache over gRPC to decode workers.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, spec in COMMANDS.items():
        _add_all(sub, {name: spec}, command in (None, name))
    bench_help = "benchmarks: " + ", ".join(BENCHMARKS)
    bench = sub.add_parser("bench", help=bench_help, description=bench_help)
    _add_all(
        bench.add_subparsers(dest="benchmark", required=True, metavar="BENCHMARK"),
        BENCHMARKS,
        command in (None, "bench"),
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command = next((a for a in argv if not a.startswith("-")), None)
    args = build_parser(command if command in COMMANDS or command == "bench" else None).parse_args(argv)
    return int(args.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
