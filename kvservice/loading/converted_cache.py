"""A GGUF model converted once and kept on disk: its config, tokenizer and fused weights.

Loading a GGUF file costs seconds of CPU in every process that loads it: parsing the
metadata (the token list), dequantizing every tensor, fusing q/k/v and gate/up, and laying
out the block-quantized copies. A launch starts several workers and a proxy on the same
file, so the first load writes what it built under `$KVSERVICE_CACHE_DIR` (default
`~/.cache/kvservice`) and later ones memory-map it (`torch.load(mmap=True)`): the workers
on one machine then share the weights' pages too.

An entry is keyed by the file's resolved path, size and modification time and by
`CACHE_VERSION`, so a changed file or a new layout is converted again. Each file of an entry
is written to a temporary name and renamed into place, so a reader never sees half of one
and two processes converting at once both leave a whole entry. Files under
`MIN_CACHED_BYTES` (test models: converting them is quicker than the cache) are not cached;
`KVSERVICE_CONVERTED_CACHE=0` turns the cache off.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import pathlib
import tempfile
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from kvservice.config import ModelConfig
from kvservice.loading.tokenizer import HFTokenizer, TokenizerConfig

if TYPE_CHECKING:  # the weights' half imports them when called: config and tokenizer stay torch-free
    import torch

    from kvservice.model.block_quant import BlockQuantWeight

log = logging.getLogger(__name__)

# Bump when what an entry holds, or how the weights are laid out, changes.
CACHE_VERSION = 1
MIN_CACHED_BYTES = 32 << 20
_CONFIG = "config.json"
_TOKENIZER = "tokenizer.json"
_TOKENIZER_CONFIG = "tokenizer_config.json"
_BLOCK_FIELDS = ("codes", "scales", "mins")

T = TypeVar("T")
Weights = tuple["dict[str, torch.Tensor]", "dict[str, BlockQuantWeight]"]


def cache_root() -> pathlib.Path | None:
    """Where entries live, or None when the cache is turned off."""
    if os.environ.get("KVSERVICE_CONVERTED_CACHE", "1") == "0":
        return None
    root = os.environ.get("KVSERVICE_CACHE_DIR")
    return pathlib.Path(root) if root else pathlib.Path.home() / ".cache" / "kvservice"


def entry_for(path: pathlib.Path) -> pathlib.Path | None:
    """The entry directory of the GGUF file `path`, or None when it is not to be cached."""
    root = cache_root()
    if root is None:
        return None
    stat = path.stat()
    if stat.st_size < MIN_CACHED_BYTES:
        return None
    resolved = path.resolve()
    key = hashlib.sha256(f"{resolved}|{stat.st_size}|{stat.st_mtime_ns}|v{CACHE_VERSION}".encode()).hexdigest()[:16]
    return root / "converted" / f"{resolved.stem}-{key}"


def read_or_convert(
    path: pathlib.Path,
    read: Callable[[pathlib.Path], T | None],
    convert: Callable[[bool], T],
    write: Callable[[pathlib.Path, T], None],
) -> T:
    """What `read` finds in the entry of `path`; else `convert(is_cached)` (is_cached: it will be
    written) and, when not None, written to the entry for the next process."""
    entry = entry_for(path)
    cached = None if entry is None else read(entry)
    if cached is not None:
        return cached
    value = convert(entry is not None)
    if entry is not None and value is not None:
        write(entry, value)
    return value


# ---------------------------------------------------------------- reading


def read_config(entry: pathlib.Path) -> ModelConfig | None:
    data = _read_json(entry / _CONFIG)
    if data is None:
        return None
    scaling = data.get("rope_scaling")
    if scaling is not None and "factors" in scaling:
        scaling["factors"] = tuple(scaling["factors"])
    return ModelConfig(**{**data, "eos_token_ids": tuple(data["eos_token_ids"])})


def read_tokenizer(entry: pathlib.Path) -> HFTokenizer | None:
    from tokenizers import Tokenizer as BackendTokenizer

    settings = _read_json(entry / _TOKENIZER_CONFIG)
    if settings is None or not (entry / _TOKENIZER).is_file():
        return None
    return HFTokenizer(BackendTokenizer.from_file(str(entry / _TOKENIZER)), TokenizerConfig(**settings))


def read_weights(entry: pathlib.Path, dtype: torch.dtype) -> Weights | None:
    """The fused state dict in `dtype` and the block-quantized weights, memory-mapped; None if absent."""
    import torch

    from kvservice.model.block_quant import BlockQuantWeight

    file = _weights_file(entry, dtype)
    if not file.is_file():
        return None
    try:
        saved = torch.load(file, mmap=True, weights_only=True)
    except Exception as e:  # noqa: BLE001 - a damaged entry is converted again
        log.warning("converted weights %s unreadable (%s): converting again", file, e)
        return None
    blocks = {
        module: BlockQuantWeight(*(saved["block_quant"][f"{module}.{field}"] for field in _BLOCK_FIELDS))
        for module in {name.rsplit(".", 1)[0] for name in saved["block_quant"]}
    }
    return saved["state"], blocks


# ---------------------------------------------------------------- writing


def write_config(entry: pathlib.Path, config: ModelConfig) -> None:
    _write(entry / _CONFIG, lambda f: f.write(json.dumps(dataclasses.asdict(config)).encode()))


def write_tokenizer(entry: pathlib.Path, tokenizer: HFTokenizer) -> None:
    _write(entry / _TOKENIZER, lambda f: f.write(tokenizer.backend.to_str().encode()))
    _write(entry / _TOKENIZER_CONFIG, lambda f: f.write(json.dumps(dataclasses.asdict(tokenizer.config)).encode()))


def write_weights(entry: pathlib.Path, dtype: torch.dtype, weights: Weights) -> None:
    state, blocks = weights
    import torch

    flat_blocks = {
        f"{module}.{field}": getattr(weight, field) for module, weight in blocks.items() for field in _BLOCK_FIELDS
    }
    # Tied weights are one tensor under two names: saved once, as torch.save shares storages.
    _write(_weights_file(entry, dtype), lambda f: torch.save({"state": state, "block_quant": flat_blocks}, f))


def _weights_file(entry: pathlib.Path, dtype: torch.dtype) -> pathlib.Path:
    return entry / f"weights-{str(dtype).removeprefix('torch.')}.pt"


def _write(target: pathlib.Path, fill: Callable[[Any], object]) -> None:
    """Write `target` whole or not at all (a temporary file renamed into place); best effort."""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.")
        try:
            with os.fdopen(fd, "wb") as f:
                fill(f)
            os.replace(tmp, target)
        except BaseException:
            os.unlink(tmp)
            raise
    except OSError as e:  # a read-only or full disk: the model still loads, uncached
        log.warning("could not cache %s: %s", target, e)


def _read_json(file: pathlib.Path) -> dict[str, Any] | None:
    try:
        return json.loads(file.read_text())
    except (OSError, json.JSONDecodeError):
        return None
