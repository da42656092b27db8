"""Decode step time with and without a structured-output constraint, side by side (SmolLM2).

The same chat prompts decode at batch 1 and 16, once free (EOS ignored) and once under a
JSON schema whose one string field is long enough that no request ends early. Only steps in
which every request of the batch decodes are timed, so the ratio is the grammar's cost per
token (mask fill, apply, accept) at that batch: the issue's target is at most 1.2x.

    .venv/bin/python scripts/structured_tpot.py [--steps 40] [--batch-sizes 1 16]
"""

from __future__ import annotations

from kvservice.runtime.process_env import exec_with_worker_env

exec_with_worker_env()  # as `kvservice serve` runs: the malloc tunables and OpenMP's policy, from the start

import argparse
import json
import statistics
import time

from kvservice import LLM, SamplingParams
from kvservice.core.structured_output import StructuredOutputParams

SCHEMA = {
    "type": "object",
    "properties": {"story": {"type": "string", "minLength": 600, "maxLength": 800}},
    "required": ["story"],
    "additionalProperties": False,
}
QUESTION = "Write a long story about a lighthouse keeper, as JSON. Story number {i}."


def decode_step_times(llm: LLM, params: SamplingParams, batch_size: int, num_steps: int) -> list[float]:
    """Seconds of each step in which all `batch_size` requests decode (after every first token)."""
    engine = llm.engine
    tokenizer = llm.tokenizer
    prompts = [
        tokenizer.encode(
            f"<|im_start|>user\n{QUESTION.format(i=i)}<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False
        )
        for i in range(batch_size)
    ]
    request_ids = [engine.add_request(p, params) for p in prompts]
    started: set[str] = set()
    times: list[float] = []
    try:
        while len(times) < num_steps:
            is_decode_step = len(started) == batch_size
            begin = time.perf_counter()
            outputs = engine.step()
            elapsed = time.perf_counter() - begin
            if any(o.finished for o in outputs):
                raise RuntimeError(
                    "a request ended before enough decode steps were timed: raise the schema's minLength"
                )
            started |= {o.request_id for o in outputs if o.token_ids}
            if is_decode_step:
                times.append(elapsed)
    finally:
        for request_id in request_ids:
            engine.abort_request(request_id)
        while engine.has_unfinished_requests():
            engine.step()
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40, help="decode steps timed per configuration (default 40)")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16])
    args = parser.parse_args()
    llm = LLM("smollm2", dtype="float32", max_model_len=2048)
    constraint = StructuredOutputParams(json_schema=json.dumps(SCHEMA))
    free = SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True)
    constrained = SamplingParams(temperature=0, max_tokens=1000, structured_output=constraint)
    decode_step_times(llm, constrained, 1, 3)  # warm-up: kernels, the grammar's compile and vocabulary
    print("| batch | free step (ms) | constrained step (ms) | constrained / free |")
    print("| --- | --- | --- | --- |")
    for batch_size in args.batch_sizes:
        # Interleaved runs: drift on a shared machine hits both configurations alike.
        free_times, constrained_times = [], []
        for _ in range(2):
            free_times += decode_step_times(llm, free, batch_size, args.steps // 2)
            constrained_times += decode_step_times(llm, constrained, batch_size, args.steps // 2)
        free_ms, constrained_ms = (1000 * statistics.median(t) for t in (free_times, constrained_times))
        print(f"| {batch_size} | {free_ms:.2f} | {constrained_ms:.2f} | {constrained_ms / free_ms:.2f}x |")


if __name__ == "__main__":
    main()
