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

# subcommand -> (module, add_arguments, main, help)
COMMANDS: dict[str, tuple[str, str, str, str]] = {
    "serve": ("kvservice.server.worker_server", "add_arguments", "main",
              "run one worker: --role prefill | decode | both (colocated)"),
    "proxy": ("kvservice.server.proxy_server", "add_arguments", "main",
              "run the router that clients talk to, in front of prefill and decode workers"),
    "launch": ("kvservice.client.launch", "add_arguments", "main",
               "start N prefill + M decode workers and a proxy locally; Ctrl-C stops all"),
    "generate": ("kvservice.client.commands", "add_generate_arguments", "generate_main",
                 "send one request and stream its tokens to the terminal"),
    "chat": ("kvservice.client.chat", "add_arguments", "main",
             "an interactive chat in the terminal (history kept, answers streamed; Ctrl-D quits)"),
    "stats": ("kvservice.client.commands", "add_stats_arguments", "stats_main",
              "show a server's KV blocks, requests and KV transfer counters"),
    "health": ("kvservice.client.commands", "add_health_arguments", "health_main",
               "check a server's gRPC health (exit 0 when SERVING)"),
    "demo": ("kvservice.client.demo", "add_arguments", "main",
             "the main job: launch a prefill/decode pair on the tiny model, benchmark it, stop"),
}
BENCHMARKS: dict[str, tuple[str, str, str, str]] = {
    "serve": ("kvservice.client.bench.serve", "add_arguments", "main",
              "load a server with a vLLM-style workload: TTFT/TTST/TPOT/ITL/E2EL, throughput, KV transfer"),
    "compare": ("kvservice.client.bench.compare", "add_arguments", "main",
                "disaggregated (1 prefill core + 1 decode core) vs colocated (2 cores): same workload, side by side"),
    "prefix": ("kvservice.client.bench.prefix", "add_arguments", "main",
               "prefix caching off vs on, by routing (1 prefill + 2 decode each): same workload, side by side with ratios"),
    "local-prefill": ("kvservice.client.bench.local_prefill", "add_arguments", "main",
                      "decode-worker (local) vs disaggregated prefill of uncached prompt tails: the --max-local-prefill-tokens crossover"),
    "transfer": ("kvservice.client.bench.transfer", "add_arguments", "main",
                 "KV transfer over gRPC PullKV vs raw TCP, tensor to tensor across processes"),
    "spec": ("kvservice.client.bench.spec", "add_arguments", "main",
             "speculative decoding: deferred vs eager finalize of a prefill step; decode tokens/s with good and poor drafts"),
    "engine": ("kvservice.client.bench.engine", "add_arguments", "main",
               "prefill and decode tokens/s at batch 1 and 16, side by side with transformers' generate"),
}


def _add(sub: argparse._SubParsersAction, name: str, spec: tuple[str, str, str, str]) -> None:
    module_name, add_name, main_name, help_text = spec
    parser = sub.add_parser(name, help=help_text, description=help_text)
    module = importlib.import_module(module_name)
    getattr(module, add_name)(parser)
    main: Callable[[argparse.Namespace], int] = getattr(module, main_name)
    parser.set_defaults(run=main)


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The full parser; with `command`, only that subcommand's module is imported."""
    parser = argparse.ArgumentParser(
        prog="kvservice",
        description="Disaggregated prefill/decode LLM serving: prefill workers stream the KV cache over gRPC to decode workers.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, spec in COMMANDS.items():
        if command in (None, name):
            _add(sub, name, spec)
        else:
            sub.add_parser(name, help=spec[3])
    bench_help = "benchmarks: " + ", ".join(BENCHMARKS)
    bench = sub.add_parser("bench", help=bench_help, description=bench_help)
    bench_sub = bench.add_subparsers(dest="benchmark", required=True, metavar="BENCHMARK")
    for name, spec in BENCHMARKS.items():
        _add(bench_sub, name, spec) if command in (None, "bench") else bench_sub.add_parser(name, help=spec[3])
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command = next((a for a in argv if not a.startswith("-")), None)
    args = build_parser(command if command in COMMANDS or command == "bench" else None).parse_args(argv)
    return int(args.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
