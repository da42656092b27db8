"""`kvservice bench prefix`: what prefix caching and cache-aware routing buy, side by side.

Each configuration launches its own 1 prefill + 2 decode `LocalCluster`, one after the other,
and gets the same workload with the same seed (prefix_repetition by default, or multi_turn);
the table puts the figures side by side with each configuration's ratio to the first:

- `off`: workers with `--no-enable-prefix-caching` (the baseline);
- `on`: caching on, the proxy's default routing;
- `round-robin`, `kv-aware`: caching on, the proxy with `--routing round-robin|kv-aware`;
- `kv-aware-local`: `kv-aware` plus `--max-local-prefill-tokens N` (decode workers prefill
  short uncached tails themselves: later chat turns).

A proxy that does not know one of its flags exits before it is ready: the command stops there
with a message naming the configuration and its flags, after the table of what did run.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from kvservice.client.bench.runner import Workload, result_json
from kvservice.client.bench.serve import (
    result_path,
    run_benchmark_with_args,
    sample_workload,
    workload_settings,
    write_json,
)
from kvservice.client.bench.table import cell, ratio, render
from kvservice.client.bench.workload_args import MULTI_TURN, PREFIX_REPETITION, add_workload_arguments
from kvservice.client.cluster import LaunchError, LocalCluster

NUM_PREFILL, NUM_DECODE = 1, 2
_ARGPARSE_USAGE_EXIT = 2

# (label, result-json key, unit divisor): rows with a ratio to the baseline.
RATIO_ROWS = (
    ("Mean TTFT (ms)", "mean_ttft_ms", 1),
    ("P99 TTFT (ms)", "p99_ttft_ms", 1),
    ("Mean TTFT, first turns (ms)", "mean_ttft_first_turn_ms", 1),
    ("P99 TTFT, first turns (ms)", "p99_ttft_first_turn_ms", 1),
    ("Mean TTFT, later turns (ms)", "mean_ttft_later_turns_ms", 1),
    ("P99 TTFT, later turns (ms)", "p99_ttft_later_turns_ms", 1),
    ("Mean TPOT (ms)", "mean_tpot_ms", 1),
    ("Mean E2EL (ms)", "mean_e2el_ms", 1),
    ("Request throughput (req/s)", "request_throughput", 1),
    ("Output throughput (tok/s)", "output_throughput", 1),
    ("KV received per request (KiB)", "kv_bytes_received_per_request", 1024),
)
# Hit rates in percent, no ratio (a rate over a rate of 0 says nothing).
PERCENT_ROWS = (
    ("Prefix cache hit rate (%)", "prefix_cache_hit_rate"),
    ("Prefill prefix cache hit rate (%)", "prefill_prefix_cache_hit_rate"),
)


@dataclass(frozen=True, slots=True)
class Configuration:
    """One deployment to measure: flags for every worker and for the proxy."""

    name: str
    worker_args: tuple[str, ...]
    proxy_args: tuple[str, ...] = ()


def configurations(names: Sequence[str], max_local_prefill_tokens: int) -> list[Configuration]:
    """The named configurations, in the given order; ValueError names an unknown one."""
    on = ("--enable-prefix-caching",)
    known = {
        "off": Configuration("off", ("--no-enable-prefix-caching",)),
        "on": Configuration("on", on),
        "round-robin": Configuration("round-robin", on, ("--routing", "round-robin")),
        "kv-aware": Configuration("kv-aware", on, ("--routing", "kv-aware")),
        "kv-aware-local": Configuration(
            "kv-aware-local", on, ("--routing", "kv-aware", "--max-local-prefill-tokens", str(max_local_prefill_tokens))
        ),
    }
    unknown = [name for name in names if name not in known]
    if unknown:
        raise ValueError(f"unknown configuration {', '.join(unknown)}; expected some of {', '.join(known)}")
    if len(set(names)) != len(names):
        raise ValueError(f"a configuration is named twice in {', '.join(names)}")
    return [known[name] for name in names]


def default_configuration_names(dataset: str) -> list[str]:
    """off, round-robin, kv-aware; and kv-aware-local for conversations (later turns have short uncached tails)."""
    names = ["off", "round-robin", "kv-aware"]
    return [*names, "kv-aware-local"] if dataset == MULTI_TURN else names


def launch_error_message(configuration: Configuration, error: LaunchError) -> str:
    """Why a configuration's cluster did not start, naming the proxy flags when the proxy refused them."""
    if error.child == "proxy" and error.returncode == _ARGPARSE_USAGE_EXIT and configuration.proxy_args:
        return (
            f"configuration {configuration.name!r}: "
            f"the proxy rejected its flags `{' '.join(configuration.proxy_args)}` "
            "(exit code 2; its own message is above): this kvservice's proxy does not support them yet; "
            "choose other configurations with --configs"
        )
    return f"configuration {configuration.name!r}: {error}"


def format_prefix_table(results: dict[str, dict[str, Any]]) -> str:
    """Configurations side by side (the first is the baseline), then each one's ratio to it.

    Rows a run lacks (turn splits outside multi_turn) are left out; hit rates show in percent,
    n/a where nothing was looked up."""
    names = list(results)
    base = names[0]
    header = ("Metric", *names, *(f"{name}/{base}" for name in names[1:]))
    no_ratios = [""] * (len(names) - 1)
    rows = [
        ("Successful / failed requests", *(f"{r['completed']} / {r['failed']}" for r in results.values()), *no_ratios)
    ]
    for label, key, divisor in RATIO_ROWS:
        if any(key in r for r in results.values()):
            numbers = [float(results[name].get(key) or 0.0) / divisor for name in names]
            rows.append((label, *(cell(n) for n in numbers), *(ratio(n, numbers[0]) for n in numbers[1:])))
    for label, key in PERCENT_ROWS:
        rates = [results[name].get(key) for name in names]
        rows.append((label, *("n/a" if rate is None else f"{rate * 100:.1f}" for rate in rates), *no_ratios))
    return render(header, rows)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        default="tiny",
        help="'tiny', 'smollm2', a Hugging Face model directory or a GGUF file (default: tiny)",
    )
    add_workload_arguments(
        parser,
        input_len=1024,
        output_len=64,
        num_prompts=20,
        request_rate=4.0,
        num_warmups=2,
        tokenizer_default="--model's",
    )
    parser.set_defaults(dataset=PREFIX_REPETITION)
    parser.add_argument(
        "--configs",
        default=None,
        metavar="NAME,...",
        help="configurations in order, the first the baseline: off, on, round-robin, kv-aware, kv-aware-local "
        "(default: off,round-robin,kv-aware; multi_turn adds kv-aware-local)",
    )
    parser.add_argument(
        "--max-local-prefill-tokens",
        type=int,
        default=None,
        metavar="N",
        help="kv-aware-local: the proxy's --max-local-prefill-tokens "
        "(default: --multi-turn-input-len + --multi-turn-output-len, what a later turn adds to its history)",
    )
    parser.add_argument(
        "worker_args", nargs=argparse.REMAINDER, help="after '--': extra `kvservice serve` flags for every worker"
    )


def main(args: argparse.Namespace) -> int:
    names = args.configs.split(",") if args.configs else default_configuration_names(args.dataset)
    local_tokens = args.max_local_prefill_tokens
    if local_tokens is None:
        local_tokens = args.multi_turn_input_len + args.multi_turn_output_len
    try:
        deployments = configurations(names, local_tokens)
        workload = sample_workload(args, args.tokenizer or args.model)
    except (ValueError, OSError) as e:
        print(f"kvservice bench prefix: error: {e}", file=sys.stderr)
        return 2
    results: dict[str, dict[str, Any]] = {}
    error = None
    try:
        asyncio.run(_measure(args, workload, deployments, results))
    except (ValueError, RuntimeError, TimeoutError, grpc.aio.AioRpcError) as e:
        error = f"{e.code().name}: {e.details()}" if isinstance(e, grpc.aio.AioRpcError) else str(e)
    if results:
        print(format_prefix_table(results))
        path = result_path(args, "prefix", args.model)
        if path is not None:
            settings = {
                "model": args.model,
                **workload_settings(args),
                "num_prefill": NUM_PREFILL,
                "num_decode": NUM_DECODE,
                "configurations": {
                    c.name: {"worker_args": list(c.worker_args), "proxy_args": list(c.proxy_args)} for c in deployments
                },
            }
            write_json(path, {"settings": settings, **results})
            print(f"result written to {path}")
    if error is not None:
        print(f"kvservice bench prefix: error: {error}", file=sys.stderr)
        return 1
    return 0 if all(r["failed"] == 0 for r in results.values()) else 1


async def _measure(
    args: argparse.Namespace,
    workload: Workload,
    deployments: Sequence[Configuration],
    results: dict[str, dict[str, Any]],
) -> None:
    """Run the workload on each configuration's cluster in turn, filling `results` as they finish."""
    extra_worker_args = [a for a in args.worker_args if a != "--"]
    for configuration in deployments:
        print(f"{configuration.name}: starting", file=sys.stderr, flush=True)
        cluster = LocalCluster(
            args.model,
            NUM_PREFILL,
            NUM_DECODE,
            worker_args=[*extra_worker_args, *configuration.worker_args],
            # The proxy hashes text and chat prompts with the model's tokenizer (kv-aware routing).
            proxy_args=[*configuration.proxy_args, "--model", args.model],
        )
        try:
            async with cluster:
                metrics, records, extra = await run_benchmark_with_args(cluster.address, workload, args)
        except LaunchError as e:
            raise RuntimeError(launch_error_message(configuration, e)) from None
        results[configuration.name] = result_json(metrics, records, {**extra, **workload_settings(args)})
        print(
            f"{configuration.name}: {metrics.completed} completed, {metrics.failed} failed "
            f"in {metrics.duration_s:.1f} s",
            file=sys.stderr,
            flush=True,
        )
