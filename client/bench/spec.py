"""`kvservice bench spec`: speculative decoding, side by side in one run.

1. A prefill step with a draft pass on a prefill worker's engine (the KV save to the
   staging pool in flight), finalized deferred (the draft pass overlaps the save) vs
   eagerly (the save is waited for before the draft pass).
2. Decode tokens/s without speculation, with a draft that agrees often (the target's
   first layer, of a target whose later layers are damped) and with one that rarely
   agrees (independent random weights). Run with the servers' OpenMP settings
   (process_env.WORKER_ENV): the staging copy thread and spinning OpenMP threads fight otherwise.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import tempfile
import time

import torch

from kvservice.client.bench.engine import BENCH_MODEL
from kvservice.config import EngineConfig
from kvservice.connector.base import TRANSFER_TOKEN
from kvservice.connector.prefill_connector import PrefillKVConnector
from kvservice.connector.staging import StagingPool
from kvservice.connector.transfer_registry import TransferRegistry
from kvservice.core.outputs import ScheduledRequest
from kvservice.core.sampling_params import SamplingParams
from kvservice.engine.engine_builder import build_engine
from kvservice.loading.model_files import load_model_config
from kvservice.model.kv_cache import KVCacheLayout
from kvservice.worker.model_runner import ModelRunner

LATE_LAYER_SCALE = 0.02


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


class _SwitchableFinalizeRunner(ModelRunner):
    """The baseline beside the engine's own order: with `is_eager`, the KV save is waited for
    before the draft pass instead of while it runs."""

    is_eager = False

    def draft_pass(self, scheduled: list[ScheduledRequest], sampled: dict[str, list[int]]) -> None:
        if self.is_eager:
            self.finalize()
        super().draft_pass(scheduled, sampled)


def prefill_step_seconds(
    target: pathlib.Path, draft: pathlib.Path, prompts: list[list[int]], repeats: int, device: str = "cpu"
) -> dict[str, float]:
    """Median step time of the same prefill, deferred vs eager finalize, alternating."""
    config = EngineConfig(
        dtype="float32",
        num_blocks=2048,
        max_num_batched_tokens=sum(map(len, prompts)),
        max_num_seqs=len(prompts),
        draft_model=str(draft),
        num_speculative_tokens=3,
        device=device,
    )
    model_config = load_model_config(str(target))
    layout = KVCacheLayout.for_model(model_config, config.block_size, torch.float32)
    # Pinned on CUDA, as the workers' pool is: the save's copies then run on a side stream.
    pool = StagingPool(512 << 20, pin_memory=device.startswith("cuda"))
    registry = TransferRegistry(pool, layout, lease_seconds=600)
    connector = PrefillKVConnector(registry)
    engine = build_engine(str(target), config, connector, runner_cls=_SwitchableFinalizeRunner)
    runner = engine.core.runner
    assert isinstance(runner, _SwitchableFinalizeRunner)
    params = SamplingParams(temperature=0.0, max_tokens=1)
    times: dict[str, list[float]] = {"deferred": [], "eager": []}
    try:
        for i in range(repeats + 1):
            for mode in ("deferred", "eager"):
                for j, prompt in enumerate(prompts):
                    request_id = f"{mode}-{i}-{j}"
                    registry.register(request_id, b"t", len(prompt))
                    engine.add_request(prompt, params, request_id, {TRANSFER_TOKEN: b"t"})
                runner.is_eager = mode == "eager"
                start = time.perf_counter()
                engine.step()  # every prompt in one step: the prefill, its save and the draft pass
                elapsed = time.perf_counter() - start
                if i > 0:  # the first round warms up
                    times[mode].append(elapsed)
                while engine.has_unfinished_requests():
                    engine.step()
                for j in range(len(prompts)):
                    registry.fail(f"{mode}-{i}-{j}", "benchmark: nobody pulls")
    finally:
        connector.shutdown()
    return {mode: statistics.median(values) for mode, values in times.items()}


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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-layers", type=int, default=8, help="target layers (default: 8)")
    parser.add_argument("--prompt-len", type=int, default=512, help="prefill benchmark prompt tokens (default: 512)")
    parser.add_argument("--num-prompts", type=int, default=4, help="prompts per prefill step (default: 4)")
    parser.add_argument("--decode-batch", type=int, default=4, help="decode benchmark batch (default: 4)")
    parser.add_argument("--max-tokens", type=int, default=64, help="decode benchmark tokens per request (default: 64)")
    parser.add_argument("--num-speculative-tokens", type=int, default=3, help="K (default: 3)")
    parser.add_argument("--repeats", type=int, default=5, help="prefill step repeats per mode (default: 5)")
    parser.add_argument("--device", default="cpu", help="'cpu' or 'cuda[:N]' (default: cpu)")
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")


def main(args: argparse.Namespace) -> int:
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
    if args.json:
        print(
            json.dumps(
                {
                    "prefill_step_deferred_s": step["deferred"],
                    "prefill_step_eager_s": step["eager"],
                    "deferred_over_eager": ratio,
                    "decode": {
                        name: {"tokens_per_s": tps, "acceptance_rate": acc} for name, (tps, acc) in rows.items()
                    },
                }
            )
        )
    return 0
