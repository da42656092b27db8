"""One GGUF file as a model: its metadata is the config, its tensors dequantize to a state dict.

The tensors are renamed to Hugging Face's names, so `model_loader` builds the model from them
on the same path as safetensors. llama.cpp's converter stores Llama's q/k projections with the
two rotary halves of each head interleaved (its rope rotates adjacent pairs); `unpermute_qk`
puts the rows back in Hugging Face's order. Every quantization type that the `gguf` package
can dequantize loads; anything else fails with a one-line `ModelLoadError` naming it.
"""

from __future__ import annotations

import dataclasses
import functools
import pathlib
import re
from dataclasses import dataclass
from typing import Any, NamedTuple

import gguf
import numpy as np
import torch

from kvservice.config import ModelConfig, ModelLoadError

GGUF_MAGIC = b"GGUF"
ROPE_FREQS = "rope_freqs.weight"  # consumed by the config, not a weight

# blk.N.<name> -> model.layers.N.<hf name>
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_TENSOR_NAME = re.compile(r"(?:blk\.(?P<layer>\d+)\.)?(?P<name>\w+)\.(?P<kind>weight|bias)")


@dataclass(frozen=True, slots=True)
class GGUFFile:
    """A parsed GGUF file: scalar metadata eagerly, arrays and tensors on demand (memory-mapped)."""

    path: pathlib.Path
    reader: gguf.GGUFReader
    metadata: dict[str, Any]  # every non-array field

    def array(self, key: str) -> list[Any] | None:
        """An array field's values (token lists, merges), or None when the file lacks it."""
        field = self.reader.fields.get(key)
        return None if field is None else list(field.contents())

    def tensor(self, name: str) -> gguf.ReaderTensor | None:
        return next((t for t in self.reader.tensors if t.name == name), None)


def is_gguf_file(path: pathlib.Path) -> bool:
    """Whether `path` is a file that starts with GGUF's magic."""
    if not path.is_file():
        return False
    with path.open("rb") as f:
        return f.read(4) == GGUF_MAGIC


def open_gguf(path: pathlib.Path) -> GGUFFile:
    """Parse `path` (cached: the config and the weights are read in two calls, parsing costs seconds)."""
    stat = path.stat()
    return _open_gguf(path.resolve(), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=2)
def _open_gguf(path: pathlib.Path, mtime_ns: int, size: int) -> GGUFFile:
    try:
        reader = gguf.GGUFReader(path)
    except (ValueError, OSError, KeyError) as e:  # truncated file, unknown value or tensor type
        raise ModelLoadError(f"model {str(path)!r}: unreadable GGUF ({e})") from e
    metadata = {
        name: field.contents()
        for name, field in reader.fields.items()
        if field.types and field.types[0] != gguf.GGUFValueType.ARRAY
    }
    return GGUFFile(path, reader, metadata)


def gguf_model_config(file: GGUFFile) -> ModelConfig:
    """The model's shape from the metadata; the vocabulary and tying from the tensors."""
    embed = file.tensor("token_embd.weight")
    if embed is None:
        raise ModelLoadError(f"model {str(file.path)!r}: missing tensor token_embd.weight")
    try:
        config = ModelConfig.from_gguf_metadata(
            file.metadata,
            vocab_size=int(embed.shape[1]),  # ggml order: [hidden, vocab]
            tie_word_embeddings=file.tensor("output.weight") is None,
        )
    except KeyError as e:
        raise ModelLoadError(f"model {str(file.path)!r}: GGUF metadata lacks {e}") from e
    except ValueError as e:
        raise ModelLoadError(f"model {str(file.path)!r}: {e}") from e
    freqs = file.tensor(ROPE_FREQS)
    if freqs is None:
        return config
    # Llama 3's rope scaling, as llama.cpp's converter stores it: a divisor per frequency.
    factors = dequantize_tensor(freqs, torch.float32).flatten().tolist()
    if len(factors) != config.head_dim // 2 or config.rope_scaling is not None:
        raise ModelLoadError(
            f"model {str(file.path)!r}: {ROPE_FREQS} holds {len(factors)} factors for head_dim {config.head_dim}"
            + ("" if config.rope_scaling is None else " and the metadata sets rope scaling too")
        )
    return dataclasses.replace(config, rope_scaling={"rope_type": "freq_factors", "factors": tuple(factors)})


def gguf_state_dict(file: GGUFFile, config: ModelConfig, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Every tensor dequantized to `dtype`, under its Hugging Face name, q/k un-permuted for Llama."""
    state: dict[str, torch.Tensor] = {}
    for tensor in file.reader.tensors:
        if tensor.name == ROPE_FREQS:
            continue
        hf_name = hf_tensor_name(tensor.name)
        if hf_name is None:
            raise ModelLoadError(f"model {str(file.path)!r}: unexpected tensor {tensor.name}")
        value = dequantize_tensor(tensor, dtype)
        if config.architecture == "llama" and tensor.name.split(".")[-2] in ("attn_q", "attn_k"):
            is_q = tensor.name.split(".")[-2] == "attn_q"
            value = unpermute_qk(value, config.num_attention_heads if is_q else config.num_key_value_heads)
        state[hf_name] = value
    return state


def gguf_block_quant_rows(file: GGUFFile, config: ModelConfig) -> dict[str, BlockRows]:
    """Each Q4_1 or Q8_0 matrix as `BlockRows`, under its Hugging Face name, q/k un-permuted for Llama."""
    state: dict[str, BlockRows] = {}
    for tensor in file.reader.tensors:
        rows = block_rows(tensor)
        hf_name = hf_tensor_name(tensor.name)
        if rows is None or hf_name is None:
            continue
        if config.architecture == "llama" and tensor.name.split(".")[-2] in ("attn_q", "attn_k"):
            num_heads = (
                config.num_attention_heads if tensor.name.split(".")[-2] == "attn_q" else config.num_key_value_heads
            )
            rows = BlockRows(*(unpermute_qk(t, num_heads) for t in rows))
        state[hf_name] = rows
    return state


class BlockRows(NamedTuple):
    """A block-quantized [N, K] matrix, row-major: weight = scales * codes + mins, per block of 32."""

    codes: torch.Tensor  # int8 [N, K]
    scales: torch.Tensor  # float32 [N, K / 32]
    mins: torch.Tensor  # float32 [N, K / 32]


def block_rows(tensor: gguf.ReaderTensor) -> BlockRows | None:
    """A Q4_1 or Q8_0 matrix's blocks unpacked (`dequantize_tensor`'s values, exactly); None for other types."""
    kind = tensor.tensor_type
    if kind not in (gguf.GGMLQuantizationType.Q4_1, gguf.GGMLQuantizationType.Q8_0) or len(tensor.shape) != 2:
        return None
    num_cols, num_rows = (int(n) for n in tensor.shape)
    blocks = np.asarray(tensor.data, dtype=np.uint8).reshape(num_rows, num_cols // 32, -1)

    def halves(first: int) -> np.ndarray:  # a float16 field of every block -> float32 [N, K / 32]
        return np.ascontiguousarray(blocks[..., first : first + 2]).view(np.float16)[..., 0].astype(np.float32)

    scales = halves(0)
    if kind == gguf.GGMLQuantizationType.Q8_0:  # [d: f16][32 x int8]
        mins = np.zeros_like(scales)
        codes = np.ascontiguousarray(blocks[..., 2:]).view(np.int8)
    else:  # [d: f16][m: f16][16 bytes: weight j in the low nibble of byte j, weight 16 + j in the high]
        mins = halves(2)
        packed = blocks[..., 4:]
        codes = np.concatenate([packed & 0x0F, packed >> 4], axis=-1).astype(np.int8)
    return BlockRows(
        torch.from_numpy(codes.reshape(num_rows, num_cols)), torch.from_numpy(scales), torch.from_numpy(mins)
    )


def hf_tensor_name(name: str) -> str | None:
    """The Hugging Face name of GGUF tensor `name` (`blk.3.attn_q.weight` -> ...q_proj.weight)."""
    match = _TENSOR_NAME.fullmatch(name)
    if match is None:
        return None
    layer, short, kind = match["layer"], match["name"], match["kind"]
    if layer is None:
        base = _GLOBAL_TENSORS.get(short)
        return None if base is None else f"{base}.{kind}"
    base = _LAYER_TENSORS.get(short)
    return None if base is None else f"model.layers.{layer}.{base}.{kind}"


def dequantize_tensor(tensor: gguf.ReaderTensor, dtype: torch.dtype) -> torch.Tensor:
    """The tensor's values in `dtype`, shaped as PyTorch orders them ([out, in] for a matrix)."""
    try:
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError as e:
        raise ModelLoadError(f"tensor {tensor.name}: unsupported quantization type {tensor.tensor_type.name}") from e
    shape = tuple(int(n) for n in reversed(tensor.shape))  # ggml lists the fastest dimension first
    # F32 comes back as a read-only view of the mapped file: copy it, never alias the file.
    values = np.require(values.reshape(shape), dtype=np.float32, requirements=("C", "W"))
    return torch.from_numpy(values).to(dtype)


def unpermute_qk(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row order: within each head, rows (0, d/2, 1, d/2+1, ...) -> (0, 1, ..., d-1).

    The inverse of convert_hf_to_gguf's `permute(w, n_head, n_head_kv)`; works on [out, in]
    weights and [out] biases alike.
    """
    rows = weight.shape[0]
    head_dim = rows // num_heads
    # [heads, head_dim/2, 2, ...] -> [heads, 2, head_dim/2, ...]: the pairs go back to two halves.
    return weight.reshape(num_heads, head_dim // 2, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)
