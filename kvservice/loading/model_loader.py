"""Build a model's weights from a Hugging Face model directory, a GGUF file, or a preset
(`model_files` finds the model and reads its config and tokenizer).

`tiny` is seeded random weights; a directory holds safetensors, a GGUF file its own tensors
(see `gguf_loader`). Both formats end as a Hugging Face state dict that `_build_model` loads; a float32 GGUF model
on CPU (bfloat16 too, on a CPU without bfloat16 matmuls) also keeps its Q4_1/Q8_0 blocks for
small-batch matmuls (`kvservice.model.block_quant`). A large GGUF file is converted once:
its config, tokenizer and fused weights are kept on disk and memory-mapped by later
processes (`converted_cache`).
"""

from __future__ import annotations

import json
import pathlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kvservice.config import ModelConfig, ModelLoadError
from kvservice.loading import converted_cache
from kvservice.loading.model_files import TINY_MODEL, load_model_config, load_tokenizer, model_name, model_path
from kvservice.loading.tokenizer import Tokenizer
from kvservice.model.block_quant import BlockQuantWeight
from kvservice.model.model import CausalLM, fuse_checkpoint_weights, is_block_quant_faster

if TYPE_CHECKING:
    from kvservice.loading.gguf_loader import BlockRows

TINY_SEED = 1234
TINY_INIT_STD = 0.08

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(slots=True)
class LoadedModel:
    config: ModelConfig
    model: CausalLM
    tokenizer: Tokenizer | None
    dtype: torch.dtype
    device: torch.device
    # What to call the model (the served model name's default): a GGUF's `general.name`,
    # a directory's name, or "tiny".
    name: str = ""


def resolve_dtype(name: str, config: ModelConfig) -> torch.dtype:
    key = config.dtype if name == "auto" else name
    if key not in _DTYPES:
        raise ModelLoadError(f"dtype: unsupported {key!r} (supported: {', '.join(_DTYPES)})")
    return _DTYPES[key]


def load_model(model: str, dtype: str = "auto", device: str = "cpu", max_positions: int | None = None) -> LoadedModel:
    """Config, weights (on `device`, in `dtype`) and tokenizer of `model`: a preset, directory or GGUF file."""
    config = load_model_config(model)
    torch_dtype = resolve_dtype(dtype, config)
    dev = torch.device(device)
    positions = max_positions or config.max_position_embeddings
    if model == TINY_MODEL:
        net = _tiny_model(config, positions)
    elif (path := model_path(model)).is_file():
        net = _gguf_model(
            path, config, torch_dtype, positions, dev.type == "cpu" and is_block_quant_faster(torch_dtype)
        )
    else:
        net = _build_model(
            fuse_checkpoint_weights(_read_safetensors(path), config.num_hidden_layers), config, positions, path
        )
    tokenizer, name = load_tokenizer(model), model_name(model)
    net = net.to(device=dev, dtype=torch_dtype).eval()
    # The rope tables stay float32 whatever the weights' dtype; they are cast per step.
    net.rotary.to(dtype=torch.float32)
    return LoadedModel(config, net, tokenizer, torch_dtype, dev, name)


_LINEAR_NAMES = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head")


def _block_quant_weights(rows: dict[str, BlockRows], config: ModelConfig) -> dict[str, BlockQuantWeight]:
    """The GGUF's block-quantized matrices, fused like the float32 weights, by `Linear` module name."""
    codes, scales, mins = (
        fuse_checkpoint_weights({name: r[i] for name, r in rows.items()}, config.num_hidden_layers) for i in range(3)
    )
    weights: dict[str, BlockQuantWeight] = {}
    for name, value in codes.items():
        module = name.removesuffix(".weight")
        if config.tie_word_embeddings and module == "model.embed_tokens":
            module = "lm_head"
        # Only whole fused layers (q, k and v all block-quantized, ...), in the kernel's shapes.
        if module.rsplit(".", 1)[-1] in _LINEAR_NAMES and BlockQuantWeight.is_supported_shape(*value.shape):
            weights[module] = BlockQuantWeight.from_rows(value, scales[name], mins[name])
    return weights


def _gguf_model(
    path: pathlib.Path, config: ModelConfig, dtype: torch.dtype, max_positions: int, use_blocks: bool
) -> CausalLM:
    """A GGUF file's model: from its converted entry when there is one, else converted now
    (and the entry written, block-quantized weights included, for the next process)."""

    def convert(is_cached: bool) -> converted_cache.Weights:
        from kvservice.loading.gguf_loader import gguf_block_quant_rows, gguf_state_dict, open_gguf

        file = open_gguf(path)
        state = fuse_checkpoint_weights(gguf_state_dict(file, config, dtype), config.num_hidden_layers)
        # The entry keeps the blocks for the next process, whether or not this one uses them.
        blocks = _block_quant_weights(gguf_block_quant_rows(file, config), config) if use_blocks or is_cached else {}
        return state, blocks

    state, blocks = converted_cache.read_or_convert(
        path,
        lambda entry: converted_cache.read_weights(entry, dtype),
        convert,
        lambda entry, weights: converted_cache.write_weights(entry, dtype, weights),
    )
    net = _build_model(state, config, max_positions, path)
    if use_blocks:
        net.use_block_quant(blocks)
    return net


def _tiny_model(config: ModelConfig, max_positions: int) -> CausalLM:
    gen = torch.Generator().manual_seed(TINY_SEED)
    net = CausalLM(config, max_positions)
    with torch.no_grad():
        for name, param in net.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.copy_(torch.randn(param.shape, generator=gen) * TINY_INIT_STD)
    return net


def _read_safetensors(path: pathlib.Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    index = path / "model.safetensors.index.json"
    if index.is_file():
        shard_names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        shards = [path / name for name in shard_names]
        missing = [s.name for s in shards if not s.is_file()]
        if missing:
            raise ModelLoadError(f"model {str(path)!r}: missing weight shard {missing[0]}")
    else:
        shards = sorted(path.glob("*.safetensors"))
        if not shards:
            raise ModelLoadError(f"model {str(path)!r}: no *.safetensors weights")
    state: dict[str, torch.Tensor] = {}
    for shard in shards:
        state.update(load_file(str(shard)))
    return state


def _build_model(
    state: dict[str, torch.Tensor], config: ModelConfig, max_positions: int, path: pathlib.Path
) -> CausalLM:
    """The model holding `state`, a checkpoint under Hugging Face's names (from safetensors or
    GGUF) with q/k/v and gate/up fused (`fuse_checkpoint_weights`)."""
    with torch.device("meta"):
        net = CausalLM(config, max_positions)
    result = net.load_state_dict(state, strict=False, assign=True)
    missing_keys = [k for k in result.missing_keys if not (k == "lm_head.weight" and config.tie_word_embeddings)]
    if missing_keys:
        raise ModelLoadError(f"model {str(path)!r}: missing weight {missing_keys[0]}")
    if config.tie_word_embeddings:
        net.lm_head.weight = net.model.embed_tokens.weight
    unexpected = [k for k in result.unexpected_keys if "rotary_emb" not in k]
    if unexpected:
        raise ModelLoadError(f"model {str(path)!r}: unexpected weight {unexpected[0]}")
    return net
