"""Build a model from a Hugging Face model directory, or the built-in `tiny` preset.

Nothing is ever downloaded: `tiny` is seeded random weights and a byte-level
tokenizer; anything else must be a local directory with config.json and safetensors.
"""

from __future__ import annotations

import json
import pathlib
from dataclasses import dataclass

import torch

from kvservice.config import ModelConfig
from kvservice.model import CausalLM, RotaryEmbedding, fuse_checkpoint_weights
from kvservice.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer

TINY_MODEL = "tiny"
TINY_CONFIG = ModelConfig(
    architecture="llama",
    vocab_size=320,
    hidden_size=128,
    intermediate_size=352,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=4096,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    eos_token_ids=(ByteTokenizer.EOS,),
    bos_token_id=ByteTokenizer.BOS,
    dtype="float32",
)
TINY_SEED = 1234
TINY_INIT_STD = 0.08

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ModelLoadError(ValueError):
    """A model that cannot be loaded: the message names the path or field."""


@dataclass(slots=True)
class LoadedModel:
    config: ModelConfig
    model: CausalLM
    tokenizer: Tokenizer | None
    dtype: torch.dtype
    device: torch.device


def resolve_dtype(name: str, config: ModelConfig) -> torch.dtype:
    key = config.dtype if name == "auto" else name
    if key not in _DTYPES:
        raise ModelLoadError(f"dtype: unsupported {key!r} (supported: {', '.join(_DTYPES)})")
    return _DTYPES[key]


def load_model_config(model: str) -> ModelConfig:
    """The config alone (cheap): for sizing the KV cache before the weights load."""
    if model == TINY_MODEL:
        return TINY_CONFIG
    path = _model_dir(model)
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ModelLoadError(f"model {model!r}: missing config.json")
    try:
        hf_config = json.loads(config_file.read_text())
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"model {model!r}: bad config.json ({e})") from e
    try:
        return ModelConfig.from_hf_config(hf_config)
    except KeyError as e:
        raise ModelLoadError(f"model {model!r}: config.json lacks {e}") from e
    except ValueError as e:  # unsupported architecture, inconsistent shape
        raise ModelLoadError(f"model {model!r}: config.json: {e}") from e


def load_model(model: str, dtype: str = "auto", device: str = "cpu", max_positions: int | None = None) -> LoadedModel:
    config = load_model_config(model)
    torch_dtype = resolve_dtype(dtype, config)
    dev = torch.device(device)
    positions = max_positions or config.max_position_embeddings
    if model == TINY_MODEL:
        net = _tiny_model(config, positions)
        tokenizer: Tokenizer | None = ByteTokenizer()
    else:
        path = _model_dir(model)
        net = _hf_model(path, config, positions)
        tokenizer_file = path / "tokenizer.json"
        tokenizer = HFTokenizer(tokenizer_file) if tokenizer_file.is_file() else None
    net = net.to(device=dev, dtype=torch_dtype).eval()
    # The rope tables stay float32 whatever the weights' dtype; they are cast per step.
    net.rotary.to(dtype=torch.float32)
    return LoadedModel(config, net, tokenizer, torch_dtype, dev)


def _model_dir(model: str) -> pathlib.Path:
    path = pathlib.Path(model).expanduser()
    if not path.is_dir():
        raise ModelLoadError(f"model {model!r}: not 'tiny' and not a model directory")
    return path


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


def _hf_model(path: pathlib.Path, config: ModelConfig, max_positions: int) -> CausalLM:
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
    state = fuse_checkpoint_weights(state, config.num_hidden_layers)
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
    net.rotary = RotaryEmbedding(config, max_positions)
    return net
