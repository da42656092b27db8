#!/usr/bin/env python3
"""The step time of SmolLM2 on this machine with 17 requests decoding and a long prompt arriving,
by the prompt tokens a step may add (`--max-prefill-tokens-with-decode`; 0: no cap).

    OMP_WAIT_POLICY=PASSIVE GOMP_SPINCOUNT=3000 .venv/bin/python scripts/step_time_by_chunk.py [THREADS]

The inter-token latency of every running stream is the step time: this is the measurement
the default cap was chosen by (kvservice/config.py).
"""

from __future__ import annotations

import sys
import time

import torch

from kvservice import LLM, SamplingParams

torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 2)
for chunk in (0, 32, 48, 64, 128, 256):
    llm = LLM("smollm2", max_num_batched_tokens=2048, max_prefill_tokens_with_decode=chunk or None)
    eng = llm.engine
    for i in range(16):
        eng.add_request(list(range(200 + i, 456 + i)), SamplingParams(max_tokens=400, temperature=0, ignore_eos=True))
    for _ in range(40):
        eng.step()  # prompts prefilled, all decoding
    eng.add_request(list(range(1000, 1000 + 2000)), SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    ts = []
    for _ in range(6):
        t = time.perf_counter()
        eng.step()
        ts.append(time.perf_counter() - t)
    print(f"chunk {chunk:4d}: step {1000 * sorted(ts)[len(ts) // 2]:.0f} ms (median of 6)", flush=True)
