"""The prepared device check (issue 15): every GPU figure the design asks for, in one go, as one JSON.

Steps, each in its own process with its own deadline, run on `--device`:
1. `pd_transfer`: a prefill and a decode worker (two processes, KV pulled over gRPC) serve
   greedy requests on the tiny model; their tokens must equal the engine's in this process.
2. `bench_transfer`: `kvservice bench transfer` (pinned staging, side-stream copies on CUDA).
3. `bench_spec`: `kvservice bench spec`, prefill step with a draft pass, deferred vs eager finalize.
4. `bench_engine`: `kvservice bench engine`, kvservice vs transformers' generate.

A step that fails or runs out of time is recorded with its error and the next one runs;
the whole check stops starting steps when the total time limit is spent. `--quick` shrinks
every size (the CPU test runs it). The JSON: {"device", "torch", ..., "steps": {name:
{"ok", "seconds", "error"?, "figures"?}}, "figures": {"step.name": number}}.

Run through scripts/device_check.sh; see there for the device machine's set-up.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import platform
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

Figures = dict[str, float]


@dataclass(frozen=True, slots=True)
class Step:
    """One check: `figures(device, quick, timeout_s)` runs it and returns its numbers."""

    name: str
    figures: Callable[[str, bool, float], Figures]
    share: float  # of the total time limit, at most


def _last_json_line(text: str) -> Any:
    """The JSON object a `--json` benchmark prints as its last line."""
    lines = [line for line in text.splitlines() if line.startswith(("{", "["))]
    if not lines:
        raise RuntimeError("the benchmark printed no JSON line")
    return json.loads(lines[-1])


def _run_bench(args: list[str], timeout_s: float) -> Any:
    """`python -m kvservice bench ARGS --json` in a child process; its JSON report."""
    command = [sys.executable, "-m", "kvservice", "bench", *args, "--json"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, check=False)
    if result.returncode != 0 and not result.stdout.strip().endswith(("}", "]")):
        tail = (result.stderr or result.stdout).strip().splitlines()[-5:]
        raise RuntimeError(f"{' '.join(args[:1])} exited {result.returncode}: " + " | ".join(tail))
    return _last_json_line(result.stdout)


def bench_transfer(device: str, quick: bool, timeout_s: float) -> Figures:
    size, repeats = ("4", "1") if quick else ("256", "3")
    report = _run_bench(["transfer", "--device", device, "--size-mib", size, "--repeats", repeats], timeout_s)
    keys = (
        "grpc_gbps",
        "tcp_gbps",
        "ratio",
        "plain_grpc_gbps",
        "shm_gbps",
        "shm_ratio",
        "grpc_sender_cpu_s_per_gb",
        "grpc_receiver_cpu_s_per_gb",
        "num_verified_bytes",
    )
    return {k: float(report[k]) for k in keys}


def bench_spec(device: str, quick: bool, timeout_s: float) -> Figures:
    sizes = (
        [
            "--num-layers",
            "2",
            "--prompt-len",
            "32",
            "--num-prompts",
            "2",
            "--decode-batch",
            "2",
            "--max-tokens",
            "4",
            "--repeats",
            "1",
        ]
        if quick
        else ["--num-layers", "8", "--prompt-len", "512", "--num-prompts", "4", "--repeats", "5"]
    )
    report = _run_bench(["spec", "--device", device, *sizes], timeout_s)
    figures = {k: float(report[k]) for k in ("prefill_step_deferred_s", "prefill_step_eager_s", "deferred_over_eager")}
    for name, row in report["decode"].items():
        figures[f"decode_tokens_per_s[{name}]"] = float(row["tokens_per_s"])
    return figures


def bench_engine(device: str, quick: bool, timeout_s: float) -> Figures:
    sizes = (
        ["--model", "random-small", "--batch-sizes", "1", "2", "--max-tokens", "4", "--repeats", "1", "--threads", "1"]
        if quick
        else ["--model", "random-smollm2", "--batch-sizes", "1", "16", "--max-tokens", "128", "--repeats", "3"]
    )
    figures: Figures = {}
    for dtype in ("float32",) if quick else ("float32", "bfloat16"):
        for row in _run_bench(["engine", "--device", device, "--dtype", dtype, *sizes], timeout_s):
            prefix = f"{dtype}.b{row['batch_size']}"
            figures[f"{prefix}.decode_ratio"] = float(row["decode_ratio"])
            figures[f"{prefix}.prefill_ratio"] = float(row["prefill_ratio"])
            figures[f"{prefix}.kvservice_decode_tok_s"] = float(row["kvservice"]["decode_tokens_per_s"])
            figures[f"{prefix}.transformers_decode_tok_s"] = float(row["transformers"]["decode_tokens_per_s"])
    return figures


def pd_transfer(device: str, quick: bool, timeout_s: float) -> Figures:
    return asyncio.run(asyncio.wait_for(_pd_transfer(device, quick), timeout_s))


async def _pd_transfer(device: str, quick: bool) -> Figures:
    """Greedy tokens through 1 prefill + 1 decode worker, and from an engine in this process (what a
    colocated worker computes), on the same device: equal, with the prompts' KV pulled over gRPC."""
    from kvservice import LLM, SamplingParams
    from kvservice.client.client import KVServiceClient
    from kvservice.client.cluster import LocalCluster

    num_prompts, prompt_len, max_tokens = (2, 40, 4) if quick else (8, 600, 32)
    prompts = [[(7 * i + 3 * j) % 250 + 3 for j in range(prompt_len + i)] for i in range(num_prompts)]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    colocated = [list(o.token_ids) for o in LLM("tiny", device=device).generate(prompts, params)]
    async with LocalCluster("tiny", worker_args=["--device", device]) as cluster:
        async with KVServiceClient(cluster.address) as client:
            start = time.perf_counter()
            done = await asyncio.gather(
                *(client.complete(p, max_tokens=max_tokens, temperature=0.0, ignore_eos=True) for p in prompts)
            )
            seconds = time.perf_counter() - start
        async with KVServiceClient(cluster.decode_addresses[0]) as decode:
            kv_bytes = float((await decode.stats()).kv_receiving.num_bytes)
    num_mismatched = sum(c.token_ids != ref for c, ref in zip(done, colocated, strict=True))
    if num_mismatched or kv_bytes == 0:
        raise RuntimeError(
            f"{num_mismatched} of {num_prompts} requests differ from colocated; {kv_bytes:.0f} KV bytes pulled"
        )
    return {
        "num_requests": float(num_prompts),
        "num_mismatched_requests": float(num_mismatched),
        "kv_bytes_pulled": kv_bytes,
        "disaggregated_s": seconds,
    }


STEPS = [
    Step("pd_transfer", pd_transfer, 0.2),
    Step("bench_transfer", bench_transfer, 0.25),
    Step("bench_spec", bench_spec, 0.2),
    Step("bench_engine", bench_engine, 0.5),
]


def _environment(device: str) -> dict[str, Any]:
    info: dict[str, Any] = {
        "device": device,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpu": platform.processor() or platform.machine(),
        "num_cpus": os.cpu_count(),
    }
    if device.startswith("cuda") and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(torch.device(device))
    return info


def run_checks(device: str, quick: bool, time_limit_s: float, only: list[str] | None = None) -> dict[str, Any]:
    """Every step (or `only` these), each within its share of what is left of `time_limit_s`."""
    deadline = time.monotonic() + time_limit_s
    report: dict[str, Any] = {
        **_environment(device),
        "quick": quick,
        "time_limit_s": time_limit_s,
        "steps": {},
        "figures": {},
    }
    for step in STEPS:
        if only and step.name not in only:
            continue
        left = deadline - time.monotonic()
        timeout_s = min(left, step.share * time_limit_s)
        start = time.monotonic()
        result: dict[str, Any]
        if timeout_s < 5:
            result = {"ok": False, "error": "skipped: the total time limit is spent"}
        else:
            try:
                figures = step.figures(device, quick, timeout_s)
                result = {"ok": True, "figures": figures}
                report["figures"].update({f"{step.name}.{k}": v for k, v in figures.items()})
            except (subprocess.TimeoutExpired, TimeoutError):
                result = {"ok": False, "error": f"timed out after {timeout_s:.0f} s"}
            except Exception as e:  # recorded; the next step still runs
                result = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        result["seconds"] = time.monotonic() - start
        report["steps"][step.name] = result
        print(
            f"{step.name}: {'ok' if result['ok'] else result['error']} ({result['seconds']:.1f} s)",
            file=sys.stderr,
            flush=True,
        )
    report["num_failed_steps"] = sum(not r["ok"] for r in report["steps"].values())
    return report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", help="'cuda[:N]' or 'cpu' (default: cuda)")
    parser.add_argument(
        "--out", type=pathlib.Path, default=None, help="the JSON's path (default: $OUT/device_check.json, else stdout)"
    )
    parser.add_argument(
        "--quick", action="store_true", help="small sizes everywhere (a smoke test; figures are not comparable)"
    )
    parser.add_argument("--time-limit", type=float, default=450.0, help="seconds for all steps together (default: 450)")
    parser.add_argument("--only", nargs="+", choices=[s.name for s in STEPS], help="run only these steps")
    args = parser.parse_args()
    report = run_checks(args.device, args.quick, args.time_limit, args.only)
    text = json.dumps(report, indent=2)
    out = args.out or (pathlib.Path(os.environ["OUT"]) / "device_check.json" if os.environ.get("OUT") else None)
    if out is None:
        print(text)
    else:
        out.write_text(text + "\n")
        print(f"wrote {out}", file=sys.stderr)
    return 0 if report["num_failed_steps"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
