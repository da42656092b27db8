#!/usr/bin/env python3
"""Where the time of `bench peers`' concurrency-16 level goes, in this process: SmolLM2's engine
runs the same workload (random 256-token prompts of ids < 256, 128 tokens each, EOS ignored,
greedy, 16 requests in flight) with no server, and the steps are split by kind.

    .venv/bin/python scripts/step_mix.py [--num-prompts 64] [--chunk N] [--step-target-ms T]

Prints output tok/s (the served figure's ceiling on this machine), then per kind of step
(prompt chunks only, decoding only, both mixed) its count, time, rows and ms per row; with the
float32 GFLOP of the whole run, the effective rate to set against the matmul kernel's peak.
"""

from __future__ import annotations

from kvservice.runtime.process_env import exec_with_worker_env

exec_with_worker_env()  # as `kvservice serve` runs: the malloc tunables and OpenMP's policy, from the start

import argparse
import collections
import random
import time
from typing import Any

import torch

from kvservice import LLM, SamplingParams
from kvservice.model.model import CausalLM

PROMPT_LEN, OUTPUT_LEN, CONCURRENCY = 256, 128, 16


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-prompts", type=int, default=64, help="requests (default: 64, as bench peers)")
    parser.add_argument(
        "--chunk", type=int, default=None, help="--max-prefill-tokens-with-decode (default: the engine's)"
    )
    parser.add_argument(
        "--step-target-ms",
        type=float,
        default=None,
        help="size the chunks by measured step time (default: the engine's)",
    )
    parser.add_argument(
        "--prompt-lane",
        action="store_true",
        help="prompts in the colocated server's lane (serve's default), not in chunks",
    )
    parser.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="tokens a step (a lane batch) may compute (default: the engine's)",
    )
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default: 16)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default: 2)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    knobs = {
        "max_prefill_tokens_with_decode": args.chunk,
        "step_target_ms": args.step_target_ms,
        "prompt_lane": args.prompt_lane or None,
        "max_num_batched_tokens": args.max_num_batched_tokens,
    }
    llm = LLM(
        "smollm2", block_size=args.block_size, **{name: value for name, value in knobs.items() if value is not None}
    )
    engine = llm.engine
    rng = random.Random(0)
    prompts = [[rng.randrange(256) for _ in range(PROMPT_LEN)] for _ in range(args.num_prompts)]
    llm.generate([prompts[0][:32]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))  # warm-up

    forwards: list[tuple[int, int, float]] = []  # (rows, decode rows, seconds) per forward
    forward = CausalLM.forward

    def timed_forward(
        self: CausalLM,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: Any,
        meta: Any,
        connector: Any = None,
        pause: Any = None,
    ) -> torch.Tensor:
        start = time.perf_counter()
        out = forward(self, input_ids, positions, kv_caches, meta, connector, pause)
        forwards.append((int(input_ids.shape[0]), meta.num_decode_tokens, time.perf_counter() - start))
        return out

    CausalLM.forward = timed_forward  # type: ignore[method-assign]
    params = SamplingParams(max_tokens=OUTPUT_LEN, temperature=0, ignore_eos=True)
    sent = in_flight = 0
    start = time.perf_counter()
    while sent < len(prompts) or in_flight:
        while in_flight < CONCURRENCY and sent < len(prompts):
            engine.add_request(prompts[sent], params)
            sent, in_flight = sent + 1, in_flight + 1
        in_flight -= sum(1 for output in engine.step() if output.finished)
    elapsed = time.perf_counter() - start
    CausalLM.forward = forward  # type: ignore[method-assign]

    cfg = engine.core.loaded.model.config
    flops_per_token = 2 * sum(p.numel() for n, p in engine.core.loaded.model.named_parameters() if ".layers." in n)
    flops = (
        len(prompts) * (PROMPT_LEN + OUTPUT_LEN) * flops_per_token
        + len(prompts) * OUTPUT_LEN * 2 * cfg.vocab_size * cfg.hidden_size
    )
    print(
        f"{len(prompts)} requests in {elapsed:.1f} s: {len(prompts) * OUTPUT_LEN / elapsed:.1f} output tok/s, "
        f"{flops / 1e12:.2f} TFLOP of float32 matmuls ({flops / elapsed / 1e9:.0f} GFLOP/s effective)"
    )
    kinds: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0, 0])
    for rows, decode_rows, seconds in forwards:
        kind = "decode only" if rows == decode_rows else "prompts only" if decode_rows == 0 else "mixed"
        kinds[kind][0] += 1
        kinds[kind][1] += seconds
        kinds[kind][2] += rows
    steps = sorted(f[2] for f in forwards)
    print(
        f"  forward times: median {1000 * steps[len(steps) // 2]:.0f} ms, "
        f"p99 {1000 * steps[int(0.99 * len(steps))]:.0f} ms"
    )
    for kind, (count, seconds, rows) in sorted(kinds.items()):
        print(
            f"  {kind:12s} {int(count):5d} steps {seconds:6.1f} s {int(rows):7d} rows "
            f"{1000 * seconds / count:7.1f} ms/step {1000 * seconds / rows:5.2f} ms/row"
        )
    print(
        f"  outside the forward (LM head, sampling, scheduler, outputs): {elapsed - sum(f[2] for f in forwards):.1f} s"
    )


if __name__ == "__main__":
    main()
