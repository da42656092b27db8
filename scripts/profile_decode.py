#!/usr/bin/env python3
"""Where a batch-1 decode step's time goes, on SmolLM2 in this process.

    .venv/bin/python scripts/profile_decode.py [--threads 2] [--steps 64] [--batch 1]

Times each part of `LLMEngine.step` by wrapping it (scheduler, model forward, LM head,
sampling, detokenizing and the rest), and splits the forward into the C++/ATen kernels'
own time (torch profiler) and the Python between them. The per-token trip through asyncio,
gRPC and HTTP is what a served TPOT adds to the step: compare with `kvservice bench serve`.
"""

from __future__ import annotations

from kvservice.runtime.process_env import exec_with_worker_env

exec_with_worker_env()  # as `kvservice serve` runs: the malloc tunables and OpenMP's policy, from the start

import argparse
import collections
import functools
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from kvservice import LLM, SamplingParams
from kvservice.engine import engine as engine_module
from kvservice.engine.scheduler import Scheduler
from kvservice.model.model import CausalLM
from kvservice.worker.sampler import Sampler

TOTALS: dict[str, float] = collections.defaultdict(float)


def timed(owner: Any, name: str, label: str) -> None:
    """Wrap owner.name so each call adds its wall time to TOTALS[label]."""
    original: Callable[..., Any] = getattr(owner, name)

    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            TOTALS[label] += time.perf_counter() - start

    setattr(owner, name, wrapper)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default: 2)")
    parser.add_argument("--steps", type=int, default=64, help="decode steps timed (default: 64)")
    parser.add_argument("--batch", type=int, default=1, help="requests decoding together (default: 1)")
    parser.add_argument("--prompt-len", type=int, default=256, help="prompt tokens (default: 256)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    llm = LLM("smollm2")
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=2 * args.steps + 16, ignore_eos=True)  # both runs decode
    llm.generate(
        [list(range(100, 100 + args.prompt_len))], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    )

    timed(Scheduler, "schedule", "scheduler")
    timed(Scheduler, "update_from_output", "scheduler")
    timed(CausalLM, "forward", "model forward")
    timed(CausalLM, "compute_logits", "LM head")
    timed(CausalLM, "greedy_tokens", "LM head")  # a greedy batch's head (or None: then compute_logits)
    timed(Sampler, "sample", "sampling")
    timed(engine_module.LLMEngine, "_to_request_output", "detokenize + outputs")
    for i in range(args.batch):
        engine.add_request(list(range(100 + i, 100 + i + args.prompt_len)), params)
    while (
        any(r.num_computed_tokens < r.num_tokens - 1 for r in engine.core.scheduler.running)
        or engine.core.scheduler.waiting
    ):
        engine.step()  # the prompts
    for _ in range(4):
        engine.step()
    TOTALS.clear()
    start = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    wall = time.perf_counter() - start
    totals, profiled = dict(TOTALS), sum(TOTALS.values())
    with profile(activities=[ProfilerActivity.CPU]) as prof:  # a second run: the profiler costs time
        for _ in range(args.steps):
            engine.step()
    ops = {e.key: e.self_cpu_time_total / 1e6 for e in prof.key_averages()}
    kernels = sum(t for k, t in ops.items() if k.startswith(("kvservice::", "aten::", "mkldnn::")))
    per_step = lambda seconds: f"{1000 * seconds / args.steps:7.2f} ms"  # noqa: E731
    print(
        f"SmolLM2, batch {args.batch}, {args.threads} threads, "
        f"{args.steps} decode steps after a {args.prompt_len}-token prompt"
    )
    print(f"  {'engine.step (wall)':<34} {per_step(wall)}")
    forward = totals["model forward"]
    print(f"  {'model forward':<34} {per_step(forward)}")
    print(f"    {'kernels, LM head included':<32} {per_step(kernels)}  (profiled run)")
    for key in sorted(ops, key=ops.get, reverse=True)[:6]:
        print(f"      {key:<30} {per_step(ops[key])}")
    for label in ("LM head", "sampling", "scheduler", "detokenize + outputs"):
        print(f"  {label:<34} {per_step(totals.get(label, 0.0))}")
    print(f"  {'the rest (batch building, glue)':<34} {per_step(wall - profiled)}")
    print(f"  {'Python between the kernels (est.)':<34} {per_step(forward + totals.get('LM head', 0.0) - kernels)}")


if __name__ == "__main__":
    main()
