"""`kvservice bench spec`: speculative decoding, side by side in one run.

1. A prefill step with a draft pass on a prefill worker's engine (the KV save to the
   staging pool in flight), finalized deferred (the draft pass overlaps the save) vs
   eagerly (the save is waited for before the draft pass).
2. Decode tokens/s without speculation, with a draft that agrees often (the target's
   first layer, of a target whose later layers are damped) and with one that rarely
   agrees (independent random weights). Run with the servers' OpenMP settings
   (process_env.WORKER_ENV): the staging copy thread and spinning OpenMP threads fight otherwise.

With `--method ngram`, instead: prompt lookup (no draft model) on a real model (`--model`,
SmolLM2 by default), greedy, against no speculation on the same engine settings: the time per
output token and the acceptance rate on chat questions (little to look up) and on requests to
repeat a passage (the answer is in the prompt).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import statistics
import tempfile
import time
from dataclasses import dataclass

import torch

from kvservice.client.bench import spec_served
from kvservice.client.bench.engine import BENCH_MODEL
from kvservice.client.demo import DEMO_QUESTIONS
from kvservice.config import DEFAULT_PROMPT_LOOKUP_MAX, DEFAULT_PROMPT_LOOKUP_MIN, EngineConfig
from kvservice.connector.base import TRANSFER_TOKEN
from kvservice.connector.prefill_connector import PrefillKVConnector
from kvservice.connector.staging import StagingPool
from kvservice.connector.transfer_registry import TransferRegistry
from kvservice.core.sampling_params import SamplingParams
from kvservice.engine.engine import LLMEngine
from kvservice.engine.engine_builder import build_engine, kv_transfer_layout
from kvservice.loading.chat_template import apply_chat_template

LATE_LAYER_SCALE = 0.02
# `--method ngram`'s repetitive workload: the model is asked to repeat one of these word for word.
PASSAGES = [
    "The lighthouse keeper climbed the spiral stairs every evening at dusk. He trimmed the wick, polished "
    "the great lens until it shone, and wrote the weather in a leather book: wind from the west, light rain, "
    "three ships passing north. In forty years he missed only one evening, the night his daughter was born.",
    "To make bread, mix flour, water, salt and yeast into a soft dough. Knead it for ten minutes, until it is "
    "smooth and springs back when pressed. Let it rise in a warm place for an hour, shape it into a loaf, let "
    "it rise again, and bake it in a hot oven for thirty-five minutes, until the crust is brown.",
    "A cache keeps a copy of data close to where it is used, so that the next request for it is fast. When "
    "the cache is full, something must be evicted: often the entry used least recently. A good cache is small "
    "enough to be fast and large enough to hold what is about to be needed again.",
    "The river begins as snow on the high peaks. In spring it melts into streams that join in the valleys, "
    "turn mill wheels in the old towns, water the orchards on the plain, and at last spread into a wide, slow "
    "delta where herons stand in the reeds and the water meets the sea.",
]


def save_models(root: pathlib.Path, num_layers: int) -> tuple[pathlib.Path, pathlib.Path, pathlib.Path]:
    """The target, a draft made of its first layer (agrees often), and an unrelated random
    one-layer draft (rarely agrees)."""
    from safetensors.torch import load_file, save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    config = {**BENCH_MODEL, "num_hidden_layers": num_layers}
    torch.manual_seed(0)
    target = root / "target"
    model = LlamaForCausalLM(LlamaConfig(**config))
    with torch.no_grad():
        # Random layers all rewrite the prediction, so no cheap draft would agree with them.
        # Damp what layers past the first add to the residual stream, as trained models'
        # late layers mostly refine it: the first layer alone then often agrees.
        for layer in model.model.layers[1:]:
            layer.self_attn.o_proj.weight.mul_(LATE_LAYER_SCALE)
            layer.mlp.down_proj.weight.mul_(LATE_LAYER_SCALE)
    model.save_pretrained(target)
    torch.manual_seed(1)
    unrelated = root / "unrelated"
    LlamaForCausalLM(LlamaConfig(**{**config, "num_hidden_layers": 1})).save_pretrained(unrelated)
    first = root / "first_layer"
    first.mkdir()
    cfg = json.loads((target / "config.json").read_text())
    cfg["num_hidden_layers"] = 1
    (first / "config.json").write_text(json.dumps(cfg))
    tensors: dict[str, torch.Tensor] = {}
    for shard in target.glob("*.safetensors"):
        tensors.update(load_file(str(shard)))
    keep = {k: v for k, v in tensors.items() if not k.startswith("model.layers.") or k.startswith("model.layers.0.")}
    save_file(keep, str(first / "model.safetensors"))
    return target, first, unrelated


def prefill_step_seconds(
    target: pathlib.Path, draft: pathlib.Path, prompts: list[list[int]], repeats: int, device: str = "cpu"
) -> dict[str, float]:
    """Median step time of the same prefill, deferred vs eager finalize, alternating: a served
    prefill worker's step, the draft's prompt KV staged for the decode worker with the target's.
    Also the median of the step's first wait for the save: eager, the target's whole save, which
    is all that deferring can hide; deferred, what is left of the saves after the draft pass."""
    config = EngineConfig(
        dtype="float32",
        num_blocks=2048,
        max_num_batched_tokens=sum(map(len, prompts)),
        max_num_seqs=len(prompts),
        draft_model=str(draft),
        num_speculative_tokens=3,
        device=device,
    )
    layout = kv_transfer_layout(str(target), config)
    assert layout.num_draft_layers > 0, "the draft's KV has the target's geometry: it travels"
    # Pinned on CUDA, as the workers' pool is: the save's copies then run on a side stream.
    pool = StagingPool(512 << 20, pin_memory=device.startswith("cuda"))
    registry = TransferRegistry(pool, layout, lease_seconds=600)
    connector = PrefillKVConnector(registry)
    engine = build_engine(str(target), config, connector)
    runner = engine.core.runner
    params = SamplingParams(temperature=0.0, max_tokens=1)
    times: dict[str, list[float]] = {"deferred": [], "eager": []}
    waits: dict[str, list[float]] = {"deferred": [], "eager": []}
    step_waits: list[float] = []
    wait_for_save = connector.wait_for_save

    def timed_wait_for_save() -> None:
        began = time.perf_counter()
        wait_for_save()
        step_waits.append(time.perf_counter() - began)

    connector.wait_for_save = timed_wait_for_save  # type: ignore[method-assign]
    try:
        for i in range(repeats + 1):
            for mode in ("deferred", "eager"):
                for j, prompt in enumerate(prompts):
                    request_id = f"{mode}-{i}-{j}"
                    registry.register(request_id, b"t", len(prompt))
                    engine.add_request(prompt, params, request_id, {TRANSFER_TOKEN: b"t"})
                runner.kv_save_before_draft = mode == "eager"
                step_waits.clear()
                start = time.perf_counter()
                engine.step()  # every prompt in one step: the prefill, its save and the draft pass
                elapsed = time.perf_counter() - start
                if i > 0:  # the first round warms up
                    times[mode].append(elapsed)
                    waits[mode].append(step_waits[0])
                while engine.has_unfinished_requests():
                    engine.step()
                for j in range(len(prompts)):
                    registry.fail(f"{mode}-{i}-{j}", "benchmark: nobody pulls")
    finally:
        connector.shutdown()
    return {mode: statistics.median(values) for mode, values in times.items()} | {
        f"{mode}_save_wait": statistics.median(values) for mode, values in waits.items()
    }


def decode_tokens_per_s(
    target: pathlib.Path,
    draft: pathlib.Path | None,
    prompts: list[list[int]],
    max_tokens: int,
    k: int,
    device: str = "cpu",
) -> tuple[float, float]:
    config = EngineConfig(
        dtype="float32",
        num_blocks=2048,
        max_num_seqs=len(prompts),
        draft_model=None if draft is None else str(draft),
        num_speculative_tokens=0 if draft is None else k,
        device=device,
    )
    engine = build_engine(str(target), config)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for prompt in prompts:
        engine.add_request(prompt, params)
    engine.step()  # the prefill
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    elapsed = time.perf_counter() - start
    return len(prompts) * (max_tokens - 1) / elapsed, engine.core.scheduler.make_stats().spec_decoding.acceptance_rate


@dataclass(frozen=True, slots=True)
class NgramRun:
    """One workload on one engine: the time per output token after each request's first (TPOT,
    over all the requests' tokens), and the speculative counters of the run."""

    tpot_s: float
    num_draft_tokens: int
    num_accepted_tokens: int
    num_verify_steps: int
    token_ids: list[list[int]]

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def tokens_per_verify(self) -> float:
        return 1 + self.num_accepted_tokens / self.num_verify_steps if self.num_verify_steps else 1.0


def ngram_workloads(engine: LLMEngine, num_prompts: int) -> dict[str, list[list[int]]]:
    """Chat questions, and requests to repeat a passage, as chat-templated prompts."""

    def chat(text: str) -> list[int]:
        return apply_chat_template(engine.tokenizer, [{"role": "user", "content": text}])

    repeat = [f"Repeat the following passage word for word.\n\n{p}" for p in PASSAGES]
    return {
        "chat": [chat(DEMO_QUESTIONS[i % len(DEMO_QUESTIONS)]) for i in range(num_prompts)],
        "repeat": [chat(repeat[i % len(repeat)]) for i in range(num_prompts)],
    }


def timed_decode(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> NgramRun:
    """Greedy answers to `prompts` (all at once), stopping at EOS as a server would."""
    before = engine.core.scheduler.make_stats().spec_decoding
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    request_ids = [engine.add_request(prompt, params) for prompt in prompts]
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    token_ids: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:
            first.setdefault(out.request_id, now)
            last[out.request_id] = now
            token_ids[out.request_id] = out.token_ids
    # Over all the requests' tokens after their first: a short answer's few gaps weigh as few.
    num_gaps = sum(len(token_ids[r]) - 1 for r in request_ids)
    after = engine.core.scheduler.make_stats().spec_decoding
    return NgramRun(
        sum(last[r] - first[r] for r in request_ids) / max(num_gaps, 1),
        after.num_draft_tokens - before.num_draft_tokens,
        after.num_accepted_tokens - before.num_accepted_tokens,
        after.num_verify_steps - before.num_verify_steps,
        [token_ids[r] for r in request_ids],
    )


def ngram_main(args: argparse.Namespace) -> int:
    """`--method ngram`: prompt lookup against no speculation, per workload, on one machine."""
    plain_config = EngineConfig(
        max_num_seqs=args.decode_batch, max_model_len=2048, kv_cache_memory_bytes=128 << 20, device=args.device
    )
    ngram_config = dataclasses.replace(
        plain_config,
        speculative_method="ngram",
        num_speculative_tokens=args.num_speculative_tokens,
        prompt_lookup_max=args.prompt_lookup_max,
        prompt_lookup_min=args.prompt_lookup_min,
    )
    engines = {
        "no speculation": build_engine(args.model, plain_config),
        "ngram": build_engine(args.model, ngram_config),
    }
    workloads = ngram_workloads(engines["ngram"], args.decode_batch)
    for engine in engines.values():  # warm-up: kernels, allocator, the batch's shapes, a verify step's path
        for prompts in workloads.values():
            timed_decode(engine, prompts, 16)
    rounds: dict[str, dict[str, list[NgramRun]]] = {name: {mode: [] for mode in engines} for name in workloads}
    for _ in range(args.repeats):  # alternating: a change in the machine's load hits both modes alike
        for name, prompts in workloads.items():
            for mode, engine in engines.items():
                rounds[name][mode].append(timed_decode(engine, prompts, args.max_tokens))
    # Greedy: every round emits the same tokens, with the same counters; only the times vary.
    runs = {
        name: {mode: dataclasses.replace(r[0], tpot_s=statistics.median(x.tpot_s for x in r)) for mode, r in by.items()}
        for name, by in rounds.items()
    }
    _report_ngram(args, runs)
    return 0


def _report_ngram(args: argparse.Namespace, runs: dict[str, dict[str, NgramRun]]) -> None:
    print(
        f"ngram speculation on {args.model}, K={args.num_speculative_tokens}, lookup "
        f"{args.prompt_lookup_max}..{args.prompt_lookup_min} tokens, batch {args.decode_batch}, "
        f"up to {args.max_tokens} tokens (greedy), median of {args.repeats} rounds:"
    )
    print(f"  {'workload':<10} {'TPOT plain':>11} {'TPOT ngram':>11} {'speedup':>8} {'accepted':>9} {'tok/verify':>11}")
    for name, by_mode in runs.items():
        plain, ngram = by_mode["no speculation"], by_mode["ngram"]
        same = "" if ngram.token_ids == plain.token_ids else "  (outputs differ!)"
        print(
            f"  {name:<10} {1000 * plain.tpot_s:8.1f} ms {1000 * ngram.tpot_s:8.1f} ms "
            f"{plain.tpot_s / ngram.tpot_s:7.2f}x {ngram.acceptance_rate:9.2f} {ngram.tokens_per_verify:11.2f}{same}"
        )
    if args.json:
        print(
            json.dumps(
                {
                    name: {
                        "tpot_plain_s": by_mode["no speculation"].tpot_s,
                        "tpot_ngram_s": by_mode["ngram"].tpot_s,
                        "acceptance_rate": by_mode["ngram"].acceptance_rate,
                        "tokens_per_verify": by_mode["ngram"].tokens_per_verify,
                        "same_tokens": by_mode["ngram"].token_ids == by_mode["no speculation"].token_ids,
                    }
                    for name, by_mode in runs.items()
                }
            )
        )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--method",
        choices=("draft", "ngram"),
        default="draft",
        help="draft: the finalize order and draft models on a random target; ngram: prompt lookup on --model, "
        "chat and repeat-a-passage workloads, against no speculation (default: draft)",
    )
    parser.add_argument("--model", default="smollm2", help="--method ngram's target (default: smollm2)")
    parser.add_argument(
        "--prompt-lookup-max",
        type=int,
        default=DEFAULT_PROMPT_LOOKUP_MAX,
        help=f"--method ngram (default: {DEFAULT_PROMPT_LOOKUP_MAX})",
    )
    parser.add_argument(
        "--prompt-lookup-min",
        type=int,
        default=DEFAULT_PROMPT_LOOKUP_MIN,
        help=f"--method ngram (default: {DEFAULT_PROMPT_LOOKUP_MIN})",
    )
    parser.add_argument("--num-layers", type=int, default=8, help="target layers (default: 8)")
    parser.add_argument("--prompt-len", type=int, default=512, help="prefill benchmark prompt tokens (default: 512)")
    parser.add_argument("--num-prompts", type=int, default=4, help="prompts per prefill step (default: 4)")
    parser.add_argument("--decode-batch", type=int, default=4, help="decode benchmark batch (default: 4)")
    parser.add_argument("--max-tokens", type=int, default=64, help="decode benchmark tokens per request (default: 64)")
    parser.add_argument("--num-speculative-tokens", type=int, default=3, help="K (default: 3)")
    parser.add_argument(
        "--repeats",
        type=int,
        default=5,
        help="prefill step repeats per mode; --method ngram: rounds of every workload, TPOT their median (default: 5)",
    )
    parser.add_argument("--device", default="cpu", help="'cpu' or 'cuda[:N]' (default: cpu)")
    parser.add_argument(
        "--served",
        action="store_true",
        help="--method draft: also serve a 1P1D pair twice, the draft on the prefill worker (its KV travels) "
        "against the decode worker recomputing it, and compare TTFT, time to second token and TPOT",
    )
    parser.add_argument(
        "--num-requests", type=int, default=16, help="--served: requests at concurrency 1 per mode (default: 16)"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")


def main(args: argparse.Namespace) -> int:
    if args.method == "ngram":
        return ngram_main(args)
    gen = torch.Generator().manual_seed(0)
    vocab = BENCH_MODEL["vocab_size"]
    with tempfile.TemporaryDirectory() as tmp:
        target, first, unrelated = save_models(pathlib.Path(tmp), args.num_layers)
        prompts = [torch.randint(0, vocab, (args.prompt_len,), generator=gen).tolist() for _ in range(args.num_prompts)]
        step = prefill_step_seconds(target, first, prompts, args.repeats, args.device)
        ratio = step["deferred"] / step["eager"]
        print(f"prefill step with a draft pass ({args.num_prompts} x {args.prompt_len} tokens, staging to the pool):")
        print(
            f"  deferred finalize {1000 * step['deferred']:.1f} ms, eager {1000 * step['eager']:.1f} ms: "
            f"{ratio:.2f}x (target <= 0.85x)"
        )
        print(
            f"  the wait for the target's save: eager {1000 * step['eager_save_wait']:.2f} ms (all that deferring "
            f"can hide: {step['eager_save_wait'] / step['eager']:.1%} of the step), deferred, after the draft pass, "
            f"{1000 * step['deferred_save_wait']:.2f} ms"
        )
        decode_prompts = [torch.randint(0, vocab, (32,), generator=gen).tolist() for _ in range(args.decode_batch)]
        rows = {}
        for name, draft in (
            ("no speculation", None),
            ("draft: target's first layer", first),
            ("draft: unrelated", unrelated),
        ):
            rows[name] = decode_tokens_per_s(
                target, draft, decode_prompts, args.max_tokens, args.num_speculative_tokens, args.device
            )
        base = rows["no speculation"][0]
        print(f"decode, batch {args.decode_batch}, K={args.num_speculative_tokens}:")
        for name, (tps, acceptance) in rows.items():
            print(f"  {name:<30} {tps:8.1f} tokens/s  {tps / base:5.2f}x  acceptance {acceptance:.2f}")
        served = spec_served.run(target, first, args, vocab) if args.served else None
    if args.json:
        print(
            json.dumps(
                {
                    "prefill_step_deferred_s": step["deferred"],
                    "prefill_step_eager_s": step["eager"],
                    "deferred_over_eager": ratio,
                    "save_wait_eager_s": step["eager_save_wait"],
                    "save_wait_deferred_s": step["deferred_save_wait"],
                    "decode": {
                        name: {"tokens_per_s": tps, "acceptance_rate": acc} for name, (tps, acc) in rows.items()
                    },
                    "served": None
                    if served is None
                    else {
                        name: {key: result.get(key) for _, key in spec_served.ROWS} | result["decode_spec_decode"]
                        for name, result in served.items()
                    },
                }
            )
        )
    return 0
