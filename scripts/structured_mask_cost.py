#!/usr/bin/env python3
"""What structured output adds to a decode step: the per-token mask fill, apply and accept on
SmolLM2's 49,152-token vocabulary, for a batch of 1 and of 16 constrained requests.

    .venv/bin/python scripts/structured_mask_cost.py [STEPS] [TORCH_THREADS]

Each request decodes greedily over random logits under a JSON schema, regex or choice (restarted
when its grammar ends), so the masks are those of real grammars at every position. Constrained
TPOT must stay within 1.2x of plain TPOT: compare the total with a decode step (~18 ms here).
"""

from __future__ import annotations

import json
import sys
import time

import torch

from kvservice.core.structured_output import StructuredOutputParams
from kvservice.loading.model_files import SMOLLM2_MODEL, load_model_config, load_tokenizer
from kvservice.structured.bitmask import allocate_token_bitmask, apply_token_bitmask
from kvservice.structured.grammar import GrammarCompiler
from kvservice.structured.matcher import GrammarMatcher, fill_next_token_bitmasks

_TEXT = {"type": "string", "maxLength": 40}
PARAMS = [
    StructuredOutputParams(
        json_schema=json.dumps(
            {
                "type": "object",
                "required": ["name", "age", "tags", "address"],
                "additionalProperties": False,
                "properties": {
                    "name": _TEXT,
                    "age": {"type": "integer", "minimum": 0, "maximum": 150},
                    "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 5},
                    "address": {
                        "type": "object",
                        "required": ["city", "zip"],
                        "additionalProperties": False,
                        "properties": {"city": _TEXT, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    },
                },
            }
        )
    ),
    StructuredOutputParams(json_schema=json.dumps({"type": "array", "items": {"type": "number"}, "maxItems": 20})),
    StructuredOutputParams(regex=r"[A-Z][a-z]{2,12}( [a-z]{1,10}){1,8}\."),
    StructuredOutputParams(choice=("positive", "negative", "neutral")),
]


def _percentiles(name: str, seconds: list[float]) -> str:
    ms = sorted(1e3 * s for s in seconds)
    return f"{name} mean {sum(ms) / len(ms):.3f} ms, p99 {ms[int(0.99 * (len(ms) - 1))]:.3f} ms"


def measure(compiler: GrammarCompiler, batch: int, steps: int) -> None:
    generator = torch.Generator().manual_seed(batch)
    matchers: list[GrammarMatcher] = [compiler.matcher(PARAMS[i % len(PARAMS)]) for i in range(batch)]
    bitmask = allocate_token_bitmask(batch, compiler.vocab_size)
    fills, applies, accepts = [], [], []
    for _ in range(steps):
        logits = torch.randn(batch, compiler.vocab_size, generator=generator)
        start = time.perf_counter()
        if batch == 1:
            matchers[0].fill_next_token_bitmask(bitmask, 0)
        else:
            fill_next_token_bitmasks([(m, row) for row, m in enumerate(matchers)], bitmask)
        filled = time.perf_counter()
        apply_token_bitmask(logits, bitmask)
        applied = time.perf_counter()
        token_ids = logits.argmax(dim=-1).tolist()
        accept_start = time.perf_counter()
        for matcher, token_id in zip(matchers, token_ids):
            assert matcher.accept_token(token_id), matcher.error
        accepts.append(time.perf_counter() - accept_start)
        fills.append(filled - start)
        applies.append(applied - filled)
        for row, matcher in enumerate(matchers):
            if matcher.is_terminated():
                matchers[row] = compiler.matcher(PARAMS[row % len(PARAMS)])
    totals = [f + a + c for f, a, c in zip(fills, applies, accepts)]
    print(
        f"batch {batch:2d}: "
        + "; ".join(
            _percentiles(n, s) for n, s in (("fill", fills), ("apply", applies), ("accept", accepts), ("total", totals))
        ),
        flush=True,
    )


def main() -> None:
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 500
    torch.set_num_threads(int(sys.argv[2]) if len(sys.argv) > 2 else 1)
    config = load_model_config(SMOLLM2_MODEL)
    start = time.perf_counter()
    compiler = GrammarCompiler(load_tokenizer(SMOLLM2_MODEL), config.vocab_size, config.eos_token_ids)
    print(f"grammar tokenizer for {config.vocab_size} tokens: {time.perf_counter() - start:.2f} s")
    for params in PARAMS:
        start = time.perf_counter()
        compiler.compile(params)
        print(
            f"compile {next(k for k in ('json_schema', 'regex', 'choice') if getattr(params, k))}: "
            f"{1e3 * (time.perf_counter() - start):.1f} ms"
        )
    for batch in (1, 16):
        measure(compiler, batch, steps)


if __name__ == "__main__":
    main()
