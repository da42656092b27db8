"""`kvservice bench engine`: prefill and decode tokens/s, kvservice vs transformers' generate.

Same weights, same dtype, same prompts (token ids), same thread count, same run; greedy.
`--model` takes anything `load_model` accepts, or one of `RANDOM_SHAPES`: a random Llama
of that shape saved as a Hugging Face directory for the run (no real weights needed).
transformers gets the engine's own loaded weights, so both sides run the same model.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import tempfile
import time
from dataclasses import asdict, dataclass

import torch

from kvservice.config import EngineConfig, ModelConfig
from kvservice.core.sampling_params import SamplingParams
from kvservice.engine.engine import LLMEngine
from kvservice.engine.engine_builder import build_engine
from kvservice.model.model import CausalLM

BENCH_MODEL = dict(
    vocab_size=32000,
    hidden_size=256,
    intermediate_size=688,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=2048,
    initializer_range=0.2,
    tie_word_embeddings=False,
)
# SmolLM2-135M's shape (the `smollm2` preset's), for random weights where its GGUF is not
# installed (the device machine). The loader reads the shape from the GGUF; a test holds this
# copy equal to `hf_config_arguments(load_model_config("smollm2"))`.
SMOLLM2_SHAPE = dict(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    max_position_embeddings=8192,
    rms_norm_eps=1e-5,
    rope_theta=100000.0,
    rope_scaling=None,
    tie_word_embeddings=True,
    attention_bias=False,
)
RANDOM_SHAPES: dict[str, dict] = {
    "random-smollm2": {**SMOLLM2_SHAPE, "initializer_range": 0.2},
    "random-small": BENCH_MODEL,
}


def hf_config_arguments(cfg: ModelConfig) -> dict:
    """transformers' config arguments for a model of `cfg`'s shape (Llama, Qwen2 or Mistral)."""
    return dict(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim,
        max_position_embeddings=cfg.max_position_embeddings,
        rms_norm_eps=cfg.rms_norm_eps,
        rope_theta=cfg.rope_theta,
        rope_scaling=cfg.rope_scaling,
        tie_word_embeddings=cfg.tie_word_embeddings,
        **({"attention_bias": cfg.attention_bias} if cfg.architecture == "llama" else {}),
    )


@dataclass(slots=True)
class Throughput:
    prefill_tokens_per_s: float
    decode_tokens_per_s: float


@dataclass(slots=True)
class EngineBenchRow:
    batch_size: int
    kvservice: Throughput
    transformers: Throughput

    @property
    def prefill_ratio(self) -> float:
        return self.kvservice.prefill_tokens_per_s / self.transformers.prefill_tokens_per_s

    @property
    def decode_ratio(self) -> float:
        return self.kvservice.decode_tokens_per_s / self.transformers.decode_tokens_per_s


def save_bench_model(path: pathlib.Path, shape: dict | None = None) -> None:
    """A random Llama of `shape` (default `BENCH_MODEL`) as a Hugging Face directory at `path`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**(shape or BENCH_MODEL))).save_pretrained(path)


def reference_model(model: CausalLM, dtype: torch.dtype) -> torch.nn.Module:
    """transformers' model for the same architecture, holding a copy of `model`'s weights."""
    import transformers

    cfg: ModelConfig = model.config
    names = {"llama": "Llama", "qwen2": "Qwen2", "mistral": "Mistral"}[cfg.architecture]
    hf_config = getattr(transformers, f"{names}Config")(**hf_config_arguments(cfg))
    hf = getattr(transformers, f"{names}ForCausalLM")(hf_config)
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    state: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        if ".qkv_proj." in name:
            for proj, part in zip(("q", "k", "v"), tensor.split([q, kv, kv])):
                state[name.replace("qkv_proj", f"{proj}_proj")] = part.clone()
        elif ".gate_up_proj." in name:
            for proj, part in zip(("gate", "up"), tensor.chunk(2)):
                state[name.replace("gate_up_proj", f"{proj}_proj")] = part.clone()
        elif not name.startswith("rotary."):
            state[name] = tensor.clone()
    result = hf.load_state_dict(state, strict=False)
    missing = [k for k in result.missing_keys if not (k == "lm_head.weight" and cfg.tie_word_embeddings)]
    assert not missing and not result.unexpected_keys, (missing, result.unexpected_keys)
    return hf.to(dtype).eval()


def bench_kvservice(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> Throughput:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for prompt in prompts:
        engine.add_request(prompt, params)
    t0 = time.perf_counter()
    engine.step()  # every prompt fits one step's token budget: this is the prefill
    t1 = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    t2 = time.perf_counter()
    num_prompt = sum(len(p) for p in prompts)
    return Throughput(num_prompt / (t1 - t0), len(prompts) * (max_tokens - 1) / (t2 - t1))


def bench_transformers(model: torch.nn.Module, prompts: list[list[int]], max_tokens: int) -> Throughput:
    device = next(model.parameters()).device
    ids = torch.tensor(prompts, device=device)
    kwargs = dict(do_sample=False, pad_token_id=0, eos_token_id=None)
    with torch.inference_mode():
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=1, min_new_tokens=1, **kwargs)
        _synchronize(device)
        t1 = time.perf_counter()
        model.generate(ids, max_new_tokens=max_tokens, min_new_tokens=max_tokens, **kwargs)
        _synchronize(device)
        t2 = time.perf_counter()
    prefill_s = t1 - t0
    decode_s = (t2 - t1) - prefill_s
    return Throughput(ids.numel() / prefill_s, len(prompts) * (max_tokens - 1) / decode_s)


def _synchronize(device: torch.device) -> None:
    """Wait for the device's queued work, so a timer read after it counts that work."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run(
    batch_sizes: list[int],
    prompt_len: int,
    max_tokens: int,
    repeats: int,
    model: str = "random-small",
    dtype: str = "float32",
    device: str = "cpu",
) -> list[EngineBenchRow]:
    with tempfile.TemporaryDirectory() as tmp:
        if model in RANDOM_SHAPES:
            save_bench_model(pathlib.Path(tmp), RANDOM_SHAPES[model])
            model = tmp
        num_blocks = max(batch_sizes) * -(-(prompt_len + max_tokens) // 16) + 16
        config = EngineConfig(dtype=dtype, max_num_seqs=max(batch_sizes), num_blocks=num_blocks, device=device)
        engine = build_engine(model, config)
        hf = reference_model(engine.core.loaded.model, engine.core.loaded.dtype).to(engine.core.loaded.device)
        vocab_size = engine.model_config.vocab_size
        gen = torch.Generator().manual_seed(0)
        rows = []
        for batch in batch_sizes:
            prompts = [torch.randint(0, vocab_size, (prompt_len,), generator=gen).tolist() for _ in range(batch)]
            bench_kvservice(engine, prompts, 4)  # warm-up
            bench_transformers(hf, prompts, 4)
            best_kv = best_hf = None
            for _ in range(repeats):  # alternate, keep each side's best: noise hits both alike
                kv = bench_kvservice(engine, prompts, max_tokens)
                ref = bench_transformers(hf, prompts, max_tokens)
                best_kv = kv if best_kv is None or kv.decode_tokens_per_s > best_kv.decode_tokens_per_s else best_kv
                best_hf = ref if best_hf is None or ref.decode_tokens_per_s > best_hf.decode_tokens_per_s else best_hf
            assert best_kv is not None and best_hf is not None
            rows.append(EngineBenchRow(batch, best_kv, best_hf))
    return rows


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        default="random-smollm2",
        help="what `kvservice serve --model` accepts (tiny, a model directory, ...), or a random model: "
        f"{', '.join(RANDOM_SHAPES)} (default: random-smollm2, SmolLM2-135M's shape)",
    )
    parser.add_argument(
        "--dtype", default="float32", choices=["float32", "bfloat16"], help="weights and KV cache (default: float32)"
    )
    parser.add_argument("--device", default="cpu", help="'cpu' or 'cuda[:N]', both sides (default: cpu)")
    parser.add_argument(
        "--batch-sizes", type=int, nargs="+", default=[1, 16], help="batch sizes to measure (default: 1 16)"
    )
    parser.add_argument("--prompt-len", type=int, default=32, help="prompt tokens per request (default: 32)")
    parser.add_argument("--max-tokens", type=int, default=128, help="new tokens per request (default: 128)")
    parser.add_argument("--repeats", type=int, default=3, help="runs per side; the best is kept (default: 3)")
    parser.add_argument(
        "--threads", type=int, default=None, help="torch threads, the same for both sides (default: torch's default)"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")


def main(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads or max(1, torch.get_num_threads()))
    rows = run(args.batch_sizes, args.prompt_len, args.max_tokens, args.repeats, args.model, args.dtype, args.device)
    print(
        f"model {args.model}, {args.dtype} on {args.device}, {torch.get_num_threads()} threads on both sides;"
        f" prompts of {args.prompt_len} tokens, {args.max_tokens} new"
    )
    print(
        f"{'batch':>5} | {'prefill tok/s kvservice':>24} {'transformers':>13} {'ratio':>6} |"
        f" {'decode tok/s kvservice':>23} {'transformers':>13} {'ratio':>6}"
    )
    for r in rows:
        print(
            f"{r.batch_size:>5} | {r.kvservice.prefill_tokens_per_s:>24.0f}"
            f" {r.transformers.prefill_tokens_per_s:>13.0f} {r.prefill_ratio:>6.2f} |"
            f" {r.kvservice.decode_tokens_per_s:>23.0f}"
            f" {r.transformers.decode_tokens_per_s:>13.0f} {r.decode_ratio:>6.2f}"
        )
    if args.json:
        print(
            json.dumps([{**asdict(r), "prefill_ratio": r.prefill_ratio, "decode_ratio": r.decode_ratio} for r in rows])
        )
    return 0
