"""Configuration: the model's shape (from a Hugging Face config.json or GGUF metadata) and the engine's knobs.

Plain Python: every config is frozen and validated when built, so a bad flag fails at
start-up with a message that names it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}
# GGUF's `general.architecture`: llama.cpp writes Mistral as "llama" too.
SUPPORTED_GGUF_ARCHITECTURES: dict[str, str] = {"llama": "llama", "qwen2": "qwen2"}
SUPPORTED_DTYPES = ("auto", "float32", "bfloat16", "float16")
# The KV cache's element type (`kvservice.model.kv_dtype`): "auto" is the model's compute dtype (exact).
KV_CACHE_DTYPES = ("auto", "bfloat16", "int8")
KV_LOAD_FAILURE_POLICIES = ("recompute", "fail")


class ModelLoadError(ValueError):
    """A model that cannot be loaded: the message names the path or field."""


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """The shape of a Llama-family decoder; `from_hf_config` reads config.json."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    dtype: str = "float32"

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0")

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> ModelConfig:
        """Build from a parsed Hugging Face config.json (transformers 4.x and 5.x spellings)."""
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ValueError(
                f"unsupported architecture {archs or cfg.get('model_type')!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        family = SUPPORTED_ARCHITECTURES[arch]
        # transformers 5 moved rope_theta / rope_scaling into rope_parameters.
        rope = dict(cfg.get("rope_parameters") or {})
        rope_theta = float(cfg.get("rope_theta", rope.get("rope_theta", 10000.0)))
        scaling = cfg.get("rope_scaling") or rope or None
        if scaling is not None:
            scaling = {k: v for k, v in scaling.items() if k != "rope_theta"}
            if scaling.get("rope_type", scaling.get("type", "default")) == "default":
                scaling = None
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        num_heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        return cls(
            architecture=family,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_hidden_layers=int(cfg["num_hidden_layers"]),
            num_attention_heads=num_heads,
            num_key_value_heads=int(cfg.get("num_key_value_heads") or num_heads),
            head_dim=int(cfg.get("head_dim") or hidden // num_heads),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=scaling,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            # Qwen2 always has q/k/v biases; Llama has them only with attention_bias.
            attention_bias=family == "qwen2" or bool(cfg.get("attention_bias", False)),
            eos_token_ids=eos_ids,
            bos_token_id=cfg.get("bos_token_id"),
            dtype=str(cfg.get("dtype") or cfg.get("torch_dtype") or "float32"),
        )

    @classmethod
    def from_gguf_metadata(cls, metadata: Mapping[str, Any], vocab_size: int, tie_word_embeddings: bool) -> ModelConfig:
        """Build from a GGUF file's metadata (llama.cpp's `{arch}.*` keys).

        The vocabulary size and tying come from the tensors (the embedding's rows, whether
        `output.weight` exists), which the metadata does not always state.
        Raises KeyError for a missing key and ValueError for what the model cannot run.
        """
        arch = metadata.get("general.architecture")
        if arch not in SUPPORTED_GGUF_ARCHITECTURES:
            raise ValueError(
                f"unsupported GGUF architecture {arch!r}; supported: {', '.join(SUPPORTED_GGUF_ARCHITECTURES)}"
            )
        family = SUPPORTED_GGUF_ARCHITECTURES[arch]

        def key(name: str) -> str:
            return f"{arch}.{name}"

        num_heads = int(metadata[key("attention.head_count")])
        hidden = int(metadata[key("embedding_length")])
        eos_ids = tuple(
            int(metadata[k])
            # End of turn / end of message: llama.cpp stops generation at these as at EOS.
            for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
            if metadata.get(k) is not None
        )
        bos = metadata.get("tokenizer.ggml.bos_token_id")
        return cls(
            architecture=family,
            vocab_size=vocab_size,
            hidden_size=hidden,
            intermediate_size=int(metadata[key("feed_forward_length")]),
            num_hidden_layers=int(metadata[key("block_count")]),
            num_attention_heads=num_heads,
            num_key_value_heads=int(metadata.get(key("attention.head_count_kv")) or num_heads),
            head_dim=int(metadata.get(key("attention.key_length")) or hidden // num_heads),
            max_position_embeddings=int(metadata[key("context_length")]),
            rms_norm_eps=float(metadata[key("attention.layer_norm_rms_epsilon")]),
            rope_theta=float(metadata.get(key("rope.freq_base"), 10000.0)),
            rope_scaling=_gguf_rope_scaling(metadata, arch),
            tie_word_embeddings=tie_word_embeddings,
            attention_bias=family == "qwen2",
            eos_token_ids=tuple(dict.fromkeys(eos_ids)),
            bos_token_id=None if bos is None else int(bos),
            # Quantized weights dequantize to float32: the CPU's dtype; pass a dtype to choose another.
            dtype="float32",
        )


def _gguf_rope_scaling(metadata: Mapping[str, Any], arch: str) -> dict[str, Any] | None:
    """`rope_scaling` from `{arch}.rope.scaling.*` (or the older `rope.scale_linear`)."""
    kind = metadata.get(f"{arch}.rope.scaling.type")
    factor = metadata.get(f"{arch}.rope.scaling.factor")
    if kind is None and metadata.get(f"{arch}.rope.scale_linear") is not None:
        kind, factor = "linear", metadata[f"{arch}.rope.scale_linear"]
    if kind in (None, "none") or (kind == "linear" and float(factor or 1.0) == 1.0):
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(factor or 1.0)}
    raise ValueError(f"{arch}.rope.scaling.type: unsupported {kind!r} (supported: none, linear)")


# A step's time grows with its prompt tokens and every decoding request waits for it. SmolLM2
# on 2 cores, 17 requests decoding (scripts: see docs/scheduling.md): a step takes
# 50 ms alone, 84 / 111 / 137 / 207 / 307 ms with 32 / 48 / 64 / 128 / 256 prompt tokens.
# 64 keeps the inter-token latency under load below vLLM's p99 (~190 ms at concurrency 16).
DEFAULT_MAX_PREFILL_TOKENS_WITH_DECODE = 64
# The step time that cap is sized for by measurement (`kvservice/engine/step_budget.py`). bench
# peers' concurrency-16 workload in-process (scripts/step_mix.py), 2 Zen 4 cores: the fixed 64
# gave 155-161 tok/s with a p99 forward of 169-182 ms; a 100 / 120 / 150 ms target 147 / 155 /
# 166 tok/s, p99 123 / 142 / 176 ms. 120: the same throughput, vLLM's p99 inter-token latency here.
DEFAULT_STEP_TARGET_MS = 120.0
# What a server aims at (`serve`, `launch`), whose streams see the step time as their inter-token
# latency: there a colocated worker's prompts run in its prompt lane and a prefill worker's beside
# its decode worker through the core lease, both in slices of what a decode step leaves of the
# target, at a big batch's speed whatever the slice. bench peers at concurrency 16, 2 Zen 4 cores,
# one run each: colocated 120 / 100 / 80 / 60 ms -> 178 / 180 / 180 / 167 tok/s, p99 ITL 122 / 97 /
# 83 / 68 ms; 1P1D 120 / 80 -> 161 / 163 tok/s, p99 131 / 92 ms. Below 80 the slices beside a 45 ms
# decode step of 16 requests get too short for the prompts to keep the decode batch full.
SERVING_STEP_TARGET_MS = 80.0
# What `launch` aims at: its prefill and decode workers share the cores through the lease, and
# the decode-to-decode cycle the lease keeps within the target reaches the client a few ms wider
# (the decode step's own time varies from step to step, and the tokens cross the proxy). bench
# peers' concurrency-16 1P1D on 2 Zen 5 cores, alternating: 80 ms -> 377.4, 378.6, 368.1, 362.1
# tok/s, p99 ITL 89.9, 84.2, 86.3, 85.2 ms (vLLM's: 86-112); 70 ms -> 370.8, 377.8, 370.5, 354.7
# tok/s, p99 ITL 73.5, 76.1, 75.2, 76.5 ms. Where decode steps are slower the lease's cycle is three
# of them instead (`DecodeCycle`): ~100-150 ms on 2 Zen 3 cores.
LAUNCH_STEP_TARGET_MS = 70.0
DEFAULT_KV_CACHE_MIB = 1024  # a worker's KV cache when neither --num-blocks nor --kv-cache-mib is given
# Speculative decoding's proposers: a draft model, or prompt lookup (n-grams of the request's own tokens).
SPECULATIVE_METHODS = ("draft", "ngram")
# Prompt lookup tries the request's last 4, 3, then 2 tokens. A single token matches too often by
# chance, and every rejected proposal costs the verify forward a token. SmolLM2, K=3, greedy, 6 chat
# questions (up to 96 tokens): min 1 proposed 373 tokens, 10% accepted; min 2: 91, 23%; min 3: 33, 30%.
# Asked to repeat a passage: 283 / 273 / 252 accepted of 419 tokens.
DEFAULT_PROMPT_LOOKUP_MAX = 4
DEFAULT_PROMPT_LOOKUP_MIN = 2


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """The engine's knobs: cache geometry, batching limits, placement."""

    block_size: int = 16
    num_blocks: int | None = None  # None: derived from kv_cache_memory_bytes
    # SmolLM2: 23k tokens, 16 requests of 384 tokens with room to spare (256 MiB held 5.8k: at
    # concurrency 16 the scheduler preempted and recomputed requests, 192 against 207-215 output tok/s).
    kv_cache_memory_bytes: int = DEFAULT_KV_CACHE_MIB << 20
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    # Prompt tokens a step computes while requests decode (None: max_num_batched_tokens).
    max_prefill_tokens_with_decode: int | None = DEFAULT_MAX_PREFILL_TOKENS_WITH_DECODE
    # While requests decode, size that cap by measured step time to aim at this step time (ms);
    # None: the fixed cap above (which also serves until the first steps are measured).
    step_target_ms: float | None = DEFAULT_STEP_TARGET_MS
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    device: str = "cpu"
    dtype: str = "auto"
    # What the KV cache stores (KV_CACHE_DTYPES): "auto", the compute dtype, or fewer bytes a value.
    kv_cache_dtype: str = "auto"
    seed: int = 0
    kv_load_failure_policy: str = "recompute"
    # Speculative decoding: a proposer suggests up to num_speculative_tokens tokens a step, which the
    # target verifies. "draft": a draft model (same vocabulary); "ngram": prompt lookup, the tokens
    # that followed the latest earlier occurrence of the request's last n tokens (n from
    # prompt_lookup_max down to prompt_lookup_min); None: off. A draft_model alone means "draft".
    speculative_method: str | None = None
    draft_model: str | None = None
    num_speculative_tokens: int = 0
    prompt_lookup_max: int = DEFAULT_PROMPT_LOOKUP_MAX
    prompt_lookup_min: int = DEFAULT_PROMPT_LOOKUP_MIN
    # A measured baseline, not a setting to serve with: a prefill worker with a draft waits for the
    # target's KV save before the draft pass (eager finalize) instead of running it meanwhile.
    kv_save_before_draft: bool = False
    # Automatic prefix caching: full blocks are kept, keyed by their tokens, and shared.
    enable_prefix_caching: bool = True
    # A colocated worker computes prompts in batches of up to max_num_batched_tokens, in slices of
    # time between its decode steps, instead of chunks inside them (`kvservice.worker.prompt_lane`).
    prompt_lane: bool = False

    @property
    def step_target_s(self) -> float:
        """The step target in seconds; without one (chunks of the fixed cap), the default's, which
        the prompt lane and the core lease still slice by."""
        return (self.step_target_ms or DEFAULT_STEP_TARGET_MS) / 1000

    def __post_init__(self) -> None:
        self._check_sizes()
        if self.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(SUPPORTED_DTYPES)}, got {self.dtype!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if self.device != "cpu" and not self.device.startswith("cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {self.device!r}")
        self._check_speculative()
        if self.kv_load_failure_policy not in KV_LOAD_FAILURE_POLICIES:
            raise ValueError(
                f"kv_load_failure_policy must be one of {', '.join(KV_LOAD_FAILURE_POLICIES)}, "
                f"got {self.kv_load_failure_policy!r}"
            )

    def _check_speculative(self) -> None:
        """The speculative fields agree: a method with its proposer and K > 0, or no method and K = 0."""
        if self.speculative_method is None and self.draft_model is not None:
            object.__setattr__(self, "speculative_method", "draft")  # frozen: the one normalisation
        method, k = self.speculative_method, self.num_speculative_tokens
        if method is not None and method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_method must be one of {', '.join(SPECULATIVE_METHODS)}, got {method!r}")
        if k < 0:
            raise ValueError(f"num_speculative_tokens must be >= 0, got {k}")
        if method is None and k > 0:
            raise ValueError(
                f"num_speculative_tokens={k} needs a speculative_method: 'ngram', or 'draft' with a draft_model"
            )
        if method is not None and k == 0:
            given = "" if self.draft_model is None else f" (draft_model={self.draft_model!r})"
            raise ValueError(f"speculative_method={method!r}{given} needs num_speculative_tokens > 0")
        if method == "draft" and self.draft_model is None:
            raise ValueError("speculative_method='draft' needs a draft_model")
        if method == "ngram" and self.draft_model is not None:
            raise ValueError(f"draft_model={self.draft_model!r}: speculative_method='ngram' proposes without a model")
        _check_positive(prompt_lookup_min=self.prompt_lookup_min)
        if self.prompt_lookup_max < self.prompt_lookup_min:
            raise ValueError(
                f"prompt_lookup_max must be >= prompt_lookup_min ({self.prompt_lookup_min}), "
                f"got {self.prompt_lookup_max}"
            )

    def _check_sizes(self) -> None:
        """Cache geometry and batching limits: a power-of-two block size, every other size > 0 where set."""
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        _check_positive(
            num_blocks=self.num_blocks,
            kv_cache_memory_bytes=self.kv_cache_memory_bytes,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            step_target_ms=self.step_target_ms,
            max_prefill_tokens_with_decode=self.max_prefill_tokens_with_decode,
            max_model_len=self.max_model_len,
        )


def _check_positive(**values: float | None) -> None:
    """ValueError naming the first of `values` that is set (not None) and not > 0."""
    for name, value in values.items():
        if value is not None and not value > 0:
            raise ValueError(f"{name} must be > 0, got {value}")
