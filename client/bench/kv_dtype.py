"""`kvservice bench kv-dtype`: what each `--kv-cache-dtype` costs in quality on SmolLM2, against
transformers on the same GGUF weights (dequantized to float32).

Per KV cache dtype, in-process (float32 compute):
- the worst prompt-logprob error over a few prompts, computed in chunks of --chunk tokens so later
  chunks read the cache (a prompt's first chunk attends to its own keys unrounded);
- greedy agreement over the real-model chat set (`SMOLLM2_CONVERSATIONS`, the one the SmolLM2 tests
  use): how many of the answers are token for token transformers' greedy ones, and their mean
  common prefix;
- loglikelihoods as lm-eval computes them (the continuation's summed logprobs given the context,
  and whether it is the greedy continuation) on the multiple-choice requests of the project's
  lm-eval test: the worst difference from transformers, and whether every answer picked agrees.
Timing is not measured here.
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import dataclass
from typing import Any

import torch

from kvservice.config import KV_CACHE_DTYPES
from kvservice.core.sampling_params import SamplingParams

SMOLLM2_CONVERSATIONS: list[list[dict[str, str]]] = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are a pirate."}, {"role": "user", "content": "Say hello."}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello! How can I help you today?"},
        {"role": "user", "content": "Tell me a joke."},
    ],
    [{"role": "user", "content": "Translate 'good morning' into Spanish."}],
    [{"role": "user", "content": "List three prime numbers."}],
    [{"role": "user", "content": "東京はどこですか？"}],
    [{"role": "user", "content": "def add(a, b):\n    return a + b\n\nWhat does this do?"}],
    [{"role": "user", "content": "Describe 🙂 in one word."}],
]
LOGPROB_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "Bees make honey and",
    "Once upon a time, in a small village at the edge of a great forest, there lived an old woodcutter who",
]
# (context, choices, answer): the multiple-choice requests of tests/test_lm_eval.py's task.
LM_EVAL_QUESTIONS: list[tuple[str, list[str], int]] = [
    ("The capital of France is", ["Paris", "Berlin", "Madrid", "Rome"], 0),
    ("The color of the sky on a clear day is", ["green", "blue", "red", "brown"], 1),
    ("Two plus two equals", ["seven", "three", "four", "ten"], 2),
    ("The opposite of hot is", ["cold", "loud", "tall", "fast"], 0),
    ("A dog says", ["meow", "moo", "quack", "woof"], 3),
    ("The largest planet in our solar system is", ["Mars", "Jupiter", "Venus", "Mercury"], 1),
    ("Water freezes at zero degrees", ["Fahrenheit", "Kelvin", "Celsius", "north"], 2),
    ("The first day of the week after Sunday is", ["Monday", "Friday", "Thursday", "Saturday"], 0),
    ("Bees make", ["milk", "steel", "glass", "honey"], 3),
    ("The sun rises in the", ["west", "east", "basement", "ocean"], 1),
]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--kv-cache-dtypes", nargs="+", default=list(KV_CACHE_DTYPES), choices=KV_CACHE_DTYPES, help="(default: all)"
    )
    parser.add_argument("--max-tokens", type=int, default=32, help="greedy tokens per chat answer (default: 32)")
    parser.add_argument("--chunk", type=int, default=16, help="prompt tokens a step computes (default: 16)")
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")


@dataclass(frozen=True, slots=True)
class Reference:
    """transformers' side: token ids, and per sequence its log-softmax rows (row p predicts token p + 1)."""

    chats: list[list[int]]
    greedy: list[list[int]]
    logprob_prompts: list[list[int]]
    # lm-eval's split: per request, (context ids, continuation ids).
    requests: list[tuple[list[int], list[int]]]
    log_softmax: dict[tuple[int, ...], torch.Tensor]


def main(args: argparse.Namespace) -> int:
    reference = _reference(args.max_tokens)
    report = {dtype: _measure(dtype, reference, args) for dtype in args.kv_cache_dtypes}
    _print(report, args)
    if args.json:
        print(json.dumps(report))
    return 0


def _reference(max_tokens: int) -> Reference:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvservice.loading.model_files import smollm2_path

    path = smollm2_path()
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()

    def encode(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    chats = [
        encode(tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=False))
        for c in SMOLLM2_CONVERSATIONS
    ]
    greedy = []
    with torch.no_grad():
        for ids in chats:
            out = model.generate(
                torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long), do_sample=False,
                max_new_tokens=max_tokens, min_new_tokens=max_tokens, eos_token_id=None, pad_token_id=2,
            )  # fmt: skip
            greedy.append(out[0, len(ids) :].tolist())
    requests = []
    for context, choices, _ in LM_EVAL_QUESTIONS:
        context_ids = encode(context)
        for choice in choices:
            whole = encode(f"{context} {choice}")
            requests.append((context_ids, whole[len(context_ids) :]))
    prompts = [encode(p) for p in LOGPROB_PROMPTS]
    sequences = prompts + [c + r for c, r in requests]
    with torch.no_grad():
        rows = {tuple(s): model(torch.tensor([s])).logits[0].float().log_softmax(-1) for s in sequences}
    return Reference(chats, greedy, prompts, requests, rows)


def _measure(kv_cache_dtype: str, ref: Reference, args: argparse.Namespace) -> dict[str, Any]:
    from kvservice import LLM

    llm = LLM(
        "smollm2", dtype="float32", kv_cache_dtype=kv_cache_dtype, max_num_batched_tokens=args.chunk,
        enable_prefix_caching=False, max_model_len=1024,
    )  # fmt: skip
    scored = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    sequences = ref.logprob_prompts + [c + r for c, r in ref.requests]
    outputs = llm.generate(sequences, scored)
    errors = []
    for ids, out in zip(ref.logprob_prompts, outputs):
        expected = ref.log_softmax[tuple(ids)]
        errors += [abs(lp.logprob - float(expected[p, ids[p + 1]])) for p, lp in enumerate(out.prompt_logprobs or [])]
    ll_diffs, picks_agree = _loglikelihoods(ref, outputs[len(ref.logprob_prompts) :])
    greedy = llm.generate(ref.chats, SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True))
    prefixes = [_common_prefix(o.token_ids, r) for o, r in zip(greedy, ref.greedy)]
    return {
        "kv_bytes_per_token": llm.engine.core.layout.bytes_per_block // llm.engine.core.layout.block_size,
        "worst_prompt_logprob_error": max(errors),
        "greedy_identical": sum(p == args.max_tokens for p in prefixes),
        "greedy_total": len(prefixes),
        "greedy_mean_common_prefix": statistics.mean(prefixes),
        "loglikelihood_worst_diff": max(ll_diffs),
        "loglikelihood_mean_diff": statistics.mean(ll_diffs),
        "lm_eval_answers_agree": picks_agree,
    }


def _loglikelihoods(ref: Reference, outputs: list[Any]) -> tuple[list[float], bool]:
    """Per request, |ours - transformers'| of lm-eval's loglikelihood; and whether every question's
    highest-loglikelihood choice and every is_greedy flag are transformers'."""
    diffs, ours_all, theirs_all = [], [], []
    for (context, continuation), out in zip(ref.requests, outputs):
        rows = ref.log_softmax[tuple(context + continuation)]
        positions = range(len(context) - 1, len(context) + len(continuation) - 1)
        logprobs = out.prompt_logprobs or []
        ours = sum(logprobs[p].logprob for p in positions)
        theirs = sum(float(rows[p, tok]) for p, tok in zip(positions, continuation))
        ours_greedy = all(logprobs[p].rank == 1 for p in positions)
        theirs_greedy = all(int(rows[p].argmax()) == tok for p, tok in zip(positions, continuation))
        diffs.append(abs(ours - theirs))
        ours_all.append((ours, ours_greedy))
        theirs_all.append((theirs, theirs_greedy))
    agree = [g for _, g in ours_all] == [g for _, g in theirs_all]
    n = len(LM_EVAL_QUESTIONS[0][1])
    for q in range(len(LM_EVAL_QUESTIONS)):
        ours_q, theirs_q = ours_all[q * n : (q + 1) * n], theirs_all[q * n : (q + 1) * n]
        agree &= max(range(n), key=lambda i: ours_q[i][0]) == max(range(n), key=lambda i: theirs_q[i][0])
    return diffs, agree


def _common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _print(report: dict[str, dict[str, Any]], args: argparse.Namespace) -> None:
    print(f"SmolLM2 (Q4_1 GGUF, float32 compute) against transformers; prompts in chunks of {args.chunk} tokens")
    header = (
        f"{'kv-cache-dtype':<15}{'KV B/token':>11}{'worst prompt lp err':>21}"
        f"{'greedy identical':>18}{'mean prefix':>13}{'lm-eval ll worst':>18}{'ll mean':>10}{'picks agree':>13}"
    )
    print(header)
    for dtype, r in report.items():
        print(
            f"{dtype:<15}{r['kv_bytes_per_token']:>11}{r['worst_prompt_logprob_error']:>21.2e}"
            f"{r['greedy_identical']:>12}/{r['greedy_total']:<5}{r['greedy_mean_common_prefix']:>13.1f}"
            f"{r['loglikelihood_worst_diff']:>18.2e}{r['loglikelihood_mean_diff']:>10.2e}"
            f"{'yes' if r['lm_eval_answers_agree'] else 'no':>13}"
        )
    print(f"greedy: {args.max_tokens} tokens of each of {len(SMOLLM2_CONVERSATIONS)} chat answers")
