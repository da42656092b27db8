"""The tokenizer a benchmark's workload is counted (ShareGPT) or written (chat prompts) with.

Names are what `kvservice serve --model` takes: `tiny`, `smollm2`, a model directory or a
GGUF file; a `tokenizer.json` file works too. Nothing is downloaded.
"""

from __future__ import annotations

from pathlib import Path

from kvservice.model_loader import SMOLLM2_MODEL, TINY_MODEL, model_path
from kvservice.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer


def is_local_tokenizer(name: str) -> bool:
    """Whether `load_tokenizer` can find `name` here: a preset or an existing path."""
    return name in (TINY_MODEL, SMOLLM2_MODEL) or Path(name).expanduser().exists()


def load_tokenizer(name: str) -> Tokenizer:
    """The tokenizer of `name`; ValueError (naming `--tokenizer`) when there is none to load."""
    if name == TINY_MODEL:
        return ByteTokenizer()
    path = Path(name).expanduser()
    if path.is_file() and path.suffix == ".json":
        return HFTokenizer(path)
    try:
        resolved = model_path(name)
    except ValueError as e:
        raise ValueError(f"--tokenizer: {e}") from None
    if resolved.is_file():
        from kvservice.gguf_loader import open_gguf
        from kvservice.gguf_tokenizer import gguf_tokenizer

        tokenizer = gguf_tokenizer(open_gguf(resolved))
        if tokenizer is None:
            raise ValueError(f"--tokenizer: {name!r} is a GGUF file without a tokenizer")
        return tokenizer
    file = resolved / "tokenizer.json"
    if not file.is_file():
        raise ValueError(f"--tokenizer: {name!r} has no tokenizer.json")
    return HFTokenizer(file)
