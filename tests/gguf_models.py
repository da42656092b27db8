"""Small GGUF files for tests, written with the `gguf` package the way llama.cpp's converter writes them.

`write_gguf` takes a Hugging Face state dict (names and layout of transformers' Llama/Qwen2)
and writes its tensors under llama.cpp's names, q/k rows permuted for llama.cpp's rope,
each tensor in the quantization type asked for. `sentencepiece_vocab` trains a small
SentencePiece-style BPE vocabulary (bytes as `<0xNN>` pieces, as Llama's).
"""

from __future__ import annotations

import pathlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import gguf
import numpy as np
import torch
from hf_models import TOKENIZER_SENTENCES

from kvservice.model.block_quant import BlockQuantWeight

# Types the package can quantize (written from float weights) and types it only dequantizes
# (written as random raw blocks).
QUANTIZABLE_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")
RAW_BLOCK_TYPES = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")

_LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_GLOBAL_NAMES = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


@dataclass(frozen=True, slots=True)
class GGUFTokenizerSpec:
    """The `tokenizer.ggml.*` fields to write."""

    model: str
    tokens: list[str]
    token_types: list[int]
    merges: list[str] | None = None
    scores: list[float] | None = None
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    unknown_token_id: int | None = None
    add_bos_token: bool | None = None
    chat_template: str | None = None
    pre: str | None = None


@dataclass(slots=True)
class GGUFSpec:
    """A model's metadata: llama.cpp's `{arch}.*` keys."""

    arch: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    context_length: int = 256
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    name: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def permute_qk(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's converter order: each head's two rotary halves interleaved row by row."""
    rows = weight.shape[0]
    return weight.reshape(num_heads, 2, rows // num_heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def gguf_name(hf_name: str) -> str:
    stem, kind = hf_name.rsplit(".", 1)
    if stem in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[stem]}.{kind}"
    _, _, layer, rest = stem.split(".", 3)  # model.layers.N.<rest>
    return f"blk.{layer}.{_LAYER_NAMES[rest]}.{kind}"


def encode_tensor(values: np.ndarray, qtype: str, rng: np.random.Generator) -> np.ndarray:
    """`values` stored as `qtype`: quantized when the package can, else random raw blocks of that shape.

    Random blocks decode to some values, a few of them inf or NaN (random float16 scales):
    what matters is that the loader decodes them as the package does.
    """
    kind = gguf.GGMLQuantizationType[qtype]
    if qtype not in QUANTIZABLE_TYPES:
        block_size, type_size = gguf.GGML_QUANT_SIZES[kind]
        rows, cols = values.shape
        return rng.integers(0, 256, size=(rows, cols // block_size * type_size), dtype=np.uint8)
    return gguf.quants.quantize(values.astype(np.float32), kind)


def write_gguf(
    path: pathlib.Path,
    spec: GGUFSpec,
    state: Mapping[str, torch.Tensor | np.ndarray],
    qtype: str | Callable[[str], str] = "F32",
    tokenizer: GGUFTokenizerSpec | None = None,
    seed: int = 0,
    permute: bool | None = None,
    extra_tensors: Mapping[str, np.ndarray] | None = None,
) -> pathlib.Path:
    """Write `state` (Hugging Face names) as a GGUF file at `path`; returns `path`.

    `qtype` is one type, or a function of the GGUF tensor name (norms stay F32 in llama.cpp
    files: 1-D tensors are always written F32 here). q/k are permuted for `llama` unless
    `permute` says otherwise. `extra_tensors` are written as they are, under GGUF names.
    """
    rng = np.random.default_rng(seed)
    permute = spec.arch == "llama" if permute is None else permute
    writer = gguf.GGUFWriter(str(path), spec.arch)
    if spec.name is not None:
        writer.add_name(spec.name)
    writer.add_context_length(spec.context_length)
    writer.add_embedding_length(spec.hidden_size)
    writer.add_feed_forward_length(spec.intermediate_size)
    writer.add_block_count(spec.num_layers)
    writer.add_head_count(spec.num_heads)
    writer.add_head_count_kv(spec.num_kv_heads)
    writer.add_layer_norm_rms_eps(spec.rms_norm_eps)
    writer.add_rope_freq_base(spec.rope_theta)
    for key, value in spec.extra.items():
        if isinstance(value, str):
            writer.add_string(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        else:
            writer.add_uint32(key, value)
    if tokenizer is not None:
        _write_tokenizer(writer, tokenizer)
    for hf_name, tensor in state.items():
        values = tensor.detach().float().numpy() if isinstance(tensor, torch.Tensor) else np.asarray(tensor, np.float32)
        name = gguf_name(hf_name)
        if permute and name.split(".")[-2] in ("attn_q", "attn_k"):
            values = permute_qk(values, spec.num_heads if ".attn_q." in name else spec.num_kv_heads)
        kind = qtype(name) if callable(qtype) else qtype
        if values.ndim == 1 or kind == "F32":
            writer.add_tensor(name, np.ascontiguousarray(values, dtype=np.float32))
        else:
            writer.add_tensor(name, encode_tensor(values, kind, rng), raw_dtype=gguf.GGMLQuantizationType[kind])
    for name, values in (extra_tensors or {}).items():
        writer.add_tensor(name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _write_tokenizer(writer: gguf.GGUFWriter, tok: GGUFTokenizerSpec) -> None:
    writer.add_tokenizer_model(tok.model)
    if tok.pre is not None:
        writer.add_tokenizer_pre(tok.pre)
    writer.add_token_list(tok.tokens)
    writer.add_token_types(tok.token_types)
    if tok.merges is not None:
        writer.add_token_merges(tok.merges)
    if tok.scores is not None:
        writer.add_token_scores(tok.scores)
    for token_id, add in (
        (tok.bos_token_id, writer.add_bos_token_id),
        (tok.eos_token_id, writer.add_eos_token_id),
        (tok.unknown_token_id, writer.add_unk_token_id),
    ):
        if token_id is not None:
            add(token_id)
    if tok.add_bos_token is not None:
        writer.add_add_bos_token(tok.add_bos_token)
    if tok.chat_template is not None:
        writer.add_chat_template(tok.chat_template)


def spec_of(hf_config: Any, arch: str) -> GGUFSpec:
    """The metadata of a transformers config (LlamaConfig, Qwen2Config)."""
    return GGUFSpec(
        arch=arch,
        hidden_size=hf_config.hidden_size,
        intermediate_size=hf_config.intermediate_size,
        num_layers=hf_config.num_hidden_layers,
        num_heads=hf_config.num_attention_heads,
        num_kv_heads=hf_config.num_key_value_heads,
        context_length=hf_config.max_position_embeddings,
        rms_norm_eps=hf_config.rms_norm_eps,
        rope_theta=float(getattr(hf_config, "rope_theta", None) or hf_config.rope_parameters["rope_theta"]),
        name=f"tiny-{arch}",
    )


def random_state(spec: GGUFSpec, vocab_size: int, seed: int = 0, tied: bool = False) -> dict[str, torch.Tensor]:
    """Random weights of `spec`'s shape, under Hugging Face's names."""
    gen = torch.Generator().manual_seed(seed)
    head_dim = spec.hidden_size // spec.num_heads
    shapes: dict[str, Sequence[int]] = {
        "model.embed_tokens.weight": (vocab_size, spec.hidden_size),
        "model.norm.weight": (spec.hidden_size,),
    }
    if not tied:
        shapes["lm_head.weight"] = (vocab_size, spec.hidden_size)
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (spec.hidden_size,),
            p + "post_attention_layernorm.weight": (spec.hidden_size,),
            p + "self_attn.q_proj.weight": (spec.num_heads * head_dim, spec.hidden_size),
            p + "self_attn.k_proj.weight": (spec.num_kv_heads * head_dim, spec.hidden_size),
            p + "self_attn.v_proj.weight": (spec.num_kv_heads * head_dim, spec.hidden_size),
            p + "self_attn.o_proj.weight": (spec.hidden_size, spec.num_heads * head_dim),
            p + "mlp.gate_proj.weight": (spec.intermediate_size, spec.hidden_size),
            p + "mlp.up_proj.weight": (spec.intermediate_size, spec.hidden_size),
            p + "mlp.down_proj.weight": (spec.hidden_size, spec.intermediate_size),
        }
    return {name: torch.randn(shape, generator=gen) * 0.2 for name, shape in shapes.items()}


def sentencepiece_vocab(vocab_size: int = 400) -> tuple[list[str], list[int], list[str]]:
    """(tokens, token types, merges) of a small SentencePiece-style BPE trained on `TOKENIZER_SENTENCES`.

    Ids 0-2 are <unk> (UNKNOWN), <s> and </s> (CONTROL); 3-258 the byte pieces <0x00>..<0xFF> (BYTE);
    the last is `<think>` (USER_DEFINED); the rest are `▁`-spelled pieces (NORMAL), in merge order.
    """
    import json

    from tokenizers import SentencePieceBPETokenizer

    trainer_tok = SentencePieceBPETokenizer(replacement="\u2581", add_prefix_space=True)
    trainer_tok.train_from_iterator(TOKENIZER_SENTENCES, vocab_size=vocab_size, min_frequency=1, show_progress=False)
    model = json.loads(trainer_tok._tokenizer.to_str())["model"]
    learned = sorted(model["vocab"].items(), key=lambda kv: kv[1])
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256))]
    types = [2, 3, 3, *([6] * 256)]
    for piece, _ in learned:
        if piece not in tokens:
            tokens.append(piece)
            types.append(1)
    tokens.append("<think>")
    types.append(4)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    return tokens, types, merges


def byte_level_vocab(tmp_path: pathlib.Path) -> tuple[list[str], list[int], list[str]]:
    """(tokens, token types, merges) of a small byte-level BPE (`save_tokenizer`'s), plus two control tokens."""
    import json

    from hf_models import save_tokenizer

    # Written where no GGUF goes: transformers would load a tokenizer.json beside the GGUF instead.
    (tmp_path / "bpe").mkdir()
    model = json.loads(save_tokenizer(tmp_path / "bpe" / "tokenizer.json").read_text())["model"]
    tokens = [t for t, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1])]
    types = [3 if t in ("<unk>", "<s>", "</s>") else 1 for t in tokens]
    tokens += ["<|im_start|>", "<|im_end|>"]
    types += [3, 3]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    return tokens, types, merges


def random_block_quant_weight(num_rows: int, num_cols: int, is_signed: bool, seed: int) -> BlockQuantWeight:
    """A random [num_rows, num_cols] weight in the kernel's layout: Q8_0's signed 8-bit codes
    and no mins, or Q4_1's 4-bit codes and mins; float16 scales and mins, as GGUF stores them."""
    gen = torch.Generator().manual_seed(seed)
    low, high = (-128, 128) if is_signed else (0, 16)
    codes = torch.randint(low, high, (num_rows, num_cols), generator=gen, dtype=torch.int8)
    scales = (torch.rand(num_rows, num_cols // 32, generator=gen) * 0.01).half().float()
    mins = (
        torch.zeros_like(scales)
        if is_signed
        else (-torch.rand(num_rows, num_cols // 32, generator=gen) * 0.08).half().float()
    )
    return BlockQuantWeight.from_rows(codes, scales, mins)
