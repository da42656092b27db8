"""The tokenizer a benchmark's workload is counted (ShareGPT) or written (chat prompts) with.

Names are what `kvservice serve --model` takes (`tiny`, `smollm2`, a model directory, a
GGUF file: `model_files.load_tokenizer`), or a `tokenizer.json` file. Nothing is downloaded.
"""

from __future__ import annotations

from pathlib import Path

from kvservice.loading import model_files
from kvservice.loading.tokenizer import HFTokenizer, Tokenizer


def is_local_tokenizer(name: str) -> bool:
    """Whether `load_tokenizer` may find `name` here: a preset or an existing path."""
    return name in (model_files.TINY_MODEL, model_files.SMOLLM2_MODEL) or Path(name).expanduser().exists()


def load_tokenizer(name: str) -> Tokenizer:
    """The tokenizer of `name`; ValueError (naming `--tokenizer`) when there is none to load."""
    path = Path(name).expanduser()
    if path.is_file() and path.suffix == ".json":
        return HFTokenizer(path)
    try:
        tokenizer = model_files.load_tokenizer(name)
    except ValueError as e:  # ModelLoadError: not a preset, directory or GGUF file
        raise ValueError(f"--tokenizer: {e}") from None
    if tokenizer is None:
        raise ValueError(
            f"--tokenizer: {name!r} has no tokenizer (no tokenizer.json, or a GGUF file without a token list)"
        )
    return tokenizer
