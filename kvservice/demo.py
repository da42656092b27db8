"""`kvservice demo`: the main job. Runs the built-in tiny model and reports what it did."""

from __future__ import annotations

import argparse
import time

from kvservice.llm import LLM
from kvservice.sampling_params import SamplingParams

DEMO_PROMPTS = [
    "Disaggregated serving splits prefill from decode.",
    "The KV cache travels over gRPC,",
    "Hello, world!",
    "Prefill workers run prompts; decode workers generate tokens.",
]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens to generate per prompt (default: 32)")


def main(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    llm = LLM("tiny")
    load_s = time.perf_counter() - t0
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    t1 = time.perf_counter()
    outputs = llm.generate(DEMO_PROMPTS, params)
    gen_s = time.perf_counter() - t1
    print(f"kvservice demo: tiny model loaded in {load_s * 1000:.0f} ms; offline generation of {len(outputs)} prompts")
    for prompt, out in zip(DEMO_PROMPTS, outputs):
        print(f"  {prompt!r} -> {len(out.token_ids)} tokens ({out.finish_reason}): {out.token_ids[:8]}...")
    num_tokens = sum(len(o.token_ids) for o in outputs)
    print(f"generated {num_tokens} tokens in {gen_s * 1000:.0f} ms ({num_tokens / gen_s:.0f} tokens/s)")
    free, total = llm.engine.num_free_blocks, llm.engine.num_blocks
    print(f"KV blocks free after the run: {free}/{total}")
    return 0 if free == total else 1
