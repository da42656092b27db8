"""`kvservice bench compare`: disaggregated (1 prefill + 1 decode) vs colocated, same workload.

Two deployments run one after the other on this machine, never at once: first one
`--role both` worker on two cores, then a prefill worker pinned to one core and a
decode worker pinned to the other, behind a proxy. Each gets the same requests and
the same arrival times (same seed) through `run_benchmark`; the table puts the
figures side by side with their ratio, disaggregated / colocated.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from kvservice.client.bench.metrics import RequestRecord
from kvservice.client.bench.runner import Workload, result_json
from kvservice.client.bench.serve import (
    result_path,
    run_benchmark_with_args,
    sample_workload,
    workload_settings,
    write_json,
)
from kvservice.client.bench.table import cell, ratio, render
from kvservice.client.bench.workload_args import add_workload_arguments
from kvservice.client.cluster import LocalCluster

BASELINE, CANDIDATE = "colocated", "disaggregated"

# (label, result-json key); rows with a ratio column.
COMPARE_ROWS = (
    ("Mean TTFT (ms)", "mean_ttft_ms"),
    ("P99 TTFT (ms)", "p99_ttft_ms"),
    ("Mean TTST (ms)", "mean_ttst_ms"),
    ("P99 TTST (ms)", "p99_ttst_ms"),
    ("Mean TPOT (ms)", "mean_tpot_ms"),
    ("P99 TPOT (ms)", "p99_tpot_ms"),
    ("Mean ITL (ms)", "mean_itl_ms"),
    ("P99 ITL (ms)", "p99_itl_ms"),
    ("Mean E2EL (ms)", "mean_e2el_ms"),
    ("P99 E2EL (ms)", "p99_e2el_ms"),
    ("Request throughput (req/s)", "request_throughput"),
    ("Output throughput (tok/s)", "output_throughput"),
)


@dataclass(frozen=True, slots=True)
class CorePlan:
    """CPU cores per process (None: not pinned); `note` explains a fallback when fewer than two are usable."""

    colocated: tuple[int, ...] | None
    prefill: tuple[int, ...] | None
    decode: tuple[int, ...] | None
    note: str = ""


def plan_cores(available: Sequence[int]) -> CorePlan:
    """Two cores: colocated on both, prefill on the first, decode on the second."""
    cores = sorted(available)
    if not cores:
        raise ValueError("no CPU cores available")
    if len(cores) >= 2:
        return CorePlan(colocated=(cores[0], cores[1]), prefill=(cores[0],), decode=(cores[1],))
    only = (cores[0],)
    note = (
        f"only core {cores[0]} is available: every process shares it, "
        "so the two deployments get the same CPU but not 1 core + 1 core"
    )
    return CorePlan(colocated=only, prefill=only, decode=only, note=note)


def format_compare_table(results: dict[str, dict[str, Any]]) -> str:
    """The side-by-side table of two result JSONs, keyed BASELINE and CANDIDATE."""
    base, cand = results[BASELINE], results[CANDIDATE]
    rows = [
        (
            "Successful / failed requests",
            f"{base['completed']} / {base['failed']}",
            f"{cand['completed']} / {cand['failed']}",
            "",
        )
    ]
    for label, key in COMPARE_ROWS:
        a, b = float(base.get(key) or 0.0), float(cand.get(key) or 0.0)
        rows.append((label, cell(a), cell(b), ratio(b, a)))
    gbps = cand.get("kv_transfer_gbps")
    mean_ms = cand.get("kv_transfer_mean_ms")
    rows.append(("KV transfer (GB/s, mean ms)", "none", "none" if gbps is None else f"{gbps:.3f}, {mean_ms:.1f}", ""))
    return render(("Metric", BASELINE, CANDIDATE, "disagg/coloc"), rows)


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
        num_prompts=32,
        request_rate=4.0,
        num_warmups=2,
        tokenizer_default="--model's",
    )
    parser.add_argument(
        "--no-pin",
        action="store_true",
        help="let every process use every core (an idle-system latency comparison) instead of "
        "colocated on both cores vs prefill on one and decode on the other",
    )
    parser.add_argument(
        "worker_args", nargs=argparse.REMAINDER, help="after '--': extra `kvservice serve` flags for every worker"
    )


def main(args: argparse.Namespace) -> int:
    try:
        requests = sample_workload(args, args.tokenizer or args.model)
    except (ValueError, OSError) as e:
        print(f"kvservice bench compare: error: {e}", file=sys.stderr)
        return 2
    plan = CorePlan(None, None, None) if args.no_pin else plan_cores(os.sched_getaffinity(0))
    if plan.note:
        print(f"kvservice bench compare: warning: {plan.note}", file=sys.stderr)
    try:
        results, records = asyncio.run(_compare(args, requests, plan))
    except (ValueError, RuntimeError, TimeoutError, grpc.aio.AioRpcError) as e:
        message = f"{e.code().name}: {e.details()}" if isinstance(e, grpc.aio.AioRpcError) else str(e)
        print(f"kvservice bench compare: error: {message}", file=sys.stderr)
        return 1
    print(format_compare_table(results))
    path = result_path(args, "compare", args.model)
    if path is not None:
        settings = {
            "model": args.model,
            **workload_settings(args),
            "cores": {
                BASELINE: plan.colocated and list(plan.colocated),
                "prefill": plan.prefill and list(plan.prefill),
                "decode": plan.decode and list(plan.decode),
            },
        }
        write_json(path, {"settings": settings, **results})
        print(f"result written to {path}")
    if args.plot:
        from kvservice.client.bench.plots import (  # matplotlib only when asked
            write_compare_plot,
            write_plots,
        )

        print(f"plot written to {write_compare_plot(results, args.plot)}")
        for name, deployment_records in records.items():
            for path in write_plots(deployment_records, args.plot / name):
                print(f"plot written to {path}")
    return 0 if all(r["failed"] == 0 for r in results.values()) else 1


async def _compare(
    args: argparse.Namespace, requests: Workload, plan: CorePlan
) -> tuple[dict[str, dict[str, Any]], dict[str, list[RequestRecord]]]:
    worker_args = [a for a in args.worker_args if a != "--"]
    deployments = {
        BASELINE: LocalCluster(args.model, worker_args=worker_args, colocated=True, colocated_cores=plan.colocated),
        CANDIDATE: LocalCluster(
            args.model, 1, 1, worker_args=worker_args, prefill_cores=plan.prefill, decode_cores=plan.decode
        ),
    }
    results: dict[str, dict[str, Any]] = {}
    records: dict[str, list[RequestRecord]] = {}
    for name, cluster in deployments.items():
        print(f"{name}: starting", file=sys.stderr, flush=True)
        async with cluster:
            metrics, records[name], extra = await run_benchmark_with_args(cluster.address, requests, args)
        results[name] = result_json(metrics, records[name], {**extra, **workload_settings(args)})
        print(
            f"{name}: {metrics.completed} completed, {metrics.failed} failed in {metrics.duration_s:.1f} s",
            file=sys.stderr,
            flush=True,
        )
    return results, records
